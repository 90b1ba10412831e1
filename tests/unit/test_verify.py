"""bge_triton.verify without a server: the judgement, its messages, the reference file, the readiness marker."""
from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from bge_triton.verify import standalone as sa
from bge_triton.verify.standalone import Probe, Reference, VerifyError, judge
from bge_triton.verify.triton import split_url

DIM = 16


def _reference(precision: str = "fp16", n: int = 5, seed: int = 0, path: str = "repo/m_onnx/1/reference.json"):
    rng = np.random.default_rng(seed)
    vecs = rng.normal(size=(n, DIM)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    probes = [Probe(f"p{i}", f"kind {i}", f"text {i}", list(range(101, 104 + i)), vecs[i]) for i in range(n)]
    mean = 0.99 if precision == "int8" else None
    return Reference(path, "m", "m_onnx", precision, 0.98 if precision == "int8" else 0.999, mean, DIM, 32,
                     "test model", probes, "0" * 64)


def _vectors(ref: Reference) -> np.ndarray:
    return np.stack([p.vector for p in ref.probes])


def _counts(ref: Reference) -> list[int]:
    return [len(p.input_ids) for p in ref.probes]


def _tilt(v: np.ndarray, i: int, cosine: float, seed: int = 1) -> np.ndarray:
    """v with row i turned to the given cosine against the original."""
    out = v.copy()
    other = np.random.default_rng(seed).normal(size=v.shape[1])
    other -= other @ v[i] * v[i]
    other /= np.linalg.norm(other)
    out[i] = cosine * v[i] + np.sqrt(1 - cosine**2) * other
    return out


def test_exact_vectors_pass_with_the_worst_probe_named():
    ref = _reference()
    v = _vectors(ref)
    res = judge(ref, v, _counts(ref), v)
    assert res.ok and res.fault == "" and res.message.startswith("verify OK: model m (encoder m_onnx, fp16")
    assert all(abs(p.text_cosine - 1) < 1e-6 and abs(p.encoder_cosine - 1) < 1e-6 for p in res.probes)


def test_encoder_fault_names_model_precision_worst_probe_and_cosine():
    ref = _reference()
    v = _vectors(ref)
    bad = _tilt(v, 3, 0.95)
    res = judge(ref, bad, _counts(ref), bad)
    assert not res.ok and res.fault == "encoder"
    for part in ("verify FAILED", "model m", "fp16", "min cosine >= 0.999", "worst probe 'p3' cosine 0.950000",
                 "encoder"):
        assert part in res.message, (part, res.message)
    assert "TOKENIZER" not in res.message


def test_just_below_the_bar_fails_and_just_above_passes():
    ref = _reference("fp32")
    v = _vectors(ref)
    assert not judge(ref, v, None, _tilt(v, 0, 0.9989)).ok
    assert judge(ref, v, None, _tilt(v, 0, 0.9991)).ok


def test_text_endpoint_alone_off_points_at_the_tokenizer():
    ref = _reference()
    v = _vectors(ref)
    counts = _counts(ref)
    counts[1] += 2
    res = judge(ref, _tilt(v, 1, 0.7), counts, v)
    assert not res.ok and res.fault == "tokenizer"
    assert "TOKENIZER" in res.message and "worst probe 'p1' cosine 0.700000" in res.message
    assert "token counts differ on 1 of 5 probes (e.g. 'p1': 6 served, 4 exported)" in res.message
    assert "m/1/tokenizer/" in res.message


def test_token_counts_alone_fail_as_a_tokenizer_fault():
    """Vectors within the bar but another token count: the served tokenizer is not the export's."""
    ref = _reference()
    v = _vectors(ref)
    counts = _counts(ref)
    counts[0] -= 1
    res = judge(ref, v, counts, v)
    assert not res.ok and res.fault == "tokenizer" and "token counts differ" in res.message


def test_int8_holds_min_and_mean():
    ref = _reference("int8", n=4)
    v = _vectors(ref)
    ok = _tilt(v, 0, 0.985)
    assert judge(ref, ok, None, ok).ok  # min 0.985 >= 0.98, mean 0.996 >= 0.99
    low_mean = v.copy()
    for i in range(4):
        low_mean = _tilt(low_mean, i, 0.981, seed=i)
    res = judge(ref, low_mean, None, low_mean)
    assert not res.ok and "mean >= 0.99" in res.message


def test_a_wrong_shape_is_a_verify_error_naming_the_reference():
    ref = _reference()
    with pytest.raises(VerifyError, match="not the export the reference belongs to"):
        judge(ref, np.zeros((5, DIM + 1)), None, _vectors(ref))


def test_nan_or_zero_vectors_fail():
    ref = _reference()
    v = _vectors(ref)
    bad = v.copy()
    bad[2] = np.nan
    assert judge(ref, bad, None, bad).fault == "encoder"
    bad[2] = 0.0
    assert judge(ref, bad, None, bad).fault == "encoder"


def _write(tmp_path: Path, ref: Reference, **override) -> Path:
    doc = {"format": sa.FORMAT, "model": ref.model, "encoder": ref.encoder, "precision": ref.precision,
           "tolerance": {"min_cosine": ref.min_cosine}, "dim": ref.dim, "max_length": ref.max_length,
           "source": ref.source, "probes": [{"name": p.name, "kind": p.kind, "text": p.text,
                                             "input_ids": p.input_ids, "vector": sa.encode_vector(p.vector)}
                                            for p in ref.probes]}
    doc.update(override)
    path = tmp_path / "m_onnx" / "1" / sa.REFERENCE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def test_reference_round_trip_is_exact(tmp_path):
    ref = _reference()
    got = sa.load_reference(_write(tmp_path, ref))
    assert got.model == "m" and got.encoder == "m_onnx" and got.tolerance == "min cosine >= 0.999"
    pairs = zip(ref.probes, got.probes, strict=True)
    assert all(np.array_equal(a.vector, b.vector) and a.input_ids == b.input_ids for a, b in pairs)
    assert sa.reference_path(tmp_path, "m") == tmp_path / "m_onnx" / "1" / "reference.json"


def test_missing_or_foreign_reference_says_what_to_do(tmp_path):
    with pytest.raises(VerifyError, match=r"no reference vectors at .*bge-triton export.*--reference"):
        sa.load_reference(tmp_path / "nope.json")
    with pytest.raises(VerifyError, match="not a bge-triton-reference/1 file"):
        sa.load_reference(_write(tmp_path, _reference(), format="other"))
    with pytest.raises(VerifyError, match="not a readable reference file"):
        sa.load_reference(_write(tmp_path, _reference(), probes=[{"name": "x"}]))


def test_standalone_imports_only_stdlib_and_numpy():
    """The server image has python3 + numpy and no kit: the readiness check must import nothing else."""
    tree = ast.parse(Path(sa.__file__).read_text(), feature_version=(3, 10))  # the 24.10 image's Python 3.10
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names - set(sys.stdlib_module_names) == {"numpy"}
    assert not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree))


