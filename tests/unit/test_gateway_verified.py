"""--reference behind /ready with a fake check (no Triton): 503 carrying the verdict's message until the check
holds, 200 after; checked again after Triton was unreachable; the verdict logged as `bge-triton verify` prints
it; a gauge in /metrics. The real check against a real server: tests/integration/test_gateway_verify.py."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import starlette  # noqa: F401 - the extra this test needs
from starlette.testclient import TestClient
from test_gateway_app import FakeBackend

from bge_triton.errors import InputError
from bge_triton.gateway import GatewaySettings, build_parser, create_app, settings_from_args
from bge_triton.verify import Result

REFERENCE = "/secret/place/minilm_onnx/1/reference.json"
PASSED = Result("minilm", "minilm_onnx", "fp32", "min cosine >= 0.999", ok=True,
                message="verify OK: model minilm (encoder minilm_onnx, fp32, min cosine >= 0.999): 13 probes")
FAILED = Result("minilm", "minilm_onnx", "fp32", "min cosine >= 0.999", ok=False, fault="encoder",
                message="verify FAILED: model minilm (encoder minilm_onnx, fp32, min cosine >= 0.999): through the "
                "encoder with the exporter's tokens, worst probe 'zh_long' cosine 0.912345 (mean 0.95): the "
                f"encoder's numbers are not the reference's. ... differ from the export that wrote {REFERENCE} (x)")
UNREACHABLE = Result("minilm", "?", "?", "?", ok=False, fault="unavailable",
                     message="verify could not run: cannot reach Triton at grpc://10.1.2.3:8001 (refused)")


class FakeCheck:
    """Stands in for bge_triton.verify.check: answers `result`, records its arguments; `hold` blocks it."""

    def __init__(self, result: Result) -> None:
        self.result = result
        self.calls: list[tuple[Any, ...]] = []
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()
        self.daemon: list[bool] = []
        self.raises: Exception | None = None

    def __call__(self, url: str, model: str, reference: str, timeout_s: float) -> Result:
        self.calls.append((url, model, reference, timeout_s))
        self.daemon.append(threading.current_thread().daemon)
        self.entered.set()
        assert self.hold.wait(60), "the test never released the check"
        if self.raises is not None:
            raise self.raises
        return self.result


def until(what: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Wait for progress made by the app's thread (bounded generously; no timing is asserted)."""
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "the gateway's verify loop made no progress"
        time.sleep(0.005)


def make(check: FakeCheck, backend: FakeBackend | None = None, **kw: Any) -> tuple[TestClient, FakeBackend, Any]:
    settings = GatewaySettings(model="minilm", triton="10.1.2.3:8001", reference=REFERENCE, canary_interval_s=0.01,
                               verify_retry_s=0.01, timeout_s=7.0, **kw)
    backend = backend or FakeBackend()
    app = create_app(settings, backend, verify=check)
    return TestClient(app), backend, app.state.gateway


def test_a_failed_verdict_keeps_ready_503_with_its_message_until_it_holds(caplog: pytest.LogCaptureFixture) -> None:
    check = FakeCheck(FAILED)
    client, _, gw = make(check)
    with caplog.at_level(logging.INFO, "bge_triton.gateway"), client:
        until(lambda: gw.gate.checks >= 1)
        assert check.calls[0] == ("grpc://10.1.2.3:8001", "minilm", REFERENCE, 7.0)
        r = client.get("/ready")
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        error = r.json()["error"]
        assert "worst probe 'zh_long' cosine 0.912345" in error and "wrote reference.json (x)" in error
        assert "/secret/place" not in r.text and "10.1.2.3" not in r.text  # no internal path or address
        metrics = client.get("/metrics").text
        assert "gateway_verified 0.0" in metrics and "gateway_ready 0.0" in metrics
        assert [rec.getMessage() for rec in caplog.records].count(FAILED.message) == 1  # as verify prints it, once

        check.result = PASSED  # e.g. the right model loaded: the next retry holds
        until(lambda: gw.gate.ok)
        r = client.get("/ready")
        assert r.status_code == 200 and r.json() == {"status": "ready", "model": "minilm"}
        metrics = client.get("/metrics").text
        assert "gateway_verified 1.0" in metrics and "gateway_ready 1.0" in metrics
        assert PASSED.message in [rec.getMessage() for rec in caplog.records]


