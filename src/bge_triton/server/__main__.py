"""`bge-triton serve up|down|status`: the local real tritonserver (CPU variant of the repository)."""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from bge_triton import flags
from bge_triton.errors import KitError
from bge_triton.repository import iter_models, load_config
from bge_triton.server.canary import canary_all
from bge_triton.server.cpu_variant import CpuVariant
from bge_triton.server.launcher import DEFAULT_STATE, LocalServer, ServerSettings, http_ready, pid_alive, stop_pid


def _parser() -> argparse.ArgumentParser:
    p = flags.parser("bge-triton serve", "The local tritonserver on 127.0.0.1 (the CPU variant of a model "
                     "repository): up, status, down.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    up = flags.subcommand(sub, "up", "render the CPU variant, start tritonserver on 127.0.0.1, wait until ready")
    up.add_argument("--repository", type=Path, default=Path("model_repository"), metavar="DIR",
                    help="the model repository to serve (its CPU variant is rendered under --state-dir)")
    up.add_argument("--http-port", type=int, default=8000, help="Triton's HTTP port")
    up.add_argument("--grpc-port", type=int, default=8001, help="Triton's gRPC port")
    up.add_argument("--metrics-port", type=int, default=8002, help="Triton's metrics port")
    up.add_argument("--model-control", choices=["none", "explicit"], default="none", help="Triton's model control "
                    "mode; explicit loads every model at start and lets `bge-triton tune` load candidate configs")
    flags.add_admin_key(up, help=(
        "put Triton's model-repository API (load, unload, index) behind this key: a request without the header "
        "triton-admin-key: KEY is refused; not set: the API is open to anyone on 127.0.0.1. tritonserver gets the "
        "key on its command line, which local users can read (ps)"))
    up.add_argument("--executor", choices=["onnxruntime", "costmodel"], default="onnxruntime",
                    help="encoder executor: ONNX Runtime, or the calibrated GPU cost model (emulated)")
    up.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: all cores)")
    up.add_argument("--no-cpu-lock", dest="cpu_lock", action="store_false",
                    help="one instance per ONNX Runtime model and no shared CPU lock: half the weights in memory, "
                         "but a request that reaches a busy instance can wait about 500 ms for Triton to wake it "
                         "(docs/architecture.md)")
    up.add_argument("--ready-timeout", type=float, default=180.0, metavar="SECONDS",
                    help="how long to wait for the server and its models to be ready")
    up.add_argument("--watch", type=float, default=0.0, metavar="SECONDS",
                    help="stay in the foreground and send a canary inference to every model each SECONDS; "
                         "restart the server when it died or a canary fails (a model whose python stub died still "
                         "reports ready). Ctrl-C stops watcher and server (0: start and return)")
    up.add_argument("--state-dir", type=Path, default=DEFAULT_STATE, metavar="DIR",
                    help="where the server's pid, ports, log and rendered repository are kept")
    for name, what in (("down", "stop the server started by `bge-triton serve up`"),
                       ("status", "the server's state, a canary per model and `bge-triton verify` per text "
                                  "endpoint (exit 0 healthy, 3 not)")):
        flags.subcommand(sub, name, what).add_argument("--state-dir", type=Path, default=DEFAULT_STATE,
                                                       metavar="DIR", help="the --state-dir given to `up`")
    return p


def _info(state: Path) -> dict | None:
    path = state / "server.json"
    return json.loads(path.read_text()) if path.exists() else None


def unhealthy(srv: LocalServer) -> str:
    """Why the server needs a restart ('' when it is healthy): it died, or a model's canary failed."""
    if srv.proc is None or srv.proc.poll() is not None:
        return "tritonserver exited"
    failed = [f"{r.model}: {r.error}" for r in canary_all(f"http://{srv.http_url}") if not r.ok]
    if failed:  # a canary cut off by the server dying (kill -9 lands mid-request): name the death, not the symptom
        try:
            srv.proc.wait(timeout=0.5)
            return "tritonserver exited"
        except subprocess.TimeoutExpired:
            pass
    return "; ".join(failed)


