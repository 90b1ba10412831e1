"""One flag idiom for every `bge-triton` command: each flag shows its default and reads an environment variable
(`BGE_TRITON_<FLAG>`, as TEI's clap `env` and Infinity's typer `envvar` do), and the flags that name the same
thing everywhere (`--url`, `--model`, `--admin-key`, `--precision`) are defined once, here.

Usage in a command's parser::

    p = flags.parser("bge-triton verify", "Check a running server's vectors against the export's reference.")
    flags.add_url(p); flags.add_model(p)
    p.add_argument("--rounds", type=int, default=3, help="how many times to repeat")
    args = flags.parse(p, argv)          # environment variables fill in what the command line left out
    target = flags.server_url(args.url)  # ServerUrl(protocol="grpc", address="127.0.0.1:8001")
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata

from bge_triton.errors import InputError

__all__ = [
    "ENV_PREFIX", "DEFAULT_URL", "DEFAULT_MODEL", "PRECISIONS", "ServerUrl", "server_url", "env_name", "parser",
    "add_url", "add_model", "add_admin_key", "add_precision", "parse", "version", "subcommand", "no_env",
]

ENV_PREFIX = "BGE_TRITON_"
DEFAULT_URL = "127.0.0.1:8001"
DEFAULT_MODEL = "bge_large_zh"
PRECISIONS = ("fp32", "fp16", "int8")
_NO_ENV = "_bge_triton_no_env"


def version() -> str:
    """The installed kit's version (`bge-triton --version`)."""
    try:
        return metadata.version("bge-triton-kit")
    except metadata.PackageNotFoundError:  # a source tree on sys.path without an install
        return "0+unknown"


@dataclass(frozen=True)
class ServerUrl:
    """A running Triton: `protocol` is "grpc" or "http", `address` is HOST:PORT (what tritonclient takes)."""

    protocol: str
    address: str

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def __str__(self) -> str:
        return self.address if self.protocol == "grpc" else f"{self.protocol}://{self.address}"


def server_url(url: str, flag: str = "--url") -> ServerUrl:
    """Parse `HOST:PORT` (gRPC, Triton's :8001), `grpc://HOST:PORT` or `http://HOST:PORT` (Triton's :8000)."""
    text = url.strip()
    protocol = "grpc"
    if "://" in text:
        protocol, _, text = text.partition("://")
        protocol = protocol.lower()
        if protocol == "https":
            raise InputError(f"{flag} {url!r}: https is not supported by this command; put TLS in front of Triton "
                             "and give the plain http:// or gRPC address inside it")
        if protocol not in ("grpc", "http"):
            raise InputError(f"{flag} {url!r}: unknown scheme {protocol!r}; use HOST:PORT (gRPC) or http://HOST:PORT")
    text = text.rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not host or "/" in text or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(f"{flag} {url!r}: expected HOST:PORT (gRPC, e.g. 127.0.0.1:8001) or http://HOST:PORT "
                         "(e.g. http://127.0.0.1:8000)")
    return ServerUrl(protocol, f"{host}:{int(port)}")


def env_name(option: str) -> str:
    """`--admin-key` -> `BGE_TRITON_ADMIN_KEY`."""
    return ENV_PREFIX + option.lstrip("-").upper().replace("-", "_")


def _long(action: argparse.Action) -> str:
    """The flag's long name (`--url`), else its first."""
    return next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks; every optional flag's help ends with its default and its variable."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.help == argparse.SUPPRESS:
            return text
        extra = []
        valued = not isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                                         argparse._HelpAction, argparse._VersionAction))
        if valued and "default:" not in text and "(default" not in text and action.default != argparse.SUPPRESS:
            # a flag without a default is off until given: say so rather than show nothing
            extra.append("default: not set" if action.default is None or action.default == [] else
                         f"default: {action.default}")
        no_env = getattr(action, _NO_ENV, None)
        if isinstance(no_env, str):  # a flag kept out of the environment says why
            extra.append(f"not read from the environment: {no_env}")
        elif no_env is None and not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            extra.append(f"env {env_name(_long(action))}")
        return f"{text} ({'; '.join(extra)})" if extra else text


def parser(prog: str, description: str, **kwargs: object) -> argparse.ArgumentParser:
    """An ArgumentParser with the kit's help format and `--version`."""
    p = argparse.ArgumentParser(prog=prog, description=description, formatter_class=_Formatter, **kwargs)  # type: ignore[arg-type]
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    return p