def test_a_check_that_cannot_run_says_so_without_the_address(caplog: pytest.LogCaptureFixture) -> None:
    check = FakeCheck(UNREACHABLE)
    client, _, gw = make(check)
    with caplog.at_level(logging.INFO, "bge_triton.gateway"), client:
        until(lambda: gw.gate.checks >= 2)  # could not run: tried again at the next turn
        r = client.get("/ready")
        assert r.status_code == 503 and "could not run" in r.json()["error"] and "10.1.2.3" not in r.text
        assert [rec.getMessage() for rec in caplog.records].count(UNREACHABLE.message) == 1  # the log has it


def test_no_check_before_triton_answers_and_again_after_it_was_unreachable() -> None:
    backend = FakeBackend()
    backend.is_ready = False
    check = FakeCheck(PASSED)
    client, _, gw = make(check, backend)
    with client:
        r = client.get("/ready")
        assert r.status_code == 503 and r.json()["error"] == backend.last_error and not check.calls
        backend.is_ready = True
        until(lambda: gw.gate.ok)
        assert client.get("/ready").status_code == 200 and len(check.calls) == 1

        backend.is_ready = False  # Triton went away ...
        until(lambda: not gw.gate.ok)
        check.hold.clear()
        check.entered.clear()
        backend.is_ready = True  # ... and came back: not ready until the check held again
        assert check.entered.wait(60)
        r = client.get("/ready")
        assert r.status_code == 503 and "Triton was unreachable" in r.json()["error"]
        assert "gateway_verified 0.0" in client.get("/metrics").text
        check.hold.set()
        until(lambda: gw.gate.ok)
        assert client.get("/ready").status_code == 200 and len(check.calls) == 2


def test_the_check_runs_in_a_daemon_thread_and_a_bug_in_it_keeps_ready_503(caplog: pytest.LogCaptureFixture) -> None:
    """A daemon thread: a gateway stopped while a check waits on a hung Triton exits at once (worker threads of
    anyio and concurrent.futures are joined at exit). A check that raises (it should not) is logged, not fatal."""
    check = FakeCheck(PASSED)
    check.raises = RuntimeError("a bug in the check")
    client, _, gw = make(check)
    with caplog.at_level(logging.INFO, "bge_triton.gateway"), client:
        until(lambda: gw.gate.checks >= 2)  # counted as could-not-run: tried again
        r = client.get("/ready")
        assert r.status_code == 503 and "could not run" in r.json()["error"] and "a bug" not in r.text
        assert "verify could not run: RuntimeError: a bug in the check" in [rec.getMessage() for rec in caplog.records]
        check.raises = None
        until(lambda: gw.gate.ok)
        assert client.get("/ready").status_code == 200
    assert check.daemon and all(check.daemon)


def test_without_reference_ready_is_the_canary_alone() -> None:
    settings = GatewaySettings(model="minilm")
    app = create_app(settings, FakeBackend())
    with TestClient(app) as client:
        assert app.state.gateway.gate is None
        assert client.get("/ready").status_code == 200
        assert "gateway_verified" not in client.get("/metrics").text


def test_the_reference_flag_is_read_at_start(tmp_path) -> None:
    parser = build_parser()
    missing = tmp_path / "minilm_onnx" / "1" / "reference.json"
    with pytest.raises(InputError, match=r"--reference .*reference\.json: no reference vectors at"):
        settings_from_args(parser.parse_args(["--reference", str(missing)]))
    garbage = tmp_path / "reference.json"
    garbage.write_text("{}")
    with pytest.raises(InputError, match="not a bge-triton-reference/1 file"):
        settings_from_args(parser.parse_args(["--reference", str(garbage)]))
    args = parser.parse_args(["--verify-retry", "0"])
    with pytest.raises(InputError, match="--verify-retry"):
        settings_from_args(args)
    assert settings_from_args(parser.parse_args([])).reference is None


def test_the_openapi_document_still_describes_readys_503() -> None:
    client, _, _ = make(FakeCheck(PASSED))
    with client:
        ready = client.get("/openapi.json").json()["paths"]["/ready"]["get"]
    assert set(ready["responses"]) == {"200", "503"} and "reference vectors" in ready["summary"]
