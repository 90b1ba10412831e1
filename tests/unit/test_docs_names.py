"""Every module, `python -m` module, dotted name and source path that README.md and docs/*.md name exists in the tree.

Names are read from the text itself: `python -m X` anywhere, dotted names in backticks whose first part is the
kit (`bge_triton.x.y`, or a stage: `server.repository.load_config`), and paths of source files (`*.py`, `*.sh`).
A dotted name resolves to the longest module prefix that is a file of the tree; the rest must be a name that
module defines at top level (class, def, assignment, import) or an attribute of such a class. Nothing is imported.
What a user types from the README and the guides (commands, flags, paths, compose services and ports, variables, the
README's examples): test_docs_commands.py.
"""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
DOCS = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")])
STAGES = ("client", "export", "server", "loadtest", "gateway", "integrations", "verify", "errors", "paths", "cli",
          "demo", "extras", "kit")  # kit: the package's name before src/bge_triton, so that a stale one is caught
PYTHON_M = re.compile(r"python3? -m ([A-Za-z_][\w.]*)")
CLI = re.compile(r"(?<![\w/.:-])(?<!-n )(?<!namespace )bge-triton ([a-z][\w-]*)(?: ([a-z][\w-]*))?")
# the hand-overs issue 26 removed: each is a named scenario now (bench shipped, tune pair, bench soak)
HANDED_OVER = re.compile(r"--scenarios shipped|tune --pair|chaos --soak")
TICKED = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"^(bge_triton(?:\.\w+)+|(?:{})(?:\.\w+)+)(?:\(\))?$".format("|".join(STAGES)))
# a file named in backticks by its tail (`gpu/bench_gpu.py`, `text_core.py`): some file of the tree ends so
OUTSIDE = {"bge_triton_verify.py"}  # the name standalone.py gets inside an image (docs/export.md)
TICKED_FILE = re.compile(r"^[\w][\w/.-]*\.(?:py|sh)$")
SOURCE_PATH = re.compile(r"(?<![\w./-])((?:src/|deploy/|tests/|docs/)?(?:bge_triton/)?(?:{}|deploy|tests)/[\w/.-]*"
                         r"\.(?:py|sh))\b".format("|".join(STAGES)))


def module_file(dotted: str) -> Path | None:
    """The file of module `dotted` (bge_triton.x.y) in src/, or None."""
    base = SRC.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def top_level_names(path: Path) -> dict[str, set[str]]:
    """Names a module defines at top level -> the attribute names of each class (empty set for others)."""
    names: dict[str, set[str]] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = set()
        elif isinstance(node, ast.ClassDef):
            names[node.name] = {n.name for n in ast.walk(node) if isinstance(n, (ast.FunctionDef,
                                                                                   ast.AsyncFunctionDef))}
            names[node.name] |= {t.id for n in ast.walk(node) if isinstance(n, (ast.Assign, ast.AnnAssign))
                                 for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                                 if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Name):
                    names[t.id] = set()
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = set()
    return names