def subcommand(subparsers: argparse._SubParsersAction, name: str, help: str, description: str | None = None,
               parents: Sequence[argparse.ArgumentParser] = ()) -> argparse.ArgumentParser:
    """A sub-command's parser (`bge-triton serve up`) with the kit's help format; `parse` fills its flags too."""
    return subparsers.add_parser(name, help=help, description=description or help, formatter_class=_Formatter,
                                 parents=list(parents))


def no_env(action: argparse.Action, why: str | None = None) -> argparse.Action:
    """Mark a flag that must not be read from the environment (a secret-looking name, a per-run path); `why`, shown
    in its help, tells the user the reason (a variable set for the other commands would change this one)."""
    setattr(action, _NO_ENV, why if why else True)
    return action


def add_url(p: argparse.ArgumentParser, default: str | None = DEFAULT_URL, *aliases: str,
            help: str | None = None) -> argparse.Action:
    """`--url`: the running Triton, HOST:PORT for gRPC (default) or http://HOST:PORT."""
    return p.add_argument("--url", *aliases, default=default, metavar="URL", help=help or (
        "a running Triton: HOST:PORT speaks gRPC (Triton's port 8001), http://HOST:PORT speaks HTTP (port 8000)"))


def add_model(p: argparse.ArgumentParser, default: str | None = DEFAULT_MODEL,
              help: str | None = None, aliases: Sequence[str] = ()) -> argparse.Action:
    """`--model`: the served model's name (the text endpoint), never a hub id (that is export's `--model-id`)."""
    return p.add_argument("--model", *aliases, default=default, metavar="NAME", help=help or (
        "the served model's name on Triton (the text endpoint; its encoder is NAME_onnx)"))


def add_admin_key(p: argparse.ArgumentParser, help: str | None = None) -> argparse.Action:
    """`--admin-key`: the key of Triton's restricted admin API (header triton-admin-key), for load/unload."""
    return p.add_argument("--admin-key", default=None, metavar="KEY", help=help or (
        "the key of Triton's restricted model-repository API (sent as header triton-admin-key); "
        "docker compose keeps it in the triton container at /secrets/admin_key"))


def add_precision(p: argparse.ArgumentParser, default: str = "fp16", choices: Sequence[str] = PRECISIONS,
                  help: str | None = None) -> argparse.Action:
    """`--precision`: fp16 on a GPU, fp32 or int8 on a CPU."""
    return p.add_argument("--precision", default=default, choices=list(choices), help=help or (
        "weights and compute: fp16 for a GPU, fp32 or int8 for a CPU"))


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None = None,
          environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Parse argv; a flag not given on the command line takes BGE_TRITON_<FLAG> from the environment when set.

    An environment value goes through the flag's own type and choices, so a bad one fails like a bad flag
    (with the variable's name). `store_true` flags read 1/true/yes/on and 0/false/no/off.
    """
    env = os.environ if environ is None else environ
    _fill_from_env(p, env)
    return p.parse_args(argv)


def _fill_from_env(p: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """Set each flag's default from its environment variable, in `p` and in its sub-commands' parsers."""
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                _fill_from_env(sub, env)
        if not action.option_strings or getattr(action, _NO_ENV, False) or isinstance(
                action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
            continue
        name = env_name(_long(action))
        if name not in env:
            continue
        raw = env[name]
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            truth = raw.strip().lower()
            if truth not in ("1", "true", "yes", "on", "0", "false", "no", "off", ""):
                p.error(f"environment variable {name}={raw!r}: expected true or false")
            on = truth in ("1", "true", "yes", "on")
            action.default = on if isinstance(action, argparse._StoreTrueAction) else not on
            continue
        convert = action.type if callable(action.type) else str
        many = action.nargs in ("*", "+") or isinstance(action, argparse._AppendAction)
        try:
            value = [convert(v) for v in raw.split(",")] if many else convert(raw)
        except (TypeError, ValueError) as exc:
            p.error(f"environment variable {name}={raw!r}: {exc}")
        for one in value if many else [value]:
            if action.choices is not None and one not in action.choices:
                p.error(f"environment variable {name}={raw!r}: choose from {', '.join(map(str, action.choices))}")
        action.default = value
        action.required = False
