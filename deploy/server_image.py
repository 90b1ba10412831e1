"""What the server image (deploy/Dockerfile.server) is built from: its base image and its pip packages.

Read by the contract test (every python model's imports are covered by the image) and by the
minimal-environment test (the python stubs get exactly these packages and numpy).
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

DOCKERFILE = Path(__file__).resolve().parent / "Dockerfile.server"
# an import name differs from its distribution name for some packages (none today: tokenizers = tokenizers)
IMPORT_NAMES: dict[str, str] = {}
SEPARATORS = {"&&", "||", ";", "|", "&"}


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, with comments dropped and continuation lines joined."""
    joined, current = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.strip():
            joined.append(current.strip())
        current = ""
    return [(word.upper(), rest.strip()) for word, _, rest in (line.partition(" ") for line in joined)]


def pip_requirements(text: str) -> list[str]:
    """The requirement specs of every `pip install` in the Dockerfile's RUN lines (options dropped)."""
    specs: list[str] = []
    for word, args in instructions(text):
        if word != "RUN":
            continue
        lexer = shlex.shlex(args, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command: list[str] = []
        for token in [*lexer, ";"]:
            if token not in SEPARATORS:
                command.append(token)
                continue
            if "install" in command and any(t == "pip" or t.endswith("/pip") or t == "pip3" for t in command):
                specs += [t for t in command[command.index("install") + 1:] if not t.startswith("-")]
            command = []
    return specs


def base_images(text: str) -> list[str]:
    """The image of each FROM line, as written (ARG references unexpanded)."""
    return [args.split()[0] for word, args in instructions(text) if word == "FROM"]


def import_name(spec: str) -> str:
    """The top-level module a requirement spec installs, e.g. 'tokenizers==0.22.2' -> 'tokenizers'."""
    dist = re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0]
    return IMPORT_NAMES.get(dist.lower(), dist.lower().replace("-", "_"))


def image_packages(dockerfile: Path = DOCKERFILE) -> list[str]:
    """The pip requirement specs the server image installs (e.g. ['tokenizers==0.22.2'])."""
    return pip_requirements(dockerfile.read_text(encoding="utf-8"))