class FakeServer(sa.HttpJson):
    """HttpJson with the network replaced: answers from arrays, counts inference calls."""

    def __init__(self, ref: Reference, encoder_vectors: np.ndarray, ready: bool = True) -> None:
        super().__init__("http://fake:1")
        self.ref, self.enc, self.is_ready, self.calls = ref, encoder_vectors, ready, 0

    def ready(self) -> bool:
        return self.is_ready

    def encoder_of(self, model: str) -> str | None:
        return "m_onnx"

    def embed_texts(self, model, texts):
        self.calls += 1
        return _vectors(self.ref), _counts(self.ref)

    def embed_tokens(self, encoder, input_ids):
        i = [p.input_ids for p in self.ref.probes].index(input_ids)
        return self.enc[i:i + 1]


def test_readiness_checks_once_per_start_and_keeps_failing_until_it_holds(tmp_path):
    ref = _reference()
    path = _write(tmp_path, ref)
    marker, log = tmp_path / "state", tmp_path / "log"
    down = FakeServer(ref, _vectors(ref), ready=False)
    assert sa.ready_check(down, "m", tmp_path, None, marker, log) == (sa.FAILED, down_msg(down))
    bad = FakeServer(ref, _tilt(_vectors(ref), 4, 0.9))
    for _ in range(2):
        code, message = sa.ready_check(bad, "m", tmp_path, None, marker, log)
        assert code == sa.FAILED and "worst probe 'p4' cosine 0.900000" in message
    assert bad.calls == 2 and not (marker / "m.ok").exists()
    assert json.loads((marker / "m.failed").read_text())["message"] == message
    assert log.read_text().count("verify FAILED") == 1  # logged when it changes, not at every probe
    good = FakeServer(ref, _vectors(ref))
    assert sa.ready_check(good, "m", None, path, marker, log)[0] == sa.OK
    assert sa.ready_check(good, "m", None, path, marker, log) == (sa.OK, "")  # remembered: no second inference
    assert good.calls == 1 and not (marker / "m.failed").exists()
    assert "verify OK" in log.read_text().splitlines()[-1]


