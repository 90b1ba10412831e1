"""Gateway keys and rate limits (401 / 429 with Retry-After), the settings' bind rule, the CLI entry."""
from __future__ import annotations

from pathlib import Path

import pytest
import starlette  # noqa: F401 - the extra this test needs
from test_gateway_app import KEY, assert_error, make, post

from bge_triton.cli import COMMANDS
from bge_triton.errors import InputError
from bge_triton.gateway import GatewaySettings, build_parser, settings_from_args
from bge_triton.gateway.auth import KeyGuard, TokenBucket
from bge_triton.gateway.errors import GatewayError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_burst_then_rate() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=2.0, burst=3, clock=clock)
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take() == pytest.approx(0.5)
    clock.now += 0.5
    assert bucket.take() == 0.0 and bucket.take() == pytest.approx(0.5)
    clock.now += 100.0  # refills to the burst, not beyond
    assert [bucket.take() for _ in range(4)][-1] > 0


def test_key_guard_401_and_429_per_key() -> None:
    clock = Clock()
    other = "o" * 32
    guard = KeyGuard(frozenset({KEY, other}), rate=1.0, burst=1, clock=clock)
    for header in (None, "Basic " + KEY, "Bearer wrong-key", KEY):
        with pytest.raises(GatewayError) as info:
            guard.check(header)
        assert info.value.status == 401 and info.value.headers["www-authenticate"].startswith("Bearer")
    assert guard.check(f"Bearer {KEY}") == KEY
    with pytest.raises(GatewayError) as info:
        guard.check(f"Bearer {KEY}")
    assert info.value.status == 429 and info.value.headers["retry-after"] == "1"
    assert guard.check(f"bearer {other}") == other  # each key has its own bucket
    clock.now += 1.0
    assert guard.check(f"Bearer {KEY}") == KEY


def test_app_keys_and_rate_limit() -> None:
    client, backend = make(api_keys=frozenset({KEY}), rate_limit=0.01, rate_burst=2)
    with client:
        assert_error(post(client, {"model": "minilm", "input": "x"}), 401, "invalid_api_key")
        assert_error(client.get("/v1/models", headers={"authorization": "Bearer nope"}), 401, "invalid_api_key")
        auth = {"authorization": f"Bearer {KEY}"}
        assert post(client, {"model": "minilm", "input": "x"}, headers=auth).status_code == 200
        assert client.get("/v1/models", headers=auth).status_code == 200
        r = client.get("/v1/models", headers=auth)
        err = assert_error(r, 429, "rate_limit_exceeded")
        assert err["type"] == "rate_limit_error" and int(r.headers["retry-after"]) >= 1
        assert client.get("/health").status_code == 200 and client.get("/ready").status_code == 200  # no key
    assert len(backend.calls) == 1


def test_no_key_means_loopback_only(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="without an API key"):
        GatewaySettings(host="0.0.0.0")
    assert GatewaySettings(host="0.0.0.0", unsafe_no_auth=True).host == "0.0.0.0"
    assert GatewaySettings(host="0.0.0.0", api_keys=frozenset({KEY})).host == "0.0.0.0"
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert GatewaySettings(host=host).host == host


def test_settings_from_flags_and_keys_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"# team A\n{KEY}\n\n{'z' * 20}  # team B\n", encoding="utf-8")
    args = build_parser().parse_args(["--triton", "10.0.0.5:8001", "--model", "minilm", "--host", "0.0.0.0",
                                      "--api-keys-file", str(keys), "--served-model-name", "bge",
                                      "--model-repository", "/repo", "--rate-limit", "5"])
    s = settings_from_args(args)
    assert s.api_keys == {KEY, "z" * 20} and s.names == ("minilm", "bge") and s.rate_limit == 5.0
    assert s.tokenizer_dir == "/repo/minilm/1/tokenizer" and s.triton == "10.0.0.5:8001"
    keys.write_text("short\n", encoding="utf-8")
    with pytest.raises(InputError, match="shorter than 16"):
        settings_from_args(build_parser().parse_args(["--api-keys-file", str(keys)]))
    assert GatewaySettings().tokenizer_dir is None  # optional since issue 25: the text endpoint counts and cuts
    with pytest.raises(InputError, match="--max-input-chars"):
        GatewaySettings(max_input_chars=-1)
    with pytest.raises(InputError, match="flap"):
        GatewaySettings(canary_interval_s=5.0, ready_max_age_s=1.0)
    # idle connections outlive the proxies' idle timeouts in front (ALB 60 s, nginx 75 s), unless told otherwise
    assert GatewaySettings().keep_alive_s > 75 and settings_from_args(build_parser().parse_args(
        ["--keep-alive", "30"])).keep_alive_s == 30.0
    with pytest.raises(InputError, match="--keep-alive > 0"):
        GatewaySettings(keep_alive_s=0)


def test_cli_lists_gateway() -> None:
    assert COMMANDS["gateway"][0] == "bge_triton.gateway.__main__"


def test_micro_batch_flags() -> None:
    s = settings_from_args(build_parser().parse_args(["--no-micro-batch", "--micro-batch-wait-ms", "5"]))
    assert s.micro_batch is False and s.micro_batch_wait_s == pytest.approx(0.005)
    assert settings_from_args(build_parser().parse_args([])).micro_batch is True
    with pytest.raises(InputError, match="micro-batch-wait-ms"):
        GatewaySettings(micro_batch_wait_s=-1.0)