def resolves(dotted: str) -> bool:
    """A module of the tree, or a top-level name (or a class attribute) of one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = module_file(".".join(parts[:cut]))
        if path is None:
            continue
        rest = parts[cut:]
        if not rest:
            return True
        names = top_level_names(path)
        if rest[0] not in names:
            # a submodule named after the package's own attribute is checked above; anything else is missing
            return False
        return len(rest) == 1 or (len(rest) == 2 and rest[1] in names[rest[0]])
    return False


def names_in(text: str) -> set[tuple[str, str]]:
    """(kind, name) pairs the text refers to: ('module', m), ('dotted', d), ('path', p)."""
    # a name ending in "." or an upper-case part is a placeholder (python -m bge_triton.<module>, ...loadtest.X)
    # only the kit's own modules: `python -m pytest` / `pip` / `venv` are other projects' business
    found = {("module", m) for m in PYTHON_M.findall(text)
             if m.split(".")[0] == "bge_triton" and not m.endswith(".") and not re.search(r"\.[A-Z]+(\.|$)", m)}
    for tick in TICKED.findall(text):
        m = DOTTED.match(tick.strip())
        if m:
            found.add(("dotted", m.group(1)))
        elif TICKED_FILE.match(tick.strip()) and not re.search(r"NAME|_X\b|/X\b", tick) and tick not in OUTSIDE:
            found.add(("file", tick.strip()))
    found |= {("path", p) for p in SOURCE_PATH.findall(text) if not re.search(r"[<>*{}]|NAME|/X", p)}
    found |= {("command", " ".join(filter(None, m))) for m in CLI.findall(text)}
    found |= {("hand-over", m) for m in HANDED_OVER.findall(text)}
    return found


def runnable(module: str) -> bool:
    """`python -m module` runs something: a package with __main__.py, or a module with a __main__ block."""
    if module_file(module + ".__main__") is not None:
        return True
    path = module_file(module)
    return path is not None and path.name != "__init__.py" and "__name__ == \"__main__\"" in path.read_text(
        encoding="utf-8")


def command_exists(words: str) -> bool:
    """`bge-triton CMD [SCENARIO]`: CMD is a command; for bench and tune a second word is one of their scenarios."""
    from bge_triton import cli
    from bge_triton.loadtest import commands

    cmd, _, sub = words.partition(" ")
    tables = {"bench": commands.BENCH, "tune": commands.TUNE}
    return cmd in cli.COMMANDS and (not sub or cmd not in tables or sub in tables[cmd])


@functools.cache
def tree_files() -> tuple[Path, ...]:
    """The kit's source and script files (not the virtual environment's)."""
    return tuple(f for top in ("src", "tests", "deploy", "docs", ".ci") for f in (ROOT / top).rglob("*")
                 if f.suffix in (".py", ".sh") and "egg-info" not in f.as_posix()) + tuple(ROOT.glob("*.py"))


def missing(kind: str, name: str) -> bool:
    if kind == "hand-over":
        return True
    if kind == "command":
        return not command_exists(name)
    if kind == "module":
        return not runnable(name)
    if kind == "dotted":
        return not resolves(name if name.startswith("bge_triton.") else "bge_triton." + name)
    if kind == "file":
        return not any(f.as_posix().endswith("/" + name) for f in tree_files())
    candidates = [ROOT / name, SRC / name, SRC / "bge_triton" / name]
    return not any(c.is_file() for c in candidates)


def test_the_checker_finds_a_name_that_is_gone() -> None:
    text = ("run `python -m bge_triton.nope` or python -m bge_triton.export; `server.repository.render_cpu_variant` "
            "moved, `server.cpu_variant.render_cpu_variant` is it; see loadtest/nothere.py and src/bge_triton/cli.py; "
            "`python -m bge_triton.loadtest.bench` is `bge-triton bench seed` now; `kit.errors` is gone; "
            "`bge-triton tune --pair` is `bge-triton tune pair`; `bge-triton bench nope`, `bge-triton stack`; "
            "`gpu/scenarios.py` was folded into `gpu/bench_gpu.py`")
    bad = sorted(n for n in names_in(text) if missing(*n))
    assert bad == [("command", "bench nope"), ("command", "stack"),
                   ("dotted", "kit.errors"), ("dotted", "server.repository.render_cpu_variant"),
                   ("file", "gpu/scenarios.py"),
                   ("hand-over", "tune --pair"),
                   ("module", "bge_triton.loadtest.bench"), ("module", "bge_triton.nope"),
                   ("path", "loadtest/nothere.py")]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_name_in_the_docs_exists(doc: Path) -> None:
    bad = sorted(f"{kind} {name}" for kind, name in names_in(doc.read_text(encoding="utf-8")) if missing(kind, name))
    assert not bad, f"{doc.relative_to(ROOT)} names what is not in the tree:\n  " + "\n  ".join(bad)