def down_msg(server: sa.HttpJson) -> str:
    return f"not ready: Triton at {server.base} is not ready (/v2/health/ready)"


def test_a_changed_reference_is_verified_again(tmp_path):
    ref = _reference()
    marker = tmp_path / "state"
    good = FakeServer(ref, _vectors(ref))
    _write(tmp_path, ref)
    sa.ready_check(good, "m", tmp_path, None, marker)
    sa.ready_check(good, "m", tmp_path, None, marker)
    assert good.calls == 1
    _write(tmp_path, ref, source="another export")
    sa.ready_check(good, "m", tmp_path, None, marker)
    assert good.calls == 2


def test_urls_and_protocols():
    assert split_url("grpc://h:8001", None) == ("grpc", "h:8001")
    assert split_url("h:8000", None) == ("http", "h:8000")
    assert split_url("h:8001", "grpc") == ("grpc", "h:8001")
    with pytest.raises(VerifyError, match="says http but --protocol is grpc"):
        split_url("http://h:1", "grpc")
    with pytest.raises(VerifyError, match="only http:// and grpc://"):
        split_url("https://h:1", None)


def test_check_reports_an_unreachable_server_as_not_ok(tmp_path):
    import socket

    from bge_triton.verify import check

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = check(f"127.0.0.1:{port}", "m", repository=tmp_path, timeout_s=5)
    assert not res.ok and res.fault == "unavailable" and res.message.startswith("verify could not run:")


def test_marker_only_probe_never_embeds_and_reports_the_check_at_start(tmp_path):
    ref = _reference()
    _write(tmp_path, ref)
    marker = tmp_path / "state"
    bad, good = FakeServer(ref, _tilt(_vectors(ref), 2, 0.9)), FakeServer(ref, _vectors(ref))
    code, message = sa.ready_check(good, "m", tmp_path, None, marker, check=False)
    assert code == sa.FAILED and message.startswith("not verified yet") and good.calls == 0
    _, failed = sa.wait_and_check(bad, "m", tmp_path, None, marker, None, wait_s=0)  # the entrypoint's run
    assert sa.ready_check(bad, "m", tmp_path, None, marker, check=False) == (sa.FAILED, failed)
    assert bad.calls == 1 and "worst probe 'p2'" in failed
    assert sa.wait_and_check(good, "m", tmp_path, None, marker, None, wait_s=0)[0] == sa.OK
    assert sa.ready_check(good, "m", tmp_path, None, marker, check=False) == (sa.OK, "") and good.calls == 1


def test_text_endpoint_off_with_equal_token_counts_still_names_the_tokenizer_side():
    ref = _reference()
    v = _vectors(ref)
    res = judge(ref, _tilt(v, 0, 0.99), _counts(ref), v)
    assert res.fault == "tokenizer" and "TOKENIZER" in res.message and "token counts match" in res.message
