"""Every command, flag, make target, path, compose service and port, and variable a user reads in the README and the
guides exists, and the README's examples are the files the deploy test runs (docs/examples/).

Names are read from where a user copies them: code blocks and backticked spans (`bge-triton CMD [SCENARIO] --flag`,
`docker compose [--profile P] SUB SERVICE`, `make TARGET`, `127.0.0.1:PORT`, upper-case variables), and repository
paths and relative links anywhere. Flags come from the commands' own `--help`; services, profiles, ports and
variables from docker-compose*.yml and deploy/.env.example; a `BGE_TRITON_X` variable from the flag `--x`.
The records (benchmarks, architecture, reliability, scale) quote their reports' commands: test_docs_names.py checks
the modules and source paths they name.
"""
from __future__ import annotations

import contextlib
import functools
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TICKED = re.compile(r"`([^`\n]+)`")
GUIDES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs" / f"{n}.md" for n in (
    "gpu", "configuration", "sdk", "development", "export", "gateway", "loadtest", "tuning", "k8s", "operations",
    "rerank"))]
BARE_FLAGS = {"README.md", "configuration.md"}  # where a `--flag` alone in prose means a bge-triton flag
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
BGE = re.compile(r"(?<![\w/.:-])(?<!-n )(?<!namespace )(?<!namespace=)bge-triton(?![\w-])")
FLAG = re.compile(r"^--[a-z][a-z0-9-]*")
TICKED_CMD = re.compile(r"^([a-z][\w-]*)(?: ([a-z][\w-]*))? (--[a-z][\w-]*)")  # `export --model-id` in a table
# a repository path; not one a command writes (--out DIR), a pattern (test_*.py) or a Kubernetes object (deploy/x)
PATHLIKE = re.compile(r"(?<![\w./$-])(?<!--out )((?:src|deploy|docs|tests|reports|\.ci)/[\w./-]*\w"
                      r"|docker-compose[\w.-]*\.yml|Makefile|CONTRIBUTING\.md|pyproject\.toml|requirements\.lock)"
                      r"(?![\w*{<>/-]|\.\w)")
EXAMPLE = re.compile(r"\]\((docs/examples/[\w.-]+)\)[^\n]*\n```[^\n]*\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
GENERATED = ("reports/demo", "reports/gpu", "reports/tmp", "src/bge_triton/loadtest/gpu/wheels",
             "src/bge_triton/loadtest/gpu/.work")
COMPOSE = re.compile(r"docker[ -]compose((?: +(?:-f +\S+|--profile +\S+|-p +\S+|--env-file +\S+))*) +([a-z]+)"
                     r"((?: +[-\w=.:/]+)*)")
PORT = re.compile(r"(?:127\.0\.0\.1|localhost|0\.0\.0\.0)(?::|\), :|, :)(\d{2,5})\b|(?<=[ (]):(\d{4,5})\b")
VARIABLE = re.compile(r"\bBGE_TRITON_[A-Z0-9_]*[A-Z0-9]\b|(?<![\w.-])[A-Z][A-Z0-9]*_[A-Z0-9_]*[A-Z0-9]\b")
# set by libraries or the shell, not by this kit
EXTERNAL_VARIABLES = {"HF_ENDPOINT", "HF_TOKEN", "HF_HUB_OFFLINE", "HF_HOME", "XDG_CACHE_HOME", "DOCKER_HOST",
                      "CUDA_VISIBLE_DEVICES", "BGE_TRITON_X_Y"}


def shell_lines(text: str) -> list[str]:
    """Code lines (continuations joined) and backticked spans: where a user copies commands from."""
    code = [b.replace("\\\n", " ") for b in FENCE.findall(text)]
    prose = FENCE.sub("", text)
    return [line for block in code for line in block.splitlines()] + TICKED.findall(prose)


def words(line: str) -> list[str]:
    """Shell words up to the first operator or comment."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    out = []
    try:
        for word in lexer:
            if word and set(word) <= set("();<>|&"):
                break
            out.append(word)
    except ValueError:  # an unclosed quote (an apostrophe in prose): what came before it
        pass
    return out


@functools.cache
def help_text(*argv: str) -> str:
    """What `bge-triton ARGV --help` prints (stdout and stderr)."""
    from bge_triton import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            cli.main([*argv, "--help"])
        except SystemExit:
            pass
    return out.getvalue()


@functools.cache
def flags_of(*argv: str) -> frozenset[str]:
    """The flags `bge-triton ARGV` accepts, also with `--url` (a command may take other flags against a running
    server); a command whose help lists scenarios: its default one's too."""
    text = help_text(*argv) + (help_text(*argv, "--url", "127.0.0.1:8001") if argv else "")
    found = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text)) - {"--help"}
    default = re.search(r"^  ([a-z][\w-]*) .*\(default[;)]", text, re.M)
    if default and argv:
        found |= flags_of(*argv, default.group(1))
    return frozenset(found | {"--help", "-h"})


