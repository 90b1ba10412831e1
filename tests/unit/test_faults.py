"""loadtest.faults, the one fault module of chaos and the soak: the one definition of recovered (judge), the overload
spike of the offered rate, the ports held while a killed server is down, and the client's public `transport=` seam
that the fault scenarios watch attempts through; chaos and the soak refuse --url (they kill their own servers)."""
from __future__ import annotations

import asyncio
import socket
from typing import Any

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc

from bge_triton.client import AsyncEmbeddingClient, EmbeddingClient, RetryPolicy
from bge_triton.errors import InputError, ServerNotReady
from bge_triton.loadtest import chaos, faults, soak
from bge_triton.loadtest.faults import OVERLOAD_SPIKE, Outcome, Shot, judge
from bge_triton.server.launcher import free_ports


def steady(start: float, end: float, latency: float, rate: float = 20.0, outcome: str = "ok") -> list[Shot]:
    n = int(round((end - start) * rate))
    return [Shot(start + k / rate, start + k / rate + latency, outcome) for k in range(n)]


OUTAGE = steady(0, 10, 0.05) + steady(10, 13, 0.01, outcome="ServerUnavailable") + steady(13, 30, 0.05)


def test_a_kill_is_recovered_once_ready_again_a_success_and_p99_back() -> None:
    o = judge(Outcome(faults.KILL9_SERVER, 10.0, ready_again_s=2.5, restart=faults.SAME_PORTS), OUTAGE, 0.1, 1.0, 30.0)
    assert o.recovered and o.first_ok_s == pytest.approx(3.05) and o.p99_normal_s == pytest.approx(3.0)
    assert (o.errors_after, o.lost_after) == (60, 0)


@pytest.mark.parametrize("change, why", [
    ({"ready_again_s": None, "restart": "ports taken: 18501: pid 7 tritonserver"}, "never ready on its ports"),
    ({"error": "no tritonserver to kill"}, "not injected"),
])
def test_a_kill_is_not_recovered(change: dict, why: str) -> None:
    o = Outcome(faults.KILL9_SERVER, 10.0, ready_again_s=2.5, restart=faults.SAME_PORTS)
    for key, value in change.items():
        setattr(o, key, value)
    assert not judge(o, OUTAGE, 0.1, 1.0, 30.0).recovered, why


def test_no_success_or_no_normal_p99_is_not_recovered() -> None:
    down = steady(0, 10, 0.05) + steady(10, 30, 0.01, outcome="ServerUnavailable")
    o = judge(Outcome(faults.KILL9_SERVER, 10.0, ready_again_s=1.0), down, 0.1, 1.0, 30.0)
    assert o.first_ok_s is None and not o.recovered
    slow = steady(0, 10, 0.05) + steady(10, 30, 0.5)  # answered, but never back under the threshold
    o = judge(Outcome(faults.KILL9_SERVER, 10.0, ready_again_s=1.0), slow, 0.1, 1.0, 30.0)
    assert o.first_ok_s is not None and o.p99_normal_s is None and not o.recovered


def test_a_spike_needs_no_restart_and_is_judged_after_its_end_too() -> None:
    shots = steady(0, 10, 0.05) + steady(10, 14, 0.8) + steady(14, 30, 0.05)
    o = judge(Outcome(OVERLOAD_SPIKE, 10.0, length_s=4.0), shots, 0.1, 1.0, 30.0)
    assert o.recovered and o.p99_normal_after_end_s == pytest.approx(0.0) and o.p99_normal_s == pytest.approx(4.0)


def test_rate_spike_multiplies_then_returns() -> None:
    rate = faults.Rate(10.0)
    seen: list[float] = []

    async def run() -> None:
        task = asyncio.ensure_future(rate.spike(3.0, 0.05))
        await asyncio.sleep(0.01)
        seen.append(rate())
        await task

    asyncio.run(run())
    assert seen == [30.0] and rate() == 10.0


def test_held_ports_are_skipped_by_free_ports_and_released_after() -> None:
    [port] = free_ports(1, range(18600, 18700))
    with faults.PortHold([port]) as hold:
        assert hold.grab() == []
        with pytest.raises(ServerNotReady, match="fewer than 1 free ports"):
            free_ports(1, range(port, port + 1))  # a server started meanwhile cannot pick it
    assert free_ports(1, range(port, port + 1)) == [port]


def test_a_port_taken_already_is_named() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with faults.PortHold([port]) as hold:
            assert hold.grab() == [port]
        assert f"{port}: pid" in faults.port_holders([port])


def test_no_stub_to_kill_is_said() -> None:
    with pytest.raises(ServerNotReady, match="no python stub of enc"):
        faults.kill_stub(None, "enc")


def test_chaos_and_soak_refuse_a_url(capsys: pytest.CaptureFixture) -> None:
    assert chaos.main(["--url", "127.0.0.1:8001"]) == 2
    assert "--url 127.0.0.1:8001: not accepted: chaos kills" in capsys.readouterr().err
    with pytest.raises(InputError, match="not accepted: the soak kills"):
        soak.parse_args(["--duration", "40s", "--url", "http://127.0.0.1:8000"])


class Wire:
    """A transport for the client's `transport=` seam: counts what it is sent, answers unit vectors."""

    def __init__(self) -> None:
        self.infers = 0
        self.closed = False

    def model_config(self, name: str, timeout_s: float) -> mc.ModelConfig:
        c = mc.ModelConfig(name=name, max_batch_size=4)
        c.input.add(name="text", data_type=mc.TYPE_STRING, dims=[1])
        c.output.add(name="embedding", data_type=mc.TYPE_FP32, dims=[2])
        return c

    def infer(self, call: Any, timeout_s: float) -> Any:
        self.infers += 1
        arrays = {"embedding": np.tile(np.array([[0.6, 0.8]], np.float32), (call.rows, 1))}
        return type("Result", (), {"as_numpy": staticmethod(arrays.get)})()

    def close(self) -> None:
        self.closed = True


class AsyncWire(Wire):
    async def model_config(self, name: str, timeout_s: float) -> mc.ModelConfig:  # type: ignore[override]
        return Wire.model_config(self, name, timeout_s)

    async def infer(self, call: Any, timeout_s: float) -> Any:  # type: ignore[override]
        return Wire.infer(self, call, timeout_s)

    async def close(self) -> None:  # type: ignore[override]
        self.closed = True


def test_clients_send_through_the_given_transport() -> None:
    wire = Wire()
    with EmbeddingClient("127.0.0.1:1", model="m", retry=RetryPolicy.off(), transport=wire) as c:
        assert c.embed_documents(["a", "b"]).shape == (2, 2)
    assert wire.infers == 1 and wire.closed
    awire = AsyncWire()

    async def run() -> Any:
        async with AsyncEmbeddingClient("127.0.0.1:1", model="m", transport=awire) as ac:
            return await ac.embed_documents(["a", "b", "c", "d", "e"])  # two requests: max_batch_size 4

    assert asyncio.run(run()).shape == (5, 2) and awire.infers == 2 and awire.closed
