"""One stand-up: every tritonserver the load tests start goes through loadtest/harness.py (server_settings, then
launch / start_server in-process, or serve_up / WatchedServer as `bge-triton serve up`), so port choice, state dir,
variant, model control, ready-wait and stop are defined once. Read from the source (ast): no other module under
src/bge_triton/loadtest, nor deploy/k8s/capacity.py, constructs a LocalServer or ServerSettings, takes the launcher's
pieces to build one by hand, or names the tritonserver binary or `bge_triton.server` as a command to run."""
from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from bge_triton import flags
from bge_triton.loadtest import harness
from bge_triton.server import __main__ as server_main
from bge_triton.server.cpu_variant import CpuVariant

ROOT = Path(__file__).resolve().parents[2]
STANDUP = "src/bge_triton/loadtest/harness.py"
# The modules that may start a tritonserver their own way, each with the reason.
EXCEPTIONS = {
    "src/bge_triton/loadtest/gpu/assets.py": "runs on a bare GPU host from the slim pytriton wheel, without the "
    "server extra that server.launcher (and so harness) imports; its `tritonserver` repeats the launcher's steps",
}
CONSTRUCTORS = {"LocalServer", "ServerSettings"}
PIECES = {"build_command", "prepare_backends", "server_env", "stub_venv"}  # server.launcher's insides
COMMANDS = {"tritonserver", "bge_triton.server", "bge_triton.server.__main__"}  # a binary / a `python -m` target


def offences(source: str) -> list[str]:
    """Each place in `source` that starts a tritonserver other than through the stand-up."""
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name in CONSTRUCTORS:
                found.append(f"{where}: constructs {name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bge_triton.server"):
            found += [f"{where}: imports launcher's {a.name}" for a in node.names if a.name in PIECES]
        elif isinstance(node, ast.Attribute) and node.attr in PIECES:
            found.append(f"{where}: uses launcher's {node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.strip() in COMMANDS:
            found.append(f"{where}: names the command {node.value!r}")
    return found


def scanned() -> list[str]:
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "src/bge_triton/loadtest").rglob("*.py"))
    return [*files, "deploy/k8s/capacity.py"]


def test_no_load_test_module_starts_a_tritonserver_but_the_standup() -> None:
    found = {path: why for path in scanned() if path != STANDUP and path not in EXCEPTIONS
             and (why := offences((ROOT / path).read_text(encoding="utf-8")))}
    assert not found, ("start the server through loadtest/harness.py (server_settings + launch / start_server, or "
                       f"serve_up / WatchedServer for the command line), or add a justified exception: {found}")


def test_the_check_sees_each_way_of_starting_one() -> None:
    # the stand-up module and the exception are what the check would flag elsewhere
    assert offences((ROOT / STANDUP).read_text(encoding="utf-8"))
    for path in EXCEPTIONS:
        assert offences((ROOT / path).read_text(encoding="utf-8")), f"{path} needs no exception any more"
    samples = {
        "from bge_triton.server.launcher import LocalServer\nLocalServer(s).start()": "constructs LocalServer",
        "from bge_triton.server import launcher\nlauncher.ServerSettings(http_port=1)": "constructs ServerSettings",
        "from bge_triton.server.launcher import build_command": "imports launcher's build_command",
        "import subprocess, sys\nsubprocess.Popen([sys.executable, '-m', 'bge_triton.server', 'up'])":
            "names the command 'bge_triton.server'",
        "subprocess.Popen([str(root / 'bin' / 'tritonserver'), '--model-repository=r'])":
            "names the command 'tritonserver'",
    }
    for source, what in samples.items():
        assert any(what in o for o in offences(source)), (source, offences(source))
    assert offences("print('tritonserver exited'); srv = harness.start_server(repo, state)") == []


def test_scanned_files_include_every_converted_caller() -> None:
    files = scanned()
    for name in ("stack_bench", "gateway_bench", "rerank_bench", "faults", "chaos", "soak", "target", "stand"):
        assert f"src/bge_triton/loadtest/{name}.py" in files


def test_serve_up_argv_says_the_same_settings_to_the_command_line(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    variant = CpuVariant(executor="costmodel", intra_op_threads=3, cpu_lock=False)
    settings = harness.server_settings(tmp_path / "repo", tmp_path / "state", variant, ports=(18901, 18902, 18903),
                                       model_control="explicit", load_models=("*",), ready_timeout_s=42.5,
                                       admin_key="k3y")
    argv = harness.serve_up_argv(settings, watch_s=1.5)
    assert argv[1:4] == ["-m", "bge_triton.server", "up"]
    for key in [k for k in os.environ if k.startswith("BGE_TRITON_")]:  # the flags alone, not the environment's
        monkeypatch.delenv(key)
    a = flags.parse(server_main._parser(), argv[3:])
    assert (a.repository, a.state_dir) == (tmp_path / "repo", tmp_path / "state")
    assert (a.http_port, a.grpc_port, a.metrics_port) == (18901, 18902, 18903)
    assert (a.model_control, a.executor, a.threads, a.cpu_lock) == ("explicit", "costmodel", 3, False)
    assert (a.ready_timeout, a.admin_key, a.watch) == (42.5, "k3y", 1.5)


@pytest.mark.parametrize("unsaid", [
    {"variant": CpuVariant(executor="costmodel", cost_a_us=1.0)},
    {"extra_args": ("--log-info=true",)},
    {"model_control": "explicit"},  # without load_models=("*",): the command line loads every model
])
def test_serve_up_argv_refuses_what_the_command_line_cannot_say(tmp_path: Path, unsaid: dict) -> None:
    settings = harness.server_settings(tmp_path, tmp_path / "state", ports=(18901, 18902, 18903), **{
        k: v for k, v in unsaid.items() if k != "variant"}, variant=unsaid.get("variant"))
    with pytest.raises(ValueError, match="harness.launch"):
        harness.serve_up_argv(settings)