def is_subcommand(command: str, word: str) -> bool:
    """`bge-triton COMMAND WORD --help` prints WORD's own usage (bench seed, serve up), not COMMAND's."""
    from bge_triton import cli

    if command not in cli.COMMANDS or word.startswith("-"):
        return False
    listed = help_text(command)  # a scenario table (`  seed   the seed table`) or choices ({up,down,status})
    if re.search(rf"^  {re.escape(word)}\s|[{{,]{re.escape(word)}[,}}]", listed, re.M):
        return True
    usage = help_text(command, word).partition("\n")[0]
    return re.search(rf" {re.escape(word)}(?: |$)", usage) is not None


def command_flags(text: str) -> set[str]:
    """'flag CMD [SUB] --x' for each flag given to a bge-triton command; 'flag --x' for a global one."""
    from bge_triton import cli

    found = set()
    for line in shell_lines(text):
        for m in BGE.finditer(line):
            ws = words(line[m.end():])
            if not ws or ws[0] in ("<command>", "..."):
                continue
            cmd = [] if ws[0].startswith("-") else [ws[0]]
            if cmd and len(ws) > 1 and is_subcommand(ws[0], ws[1]):
                cmd.append(ws[1])
            found |= {f"flag {' '.join([*cmd, FLAG.match(w).group(0)])}" for w in ws[len(cmd):] if FLAG.match(w)}
        tick = TICKED_CMD.match(line)
        if tick and tick.group(1) in cli.COMMANDS:
            found.add("flag " + " ".join(filter(None, tick.groups())))
        ws = words(line.removeprefix("bash "))
        if ws and re.fullmatch(r"(deploy|\.ci)/[\w/.-]+\.sh", ws[0]):
            found |= {f"flag {ws[0]} {w}" for w in ws[1:] if FLAG.match(w)}
    return found


def flag_missing(name: str) -> bool:
    *cmd, flag = name.split()[1:]
    if cmd and cmd[0].endswith(".sh"):
        script = ROOT / cmd[0]
        return not script.is_file() or flag not in script.read_text(encoding="utf-8")
    if not cmd:  # a bare `--flag` in prose, or `bge-triton --version`: some command has it
        from bge_triton import cli
        return flag not in flags_of() and not any(flag in flags_of(c) for c in cli.COMMANDS)
    return flag not in flags_of(*cmd)


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M))


