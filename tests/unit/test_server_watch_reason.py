"""The watcher's restart reason (`server up --watch`, server/__main__.unhealthy): a kill -9 of tritonserver that lands
while a canary is in flight fails the canary first (RemoteDisconnected) and ends the process a moment later; the
reason is the death, not the symptom (a clean-clone CI run logged the canary's error, and the soak's check of the
reason failed). A failing canary on a live server (a dead python stub) keeps the canary's words."""
from __future__ import annotations

import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from bge_triton.server import __main__ as server_main


def _failed_canary(on_call=None):
    def canary_all(url: str):
        if on_call is not None:
            on_call()
        return [SimpleNamespace(ok=False, model="m_onnx", error="RemoteDisconnected: Remote end closed connection")]
    return canary_all


@pytest.fixture
def proc():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p
    if p.poll() is None:
        p.kill()
        p.wait()


def test_a_canary_cut_off_by_the_server_dying_reports_the_death(proc, monkeypatch) -> None:
    # the kill lands during the canary (sent from inside it: a 0.05 s timer thread could fire after the watcher's
    # 0.5 s look on a busy machine); the process is reaped only after the canary has failed, by the watcher
    def kill_now() -> None:
        proc.send_signal(signal.SIGKILL)

    monkeypatch.setattr(server_main, "canary_all", _failed_canary(kill_now))
    srv = SimpleNamespace(proc=proc, http_url="127.0.0.1:1")
    assert server_main.unhealthy(srv) == "tritonserver exited"


def test_a_failing_canary_on_a_live_server_keeps_the_canarys_words(proc, monkeypatch) -> None:
    monkeypatch.setattr(server_main, "canary_all", _failed_canary())
    srv = SimpleNamespace(proc=proc, http_url="127.0.0.1:1")
    assert server_main.unhealthy(srv) == "m_onnx: RemoteDisconnected: Remote end closed connection"
    assert proc.poll() is None


def test_a_dead_server_is_reported_without_a_canary(proc, monkeypatch) -> None:
    proc.kill()
    proc.wait()
    monkeypatch.setattr(server_main, "canary_all", lambda url: pytest.fail("no canary for a dead server"))
    assert server_main.unhealthy(SimpleNamespace(proc=proc, http_url="127.0.0.1:1")) == "tritonserver exited"
