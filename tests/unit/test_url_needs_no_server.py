"""`pip install 'bge-triton-kit[loadtest]'` is all a user's host needs for the commands that measure a running Triton:
they run with the local server's extra (nvidia-pytriton, bge_triton.server) unimportable, and reach the server."""
from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest

BLOCKED = textwrap.dedent("""
    import sys

    class NoServerExtra:  # as on a host without the [server] extra: pytriton and the launcher do not import
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "pytriton" or name == "bge_triton.server" or name.startswith("bge_triton.server."):
                raise ModuleNotFoundError(f"No module named {name!r}")

    sys.meta_path.insert(0, NoServerExtra())
    from bge_triton.cli import main

    sys.exit(main(sys.argv[1:]))
""")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


@pytest.mark.parametrize("argv", [
    ["bench", "seed", "--quick"],
    ["tune", "--slo-p99-ms", "100"],
    ["tune", "pair", "--slo-p99-ms", "100"],
    ["bench", "rerank"],
])
def test_url_commands_run_without_the_server_extra(argv: list[str]) -> None:
    port = closed_port()
    done = subprocess.run([sys.executable, "-c", BLOCKED, *argv, "--url", f"127.0.0.1:{port}"],
                          capture_output=True, text=True, timeout=120)
    assert "No module named" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert f"no Triton answers at --url 127.0.0.1:{port}" in done.stderr, done.stderr


def test_the_blocker_blocks() -> None:
    """The check above can fail: a command that needs the server extra fails under the same blocker."""
    done = subprocess.run([sys.executable, "-c", BLOCKED, "serve", "status"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0 and "bge_triton.server" in done.stderr, (done.returncode, done.stderr[-2000:])