@functools.cache
def compose() -> tuple[dict[str, dict], set[str], set[str], set[str]]:
    """Services, profiles, published ports (host defaults and container ports) and variables of docker-compose*.yml."""
    import yaml

    services: dict[str, dict] = {}
    variables: set[str] = set()
    for path in sorted(ROOT.glob("docker-compose*.yml")):
        text = path.read_text(encoding="utf-8")
        variables |= set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", text))
        for name, spec in (yaml.safe_load(text).get("services") or {}).items():
            services.setdefault(name, {}).update(spec or {})
            variables |= set((spec or {}).get("environment") or {})
    profiles = {p for spec in services.values() for p in spec.get("profiles", [])}
    ports = set()
    for spec in services.values():
        for port in spec.get("ports", []):
            ports |= set(re.findall(r":-?(\d+)\}?", str(port))) | {str(port).rsplit(":", 1)[-1]}
    example = (ROOT / "deploy" / ".env.example").read_text(encoding="utf-8")
    variables |= set(re.findall(r"^([A-Z][A-Z0-9_]*)=", example, re.M))
    return services, profiles, ports, variables


def compose_names(text: str) -> set[str]:
    """'service S', 'profile P', 'path F' of each `docker compose ...` line."""
    found = set()
    for line in shell_lines(text):
        for m in COMPOSE.finditer(line):
            opts, sub, rest = m.group(1).split(), m.group(2), words(m.group(3))
            found |= {f"profile {opts[i + 1]}" for i, o in enumerate(opts) if o == "--profile"}
            found |= {f"path {opts[i + 1]}" for i, o in enumerate(opts) if o == "-f"}
            args = [w for i, w in enumerate(rest) if not w.startswith("-") and (i == 0 or rest[i - 1] not in (
                "--tail", "-n", "--since", "--until", "-t", "--timeout", "-e", "--env", "-u", "--user", "-w",
                "--workdir", "--index"))]
            found |= {f"service {w.split('=')[0]}" for w in rest if "=" in w and not w.startswith("-")}
            if sub == "cp":
                found |= {f"service {w.split(':')[0]}" for w in args if ":" in w}
            elif sub in ("exec", "run") and args:
                found.add(f"service {args[0]}")
            elif sub in ("logs", "restart", "stop", "start", "up", "ps", "build", "pull", "rm", "kill"):
                found |= {f"service {w}" for w in args if "=" not in w}
    return found


def tree_path_missing(rel: str) -> bool:
    return not (ROOT / rel).exists() and not rel.startswith(GENERATED)


def path_names(doc: Path, text: str) -> set[str]:
    """'path P' for each repository path the text names (relative to the root) or links (relative to the doc)."""
    found = {f"path {p}" for p in PATHLIKE.findall(text) if not re.fullmatch(r"deploy/[\w-]+", p)}
    for link in LINK.findall(text):
        if not re.match(r"[a-z]+:", link):
            found.add(f"path {(doc.parent / link).resolve().relative_to(ROOT).as_posix()}")
    return found


def variable_names(text: str) -> set[str]:
    """'variable V' for BGE_TRITON_* anywhere and for upper-case names with an underscore in backticks or code."""
    spans = [*FENCE.findall(text), *TICKED.findall(FENCE.sub("", text))]
    return {f"variable {v}" for span in spans for v in VARIABLE.findall(span)} | {
        f"variable {v}" for v in re.findall(r"\bBGE_TRITON_[A-Z0-9_]*[A-Z0-9]\b", text)}


def port_names(text: str) -> set[str]:
    return {f"port {a or b}" for a, b in PORT.findall(text)}


def example_problems(text: str) -> set[str]:
    """The README shows each file of docs/examples once, verbatim, right under a link to it."""
    shown: dict[str, list[str]] = {}
    for path, body in EXAMPLE.findall(text):
        shown.setdefault(path, []).append(body)
    bad = set()
    for path, bodies in shown.items():
        if not (ROOT / path).is_file():
            bad.add(f"example {path}")
        elif bodies != [(ROOT / path).read_text(encoding="utf-8")]:
            bad.add(f"example {path} is not shown once, verbatim")
    bad |= {f"example {f.relative_to(ROOT).as_posix()} is not shown" for f in (ROOT / "docs" / "examples").glob("*")
            if f.is_file() and f.relative_to(ROOT).as_posix() not in shown}
    return bad