def verified(info: dict) -> bool:
    """`bge-triton verify` of every text endpoint in the served repository, one line each (docs/export.md)."""
    from bge_triton.server.cpu_variant import is_text_endpoint
    from bge_triton.verify import check

    ok = True
    repository = Path(info["repository"])
    for name, model_dir in iter_models(repository):
        if not is_text_endpoint(load_config(model_dir)):
            continue
        result = check(f"127.0.0.1:{info['http_port']}", name, repository=repository)
        print(f"  {name}: {result.message}")
        ok = ok and result.ok
    return ok


def watch(srv: LocalServer, every_s: float) -> int:
    """Keep `srv` serving: restart it whenever `unhealthy` says why; stop it on Ctrl-C / SIGTERM."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM ends the loop like Ctrl-C
    try:
        while True:
            time.sleep(every_s)
            try:
                reason = unhealthy(srv)
            except OSError as exc:  # the index itself did not answer
                reason = f"server did not answer: {exc}"
            if reason:
                print(f"watch: restarting tritonserver ({reason})", flush=True)
                srv.stop()
                srv.start()
                print(f"watch: ready again, pid {srv.pid}", flush=True)
    except KeyboardInterrupt:
        return 0
    finally:
        srv.stop()


def main(argv: list[str] | None = None) -> int:
    args = flags.parse(_parser(), argv)
    try:
        if args.cmd == "up":
            info = _info(args.state_dir)
            if info and pid_alive(info["pid"]) and (args.state_dir / "server.pid").exists():
                print(f"already running: pid {info['pid']} (http 127.0.0.1:{info['http_port']}); "
                      "`bge-triton serve down` first", file=sys.stderr)
                return 1
            settings = ServerSettings(repository=args.repository, http_port=args.http_port,
                                      grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                                      state_dir=args.state_dir, model_control=args.model_control,
                                      load_models=("*",) if args.model_control == "explicit" else (),
                                      ready_timeout_s=args.ready_timeout, admin_key=args.admin_key or None,
                                      variant=CpuVariant(executor=args.executor, intra_op_threads=args.threads,
                                                         cpu_lock=args.cpu_lock))
            srv = LocalServer(settings).start()
            models = [name for name, _ in iter_models(args.repository)]
            print(f"tritonserver ready: pid {srv.pid}, http {srv.http_url}, grpc {srv.grpc_url}, "
                  f"metrics {srv.metrics_url}; models {models}; log {srv.log_path}"
                  f"{'; model-repository API behind --admin-key' if settings.admin_key else ''}", flush=True)
            return watch(srv, args.watch) if args.watch > 0 else 0
        info = _info(args.state_dir)
        pid_file = args.state_dir / "server.pid"
        if not info or not pid_file.exists():
            print("no server started from this state dir", file=sys.stderr)
            return 1 if args.cmd == "down" else 3
        pid = int(pid_file.read_text())
        if args.cmd == "down":
            was = stop_pid(pid)
            pid_file.unlink(missing_ok=True)
            print(f"stopped pid {pid}" if was else f"pid {pid} was not running")
            return 0
        alive, ready = pid_alive(pid), http_ready(info["http_port"])
        print(f"pid {pid}: {'running' if alive else 'not running'}, {'ready' if ready else 'not ready'}, "
              f"http 127.0.0.1:{info['http_port']} grpc 127.0.0.1:{info['grpc_port']} "
              f"metrics 127.0.0.1:{info['metrics_port']}, repository {info['repository']}")
        healthy = alive and ready
        if ready:  # /ready is not enough: a model whose python stub died still reports READY
            for result in canary_all(f"http://127.0.0.1:{info['http_port']}"):
                state = f"canary ok ({result.ms:.1f} ms)" if result.ok else f"CANARY FAILED: {result.error}"
                print(f"  {result.model}: {state}")
                healthy = healthy and result.ok
            healthy = verified(info) and healthy
        return 0 if healthy else 3
    except KitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
