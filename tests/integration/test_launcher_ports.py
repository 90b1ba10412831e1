"""Two servers picking the same ports (two test runs or a bench beside a test suite on one host): the second never
takes the first one's listeners for its own. Before the fix, a server whose ports were taken was reported ready
as soon as the OTHER server answered on them (the busy-machine runs of issue 26: clients then spoke HTTP to
another run's gRPC port, BadStatusLine, or read another server's statistics)."""
from __future__ import annotations

from pathlib import Path

import pytest

from bge_triton.errors import PortInUse
from bge_triton.server.launcher import LocalServer, ServerSettings, free_ports, pid_alive

pytestmark = pytest.mark.integration
POOL = range(18000, 18500)


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory):
    repo = tmp_path_factory.mktemp("empty_repo")  # no models: the server is ready once its listeners are up
    http, grpc, metrics = free_ports(3, POOL)
    srv = LocalServer(ServerSettings(repository=repo, http_port=http, grpc_port=grpc, metrics_port=metrics,
                                     state_dir=tmp_path_factory.mktemp("first"), ready_timeout_s=120)).start()
    yield srv
    srv.stop()


def _same_ports(first: LocalServer, state: Path, pool: range | None) -> ServerSettings:
    s = first.settings
    return ServerSettings(repository=s.repository, http_port=s.http_port, grpc_port=s.grpc_port,
                          metrics_port=s.metrics_port, state_dir=state, ready_timeout_s=120, port_pool=pool)


def test_given_ports_that_are_taken_fail_with_port_in_use(first: LocalServer, tmp_path: Path) -> None:
    second = LocalServer(_same_ports(first, tmp_path, None))
    with pytest.raises(PortInUse, match=rf"http {first.settings.http_port}, grpc {first.settings.grpc_port}"):
        second.start()
    assert second.proc is None  # stopped, nothing left running
    assert pid_alive(first.pid)


def test_picked_ports_that_are_taken_are_picked_again(first: LocalServer, tmp_path: Path) -> None:
    taken = {first.settings.http_port, first.settings.grpc_port, first.settings.metrics_port}
    second = LocalServer(_same_ports(first, tmp_path, POOL)).start()
    try:
        mine = {second.settings.http_port, second.settings.grpc_port, second.settings.metrics_port}
        assert not mine & taken, (mine, taken)
        log = second.log_path.read_text()
        assert f"Started HTTPService at 127.0.0.1:{second.settings.http_port}" in log
        assert pid_alive(first.pid) and pid_alive(second.pid)
    finally:
        second.stop()