def problems(doc: Path, text: str | None = None) -> set[str]:
    """What `doc` (or `text`, read as if it were there) names that does not exist, as 'kind name'."""
    from bge_triton import cli

    text = doc.read_text(encoding="utf-8") if text is None else text
    services, profiles, ports, variables = compose()
    bge_flags = {env_name(f) for c in cli.COMMANDS for f in flags_of(c)} | {env_name(f) for f in flags_of()}
    bad = {n for n in command_flags(text) if flag_missing(n)}
    if doc.name in BARE_FLAGS:
        bad |= {f"flag {t.split()[0]}" for t in TICKED.findall(FENCE.sub("", text)) if t != "--x-y"
                and re.fullmatch(r"--[a-z][\w-]*(?: [A-Z]+)?", t) and flag_missing(f"flag {t.split()[0]}")}
    bad |= {f"path {w}" for line in shell_lines(text) for w in re.findall(
        r"(?<![\w-])(?:bash|sh|python3?) ((?![/~$])[\w.-]+/[\w./-]+\.(?:sh|py))\b", line) if tree_path_missing(w)}
    bad |= {f"make {t}" for line in shell_lines(text) for t in re.findall(r"(?<![\w-])make ([a-z][\w-]*)", line)
            if t not in make_targets()}
    for name in compose_names(text) | path_names(doc, text):
        kind, value = name.split(" ", 1)
        if (kind == "service" and value not in services) or (kind == "profile" and value not in profiles) \
                or (kind == "path" and tree_path_missing(value)):
            bad.add(name)
    bad |= {n for n in port_names(text) if n.split()[1] not in ports}
    known = variables | bge_flags | EXTERNAL_VARIABLES | script_variables()
    bad |= {n for n in variable_names(text) if n.split()[1] not in known}
    if doc.name == "README.md":
        bad |= example_problems(text)
    bad |= {f"{what} in {doc.name}: {found}" for what, found in lab_marks(text).items()
            if what in ("a file outside the repository", "a note to the team")}
    return bad


@functools.cache
def script_variables() -> set[str]:
    """Upper-case names the deployment files, the scripts, the Makefile and the sources use (environment variables,
    constants the docs quote)."""
    files = [*(ROOT / "deploy").rglob("*"), *(ROOT / ".ci").glob("*"), *(ROOT / "src").rglob("*.sh"),
             *(ROOT / "docs" / "examples").glob("*"),
             *(ROOT / "src").rglob("*.py"),
             *(ROOT / "tests" / "deploy").glob("*"), ROOT / "Makefile"]
    return {v for f in files if f.is_file() and f.suffix not in (".png", ".json")
            for v in re.findall(r"\b[A-Z][A-Z0-9]*_[A-Z0-9_]+\b", f.read_text(encoding="utf-8", errors="replace"))
            if not v.startswith("BGE_TRITON_")}  # those: from the flags alone


def env_name(flag: str) -> str:
    return "BGE_TRITON_" + flag.lstrip("-").upper().replace("-", "_")


@pytest.mark.parametrize("doc", [d for d in GUIDES if d.is_file()], ids=lambda p: p.name)
def test_every_command_flag_path_service_port_and_variable_a_guide_names_exists(doc: Path) -> None:
    bad = sorted(problems(doc))
    assert not bad, f"{doc.relative_to(ROOT)} names what does not exist:\n  " + "\n  ".join(bad)



