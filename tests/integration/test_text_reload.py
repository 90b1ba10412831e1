"""The text endpoint reloaded under traffic on a REAL tritonserver (explicit model control).

Before the fix, the first reload after traffic broke the server: the old instance's finalize deleted its
pb_utils metrics, which destroyed the prometheus counters the new instance (loaded first) shares with it; the
new instance's next increment wrote into freed memory of the tritonserver process (malloc(): unaligned
fastbin chunk detected, Signal (6)), which then stayed up, ready, answering nothing. Here: two text-endpoint
instances (they share the counters too), the MiniLM encoder on ONNX Runtime, clients sending bulk requests of
16-64 texts and single texts, and four reloads of the text model, three while requests are in flight and one
right after the traffic stops. Every request gets exactly one answer (an embedding, or UNAVAILABLE for one the
unload caught), the reloaded model answers the embeddings it answered before, and the log shows no crash.
Waits are bounded by progress (answers arriving), not by wall-clock budgets.
"""
from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from bge_triton.repository import (
    Batching,
)
from bge_triton.server.cpu_variant import CpuVariant
from conftest import text_endpoint_repo

pytestmark = pytest.mark.integration

MODEL = "tr"
CRASH_MARKS = ("Signal (", "malloc", "Segmentation fault", "Fatal Python error", "not healthy", "corrupted",
               "double free", "core dumped")
PROBE = ["the model answers after a reload", "一个中文句子", "short"]
WORDS = "reload traffic bulk single text embedding answer server model instance metric counter".split()


def _repo(src: Path, out: Path) -> Path:
    return text_endpoint_repo(src, out, MODEL, "tests/integration/test_text_reload.py")


def _inputs(texts):
    inp = grpcclient.InferInput("text", [len(texts), 1], "BYTES")
    inp.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=object))
    return [inp]


class Traffic:
    """Client threads sending requests one after the other; every answer is recorded per request."""

    def __init__(self, url: str, threads: int = 4) -> None:
        self.url, self.stop = url, threading.Event()
        self.lock = threading.Lock()
        self.sent = 0
        self.answers: dict[int, list[tuple[str, str]]] = {}  # request number -> [(outcome, detail)]
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(threads)]

    def start(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def answered(self) -> int:
        with self.lock:
            return len(self.answers)

    def outstanding(self) -> int:
        with self.lock:
            return self.sent - len(self.answers)

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        client = grpcclient.InferenceServerClient(self.url)
        while not self.stop.is_set():
            n = rng.randint(16, 64) if rng.random() < 0.4 else 1
            texts = [" ".join(rng.choice(WORDS) for _ in range(rng.choice((2, 6, 20)))) for _ in range(n)]
            done = threading.Event()
            with self.lock:
                key = self.sent
                self.sent += 1

            def callback(result, error, key=key, n=n, done=done) -> None:
                if error is None:
                    out = result.as_numpy("embedding")
                    good = out.shape == (n, 384) and np.allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-3)
                    entry = ("ok" if good else "bad embedding", str(out.shape))
                else:
                    entry = (str(error.status()), error.message()[:300])
                with self.lock:
                    self.answers.setdefault(key, []).append(entry)
                done.set()

            client.async_infer(MODEL, _inputs(texts), callback=callback)
            done.wait(600)  # the test's progress bound decides; this only keeps one request per thread

    def wait_answers(self, more: int, what: str) -> None:
        """Until `more` further answers arrived; fails only when no answer at all arrives for 60 s."""
        target = self.answered() + more
        self._until(lambda: self.answered() >= target, what)

    def finish(self) -> None:
        self.stop.set()
        self._until(lambda: self.outstanding() == 0, "the last requests' answers")
        for t in self.threads:
            t.join(60)

    def _until(self, check, what: str) -> None:
        last, seen = time.monotonic(), self.answered()
        while not check():
            now_seen = self.answered()
            if now_seen != seen:
                last, seen = time.monotonic(), now_seen
            assert time.monotonic() - last < 60, f"no answer for 60 s while waiting for {what} " \
                                                 f"({self.outstanding()} requests outstanding)"
            time.sleep(0.02)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """The same embeddings up to the padding of the sub-batch they ran in (cosine of each pair)."""
    return a.shape == b.shape and bool(np.all(np.sum(a * b, axis=1) > 0.9999))


def _crash_lines(log: Path) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines() if any(m in line for m in CRASH_MARKS)]


def _reload(client, n: int) -> None:
    """load_model with a config that differs (a text-endpoint parameter): always a real reload, the new instances
    loaded before the old ones unload (load_model of an unchanged model does nothing)."""
    cfg = client.get_model_config(MODEL, as_json=True)["config"]
    cfg["parameters"]["metrics_flush_s"] = {"string_value": f"0.0{5 + n}"}
    client.load_model(MODEL, config=json.dumps(cfg))
    assert client.is_model_ready(MODEL)


@pytest.fixture(scope="module")
def server(minilm_repo: Path, server_factory, tmp_path_factory):
    repo = _repo(minilm_repo, tmp_path_factory.mktemp("text_reload_repo"))
    # the real MiniLM encoder (ONNX Runtime), so the embeddings can be compared across reloads; two text instances
    variant = CpuVariant(executor="onnxruntime", text_instances=2,
                         batching={f"{MODEL}_onnx": Batching(max_queue_delay_us=0, preferred_batch_sizes=())})
    return server_factory(repo, variant=variant, model_control="explicit", load_models=("*",))


def test_reloads_under_traffic_answer_every_request_once_and_crash_nothing(server) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    reference = client.infer(MODEL, _inputs(PROBE)).as_numpy("embedding")
    traffic = Traffic(server.grpc_url).start()
    in_flight = []
    try:
        for n in range(3):  # reloads while requests are in flight
            traffic.wait_answers(20, f"traffic before reload {n}")
            in_flight.append(traffic.outstanding())
            _reload(client, n)
            traffic.wait_answers(10, f"answers after reload {n}")
            after = client.infer(MODEL, _inputs(PROBE)).as_numpy("embedding")
            assert _same(after, reference), f"reload {n}: other embeddings"
    finally:
        traffic.finish()
    _reload(client, 3)  # right after the traffic stopped (the old instances still flushing their counters)
    after = client.infer(MODEL, _inputs(PROBE)).as_numpy("embedding")
    assert _same(after, reference), "reload 3: other embeddings"

    assert max(in_flight) > 0, f"no request was in flight at any reload: {in_flight}"
    assert traffic.sent == len(traffic.answers) and all(len(a) == 1 for a in traffic.answers.values()), \
        "a request got no answer, or more than one"
    outcomes = [a[0] for a in traffic.answers.values()]
    unexpected = [o for o in outcomes if o[0] not in ("ok", "StatusCode.UNAVAILABLE")]
    assert not unexpected, unexpected[:5]
    assert sum(o[0] == "ok" for o in outcomes) >= 50, outcomes[:5]
    crashes = _crash_lines(server.log_path)
    assert not crashes, "\n".join(crashes[:20])
    assert server.proc.poll() is None and client.is_server_ready()
    # the counters keep counting across the reloads (one series per model, never deleted)
    for _ in range(2):
        client.infer(MODEL, _inputs(["one more"]))
