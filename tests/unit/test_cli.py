"""`bge-triton`: one program. Every command reaches its own parser, every usage line says `bge-triton ...`, and every
flag of every parser reachable from it (sub-commands, bench scenarios and tune included) has help that shows its
default and its BGE_TRITON_ environment variable."""
from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator

import pytest

from bge_triton import cli, flags
from bge_triton.loadtest.commands import BENCH, TUNE

# how each command's main is reached: `bge-triton` argv -> its parser
INVOCATIONS = {
    **{name: [name] for name in cli.COMMANDS if name not in ("bench", "tune")},
    **{f"bench {s}": ["bench", s] for s in BENCH},
    **{f"tune {s}": ["tune", s] for s in TUNE},
}


class _Captured(BaseException):
    """Raised instead of parsing: carries the parser (a BaseException, so no command's `except` swallows it)."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def captured_parser(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The parser `bge-triton ARGV` builds, taken at its first parse (nothing of the command runs)."""
    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Captured(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    with pytest.raises(_Captured) as got:
        cli.main(argv)
    return got.value.parser


def walk(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """The parser and its sub-commands' parsers."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from walk(sub)


def flag_problems(parser: argparse.ArgumentParser) -> list[str]:
    """What the flag idiom misses in one parser: its prog, a flag's help, default or environment variable."""
    problems = [] if parser.prog.split()[0] == "bge-triton" else [f"usage says {parser.prog!r}"]
    formatter = parser.formatter_class(parser.prog)
    for action in parser._actions:
        if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        name = action.option_strings[-1]
        if not (action.help or "").strip():
            problems.append(f"{name}: no help")
            continue
        shown = " ".join(formatter._get_help_string(action).split())
        switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        if not switch and "default" not in shown:
            problems.append(f"{name}: no default shown")
        kept_out = "not read from the environment: " in shown  # flags.no_env with its reason
        if not kept_out and flags.env_name(next(o for o in action.option_strings if o.startswith("--"))) not in shown:
            problems.append(f"{name}: no environment variable shown")
    return problems


@pytest.mark.parametrize("command", list(INVOCATIONS))
def test_every_flag_has_help_default_and_variable(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    parser = captured_parser(INVOCATIONS[command], monkeypatch)
    problems = [f"{p.prog}: {what}" for p in walk(parser) for what in flag_problems(p)]
    assert not problems, "\n".join(problems)


def test_the_walk_sees_sub_commands_and_finds_a_bad_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: the sub-commands are walked, and a flag without help or variable is named."""
    progs = [p.prog for p in walk(captured_parser(["serve"], monkeypatch))]
    assert progs == ["bge-triton serve", "bge-triton serve up", "bge-triton serve down", "bge-triton serve status"]
    bad = flags.parser("bge-triton x", "a command")
    bad.add_argument("--silent", type=int, default=3)
    flags.no_env(bad.add_argument("--hidden", default="a", help="no variable"))
    flags.no_env(bad.add_argument("--kept", default="b", help="a variable would mislead"), "it names another thing")
    assert flag_problems(bad) == ["--silent: no help", "--hidden: no environment variable shown"]
    plain = argparse.ArgumentParser(prog="python -m x")
    plain.add_argument("--n", type=int, default=1, help="a number")
    assert flag_problems(plain) == ["usage says 'python -m x'", "--n: no default shown",
                                    "--n: no environment variable shown"]


def test_version(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"bge-triton {flags.version()}"
    proc = subprocess.run([sys.executable, "-m", "bge_triton.cli", "export", "--version"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == f"bge-triton export {flags.version()}", proc.stderr


def test_top_level_help_names_the_real_commands_and_scenarios(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    bench_line = next(line for line in out.splitlines() if line.strip().startswith("bench "))
    assert all(s in bench_line for s in BENCH) and "client" not in bench_line
    assert "python -m" not in out and all(f"  {name} " in out for name in cli.COMMANDS)


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_command_prints_its_own_help(name: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "bge_triton.cli", name, "--help"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"usage: bge-triton {name}"), proc.stdout[:300]


def test_unknown_command_lists_the_commands(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'nope'" in err and all(name in err for name in cli.COMMANDS)


def test_no_command_prints_usage_and_fails(capsys: pytest.CaptureFixture) -> None:
    assert cli.main([]) == 2 and "usage: bge-triton" in capsys.readouterr().out
    assert cli.main(["--help"]) == 0


def test_verify_url_speaks_grpc_by_default_and_http_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from bge_triton.verify import __main__ as verify_cli
    from bge_triton.verify.standalone import VerifyError

    seen = []

    class Transport:
        def __init__(self, address: str, protocol: str | None, timeout_s: float) -> None:
            seen.append((address, protocol))
            raise VerifyError("stop here")

    monkeypatch.setattr(verify_cli, "TritonTransport", Transport)
    assert verify_cli.main([]) == verify_cli.CANNOT_CHECK
    assert verify_cli.main(["--url", "http://10.0.0.1:8000"]) == verify_cli.CANNOT_CHECK
    monkeypatch.setenv("BGE_TRITON_URL", "triton:9001")
    assert verify_cli.main([]) == verify_cli.CANNOT_CHECK
    assert seen == [("127.0.0.1:8001", "grpc"), ("10.0.0.1:8000", "http"), ("triton:9001", "grpc")]
    assert verify_cli.main(["--url", "ftp://h:1"]) == verify_cli.CANNOT_CHECK and len(seen) == 3


def test_gateway_url_triton_alias_and_grpc_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from bge_triton.errors import InputError
    from bge_triton.gateway.settings import build_parser, settings_from_args

    def target(*argv: str) -> str:
        return settings_from_args(flags.parse(build_parser(), list(argv), environ={})).triton

    assert target() == "127.0.0.1:8001"
    assert target("--triton", "triton:8001") == target("--url", "grpc://triton:8001") == "triton:8001"
    assert target("--url", "dns:///triton-headless:8001") == "dns:///triton-headless:8001"
    with pytest.raises(InputError, match="the gateway talks to Triton over gRPC"):
        target("--url", "http://triton:8000")
    args = flags.parse(build_parser(), [], environ={"BGE_TRITON_URL": "t:1", "BGE_TRITON_API_KEY": "k" * 16 + ",x" * 9})
    assert args.url == "t:1" and args.api_key == ["k" * 16, *["x"] * 9]


def test_sdk_cli_url_and_environment() -> None:
    from bge_triton.client.cli import build_parser, settings_from_args

    args = flags.parse(build_parser(), ["embed", "--url", "http://h:8000", "hi"], environ={"BGE_TRITON_MODEL": "m"})
    s = settings_from_args(args)
    assert (s.url, s.protocol, s.model, args.texts) == ("h:8000", "http", "m", ["hi"])
    s = settings_from_args(flags.parse(build_parser(), ["health"], environ={"BGE_TRITON_TIMEOUT": "2.5"}))
    assert (s.url, s.protocol, s.timeout_s) == ("127.0.0.1:8001", "grpc", 2.5)


def test_serve_sub_commands_read_the_environment(tmp_path) -> None:
    from bge_triton.server.__main__ import _parser

    env = {"BGE_TRITON_STATE_DIR": str(tmp_path), "BGE_TRITON_HTTP_PORT": "9000", "BGE_TRITON_NO_CPU_LOCK": "1"}
    up = flags.parse(_parser(), ["up"], environ=env)
    assert (up.state_dir, up.http_port, up.cpu_lock) == (tmp_path, 9000, False)
    assert flags.parse(_parser(), ["status"], environ=env).state_dir == tmp_path


def test_chaos_and_soak_keep_url_and_model_out_of_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """BGE_TRITON_URL / _MODEL name the other commands' server and model: chaos and soak say so and ignore them,
    while their other flags read the environment."""
    env = {"BGE_TRITON_URL": "triton:8001", "BGE_TRITON_MODEL": "bge_large_zh", "BGE_TRITON_OUT": "elsewhere"}
    for argv in (["chaos"], ["bench", "soak"]):
        parser = captured_parser(argv, monkeypatch)
        monkeypatch.undo()  # parse for real
        args = flags.parse(parser, ["--duration", "1m"] if "soak" in argv else [], environ=env)
        assert (args.url, str(args.out)) == (None, "elsewhere"), argv
        url_help = parser.formatter_class(parser.prog)._get_help_string(
            next(a for a in parser._actions if "--url" in a.option_strings))
        assert "not read from the environment: BGE_TRITON_URL names" in url_help
        assert "env BGE_TRITON_URL" not in url_help
        if argv == ["chaos"]:
            assert args.model == "minilm"


def test_converted_bench_flags_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from bge_triton.loadtest import shipped, stack_bench

    monkeypatch.setenv("BGE_TRITON_ROUNDS", "3")
    monkeypatch.setenv("BGE_TRITON_SWEEP_BATCHES", "2,8")
    s = stack_bench.parse_args(["--quick"])
    assert (s.rounds, s.sweep_batches, s.window_s) == (3, (2, 8), stack_bench.QUICK["window_s"])
    assert stack_bench.parse_args(["--rounds", "7"]).rounds == 7  # the command line wins
    monkeypatch.setenv("BGE_TRITON_DURATION", "5")
    monkeypatch.setenv("BGE_TRITON_DELAYS_US", "0,100")
    s, cands, _, _ = shipped.parse_args([], pair=True)
    assert s.duration_s == 5.0 and {c.name.split(",")[0] for c in cands} >= {"delay=0", "delay=100"}


def test_rerank_takes_url_and_the_own_server_scenarios_refuse_it(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture) -> None:
    from bge_triton.loadtest import commands, rerank_bench, tune_pair_url

    seen: list[list[str]] = []
    monkeypatch.setattr(rerank_bench, "main", lambda argv: seen.append(list(argv)) or 0)
    monkeypatch.setattr(tune_pair_url, "main", lambda argv: seen.append(["pair", *argv]) or 0)
    assert commands.bench_main(["rerank", "--url", "127.0.0.1:8001"]) == 0 and seen == [["--url", "127.0.0.1:8001"]]
    assert cli.main(["tune", "pair", "--url", "h:1"]) == 0 and seen[-1] == ["pair", "--url", "h:1"]
    for argv in (["bench", "soak", "--url", "h:1"], ["bench", "shipped", "--url=h:1"]):
        assert cli.main(argv) == 2
        assert "cannot run against --url" in capsys.readouterr().err
    assert commands.chaos_main(["--url", "h:1"]) == 2


def test_serve_up_admin_key_reaches_tritonservers_restricted_api(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve up --admin-key KEY` (or BGE_TRITON_ADMIN_KEY) puts the model-repository API behind KEY; without it the
    API stays open on 127.0.0.1."""
    from bge_triton.errors import KitError
    from bge_triton.server import __main__ as serve
    from bge_triton.server.launcher import ADMIN_HEADER, build_command

    started: list = []

    class Server:
        def __init__(self, settings) -> None:
            started.append(settings)

        def start(self) -> None:
            raise KitError("not started in a unit test")

    monkeypatch.setattr(serve, "LocalServer", Server)
    monkeypatch.delenv("BGE_TRITON_ADMIN_KEY", raising=False)
    base = ["up", "--state-dir", str(tmp_path)]
    assert serve.main([*base, "--admin-key", "s3cret-key"]) == 2
    monkeypatch.setenv("BGE_TRITON_ADMIN_KEY", "from-env")
    assert serve.main(base) == 2
    monkeypatch.setenv("BGE_TRITON_ADMIN_KEY", "")
    assert serve.main(base) == 2
    assert [s.admin_key for s in started] == ["s3cret-key", "from-env", None]
    cmd = build_command(started[0], tmp_path / "backends", tmp_path / "repo")
    assert f"--http-restricted-api=model-repository:{ADMIN_HEADER}=s3cret-key" in cmd
    assert f"--grpc-restricted-protocol=model-repository:{ADMIN_HEADER}=s3cret-key" in cmd
    assert not any("restricted" in a for a in build_command(started[2], tmp_path / "backends", tmp_path / "repo"))
