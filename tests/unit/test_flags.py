"""The one flag idiom: --url parsing, environment variables through the flag's own type, help with defaults."""
from __future__ import annotations

import pytest

from bge_triton import flags
from bge_triton.errors import InputError


@pytest.mark.parametrize(("text", "protocol", "address"), [
    ("127.0.0.1:8001", "grpc", "127.0.0.1:8001"),
    ("grpc://triton:8001", "grpc", "triton:8001"),
    ("http://127.0.0.1:8000/", "http", "127.0.0.1:8000"),
    ("HTTP://[::1]:8000", "http", "[::1]:8000"),
])
def test_server_url(text: str, protocol: str, address: str) -> None:
    url = flags.server_url(text)
    assert (url.protocol, url.address) == (protocol, address)


@pytest.mark.parametrize("text", ["127.0.0.1", "http://h:0", "ftp://h:1", "https://h:443", "h:80/v2", ":8001"])
def test_server_url_refuses(text: str) -> None:
    with pytest.raises(InputError, match="--url"):
        flags.server_url(text)


def _parser():
    p = flags.parser("bge-triton x", "a test command")
    flags.add_url(p)
    flags.add_model(p)
    p.add_argument("--rounds", type=int, default=3, help="how many rounds")
    p.add_argument("--quiet", action="store_true", help="say less")
    p.add_argument("--kind", choices=["a", "b"], default="a", help="which kind")
    return p


def test_environment_fills_what_the_command_line_left_out() -> None:
    env = {"BGE_TRITON_URL": "http://10.0.0.1:8000", "BGE_TRITON_ROUNDS": "7", "BGE_TRITON_QUIET": "yes"}
    a = flags.parse(_parser(), ["--rounds", "2"], environ=env)
    assert (a.url, a.rounds, a.quiet, a.model) == ("http://10.0.0.1:8000", 2, True, "bge_large_zh")


@pytest.mark.parametrize(("env", "word"), [({"BGE_TRITON_ROUNDS": "many"}, "BGE_TRITON_ROUNDS"),
                                           ({"BGE_TRITON_KIND": "c"}, "BGE_TRITON_KIND"),
                                           ({"BGE_TRITON_QUIET": "maybe"}, "BGE_TRITON_QUIET")])
def test_bad_environment_value_fails_naming_the_variable(env, word, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        flags.parse(_parser(), [], environ=env)
    assert exc.value.code == 2 and word in capsys.readouterr().err


def test_help_shows_default_and_variable(capsys) -> None:
    with pytest.raises(SystemExit):
        flags.parse(_parser(), ["--help"], environ={})
    out = " ".join(capsys.readouterr().out.split())
    assert "default: 3; env BGE_TRITON_ROUNDS" in out
    assert "default: 127.0.0.1:8001; env BGE_TRITON_URL" in out
    assert "env BGE_TRITON_QUIET" in out and "default: False" not in out