def test_the_checker_finds_what_a_user_would_type_and_is_gone() -> None:
    doc = ROOT / "docs" / "configuration.md"
    text = ("```bash\nbge-triton verify --url 127.0.0.1:8001 --nope 1 | tee x  # --not-this\n"
            "bge-triton bench seed --quick --nada\ndocker compose --profile nothere up -d ghost\n"
            "docker compose exec -T triton cat /secrets/admin_key\nmake demo && make nosuch\n"
            "docker compose logs --tail 100 triton\ndocker compose cp nobody:/x ./y\n"
            "export BGE_TRITON_URL=x NOT_A_SETTING=1\ncurl 127.0.0.1:8000/v2 127.0.0.1:9999/x\n"
            "bash deploy/build-images.sh --nowhere\nbash loadtest/gpu/run.sh && python3 deploy/check_configs.py x\n"
            "kubectl -n bge-triton rollout status deploy/triton --timeout=30m\n```\n"
            "See `deploy/nothere.yml`, [gpu](gpu.md), [gone](gone.md), `--url`, `--nowhere`, `EXPORT_MODEL`, "
            "`bench --bogus`, `tests/unit/test_compose_*.py`, docs/gpu.md. And `bge-triton verify`'s `--json`.\n")
    assert problems(doc, text) == {
        "flag verify --nope", "flag bench seed --nada", "profile nothere", "service ghost", "make nosuch",
        "variable NOT_A_SETTING", "port 9999", "service nobody", "path deploy/nothere.yml", "path docs/gone.md",
        "flag --nowhere", "flag bench --bogus", "flag deploy/build-images.sh --nowhere", "path loadtest/gpu/run.sh"}


def test_the_readme_check_wants_each_example_verbatim(tmp_path: Path) -> None:
    examples = sorted(f.relative_to(ROOT).as_posix() for f in (ROOT / "docs" / "examples").glob("*") if f.is_file())
    shown = "".join(f"[{e}]({e}):\n```\n{(ROOT / e).read_text(encoding='utf-8')}```\n" for e in examples)
    assert example_problems(shown) == set()
    assert example_problems("[x](docs/examples/gone.py):\n```python\nprint(1)\n```\n") >= {
        "example docs/examples/gone.py"}
    if examples:
        first = (ROOT / examples[0]).read_text(encoding="utf-8")
        changed = shown.replace(first, first + "# changed\n", 1)
        assert f"example {examples[0]} is not shown once, verbatim" in example_problems(changed)
        assert f"example {examples[-1]} is not shown" in example_problems("")


def test_the_configuration_guide_lists_every_compose_variable() -> None:
    example = (ROOT / "deploy" / ".env.example").read_text(encoding="utf-8")
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert sorted(set(re.findall(r"^([A-Z][A-Z0-9_]*)=", example, re.M)) - set(TICKED.findall(text))) == []


def test_the_gateway_guide_shows_the_command_compose_runs() -> None:
    import yaml

    text = (ROOT / "docs" / "gateway.md").read_text(encoding="utf-8")
    shown = yaml.safe_load(FENCE.search(text[text.index("## Compose\n"):]).group(1))
    assert shown == {"command": compose()[0]["gateway"]["command"]}


LAB_MARKS = {
    "a commit hash": r"(?<![\w/-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-])",
    "an issue number": r"(?i)\bissue \d+|(?<![\w/])#\d+\b",
    "a load average": r"(?i)load average",
    "a verdict": r"\b(?:PASS|FAIL)\b",
    "the development machine": r"(?i)development (?:VM|machine)",
    "a file outside the repository": r"\.\./shared|/work/|CONTAINERS\.md|\bDESIGN\b",
    "a note to the team": r"(?i)for the lead|\bTODO\b",
}


def lab_marks(text: str) -> dict[str, str]:
    """What in `text` belongs to a lab record rather than a user's page: kind -> the first such text."""
    return {what: m.group(0) for what, rx in LAB_MARKS.items() if (m := re.search(rx, text))}


def test_the_readme_is_a_users_page() -> None:
    """At most 150 lines, and none of a lab record's marks: commit hashes, issue numbers, load averages, verdicts."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    assert lab_marks(text) == {}
    assert set(lab_marks("at 4bcb0eb (issue 26), load average 0.4: FAIL on the development VM, " + "../" + "shared/x; "
                         "What the README should say (for the lead)")) == set(LAB_MARKS)
    assert lab_marks("BAAI/bge-large-zh-v1.5 in fp16, sha256 of model.onnx, 127.0.0.1:8001, 1024 deadbeef") == {}
