"""Check a served embedding model against the reference vectors its export wrote; python3 stdlib + numpy only.

The export writes NAME_onnx/1/reference.json (bge_triton.export.reference): probe texts, the exporter's tokens
for them, their FP32 vectors from PyTorch, and the tolerance of the precision it wrote. This module embeds the
probes twice through Triton's HTTP/JSON v2 API: through the text endpoint (the served tokenizer + encoder), and
through the encoder with the exporter's tokens. Encoder off: its weights, precision or execution provider differ
from the reference. Encoder on but text endpoint off: the tokenizer (or max_length) differs from the export's.

It imports nothing from the kit, so the server image (NGC Triton: python3 + numpy, no kit) runs this one file as
its readiness check (deploy/verify-ready.sh); `bge-triton verify` (bge_triton.verify) judges with the same code
and prints the same message.

    python3 standalone.py --url http://127.0.0.1:8000 --model bge_large_zh --repository /models
    python3 standalone.py ... --ready-marker /tmp/bge-triton-verify   # readiness: Triton ready AND verified

Exit: 0 verified; 1 below tolerance (or, with --ready-marker, not ready); 2 could not check (no server, no file).
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

FORMAT = "bge-triton-reference/1"
REFERENCE_FILE = "reference.json"
ENCODER_SUFFIX = "_onnx"
OK, FAILED, CANNOT_CHECK = 0, 1, 2


class VerifyError(Exception):
    """The check could not run (no reference, no server, an answer of the wrong shape); the message says why."""


@dataclass(frozen=True)
class Probe:
    """One probe text, the exporter's tokens for it and its FP32 reference vector."""

    name: str
    kind: str
    text: str
    input_ids: list[int]
    vector: np.ndarray


@dataclass(frozen=True)
class Reference:
    """reference.json as read: which export it belongs to, its tolerance, and the probes."""

    path: str
    model: str  # the text endpoint's name
    encoder: str  # the encoder's name (NAME_onnx)
    precision: str
    min_cosine: float
    mean_cosine: float | None  # int8 only
    dim: int
    max_length: int
    source: str
    probes: list[Probe]
    sha256: str

    @property
    def tolerance(self) -> str:
        """The bar in words, e.g. 'min cosine >= 0.999'."""
        mean = f", mean >= {self.mean_cosine}" if self.mean_cosine is not None else ""
        return f"min cosine >= {self.min_cosine}{mean}"


def encode_vector(v: np.ndarray) -> str:
    """A float32 vector as base64 of its little-endian bytes (exact and 3x smaller than decimal JSON)."""
    return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")


def decode_vector(s: str) -> np.ndarray:
    """The inverse of encode_vector."""
    return np.frombuffer(base64.b64decode(s), dtype="<f4").astype(np.float32)


def reference_path(repository: str | Path, model: str, encoder: str | None = None) -> Path:
    """Where the export of MODEL keeps its reference: REPOSITORY/MODEL_onnx/1/reference.json."""
    return Path(repository) / (encoder or model + ENCODER_SUFFIX) / "1" / REFERENCE_FILE


def load_reference(path: str | Path) -> Reference:
    """Read and check reference.json; VerifyError names the file and the fix."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as err:
        raise VerifyError(f"no reference vectors at {p} ({err.strerror}): export the model with `bge-triton export` "
                          f"(it writes NAME_onnx/1/{REFERENCE_FILE}), or pass --reference PATH") from err
    try:
        doc = json.loads(raw)
        if doc.get("format") != FORMAT:
            raise VerifyError(f"{p} is not a {FORMAT} file (format {doc.get('format')!r}); re-export the model")
        tol = doc["tolerance"]
        probes = [Probe(d["name"], d["kind"], d["text"], [int(i) for i in d["input_ids"]], decode_vector(d["vector"]))
                  for d in doc["probes"]]
        ref = Reference(str(p), doc["model"], doc["encoder"], doc["precision"], float(tol["min_cosine"]),
                        None if tol.get("mean_cosine") is None else float(tol["mean_cosine"]), int(doc["dim"]),
                        int(doc["max_length"]), doc.get("source", "?"), probes, hashlib.sha256(raw).hexdigest())
    except (ValueError, KeyError, TypeError) as err:
        raise VerifyError(f"{p} is not a readable reference file ({type(err).__name__}: {err}); "
                          "re-export the model") from err
    if not probes or any(pr.vector.shape != (ref.dim,) for pr in probes):
        raise VerifyError(f"{p}: probes missing or not of {ref.dim} dims; re-export the model")
    return ref


@dataclass
class ProbeResult:
    """One probe's cosines against the reference and its token counts."""

    name: str
    kind: str
    text_cosine: float
    encoder_cosine: float
    tokens_exported: int
    tokens_served: int | None  # the text endpoint's token_count (None when it does not return one)


@dataclass
class Result:
    """The verdict: per-probe numbers, pass/fail, which part is at fault, and the one message logged everywhere."""

    model: str
    encoder: str
    precision: str
    tolerance: str
    probes: list[ProbeResult] = field(default_factory=list)
    ok: bool = False
    fault: str = ""  # "" | "encoder" | "tokenizer" | "unavailable"
    message: str = ""

    def table(self) -> str:
        """Per-probe cosines as a fixed-width table."""
        rows = [f"{'probe':<18} {'kind':<34} {'text endpoint':>13} {'encoder':>9} {'tokens':>11}"]
        for p in self.probes:
            served = "-" if p.tokens_served is None else str(p.tokens_served)
            rows.append(f"{p.name:<18} {p.kind[:34]:<34} {p.text_cosine:>13.7f} {p.encoder_cosine:>9.7f} "
                        f"{served + '/' + str(p.tokens_exported):>11}")
        return "\n".join(rows)

    def to_dict(self) -> dict:
        """JSON-ready form (markers, gateway /ready bodies, reports)."""
        return {"model": self.model, "encoder": self.encoder, "precision": self.precision, "tolerance": self.tolerance,
                "ok": self.ok, "fault": self.fault, "message": self.message,
                "probes": [vars(p) for p in self.probes]}


def _cosines(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    """Row-wise cosine (the served vectors should be unit vectors; normalised here so a norm fault shows as <1)."""
    got = np.asarray(got, dtype=np.float64)
    norms = np.linalg.norm(got, axis=1)
    norms[norms == 0] = 1.0
    cos = (ref.astype(np.float64) * got).sum(1) / norms
    return np.where(np.isfinite(cos), cos, -1.0)


def _holds(cos: np.ndarray, ref: Reference) -> bool:
    return bool(cos.min() >= ref.min_cosine and (ref.mean_cosine is None or cos.mean() >= ref.mean_cosine))


def judge(ref: Reference, text_vectors: np.ndarray, token_counts: Sequence[int] | None,
          encoder_vectors: np.ndarray, model: str | None = None, encoder: str | None = None) -> Result:
    """Compare both paths with the reference and word the verdict (pure: unit-tested without a server)."""
    model, encoder = model or ref.model, encoder or ref.encoder
    vectors = np.stack([p.vector for p in ref.probes])
    for what, got in (("text endpoint", text_vectors), ("encoder", encoder_vectors)):
        if np.shape(got) != vectors.shape:
            raise VerifyError(f"{what} of {model} answered shape {np.shape(got)} for {len(ref.probes)} probes of "
                              f"{ref.dim} dims: the served model is not the export the reference belongs to "
                              f"({ref.source}, {ref.path})")
    text_cos, enc_cos = _cosines(vectors, text_vectors), _cosines(vectors, encoder_vectors)
    counts = list(token_counts) if token_counts is not None else [None] * len(ref.probes)
    res = Result(model, encoder, ref.precision, ref.tolerance)
    res.probes = [ProbeResult(p.name, p.kind, float(t), float(e), len(p.input_ids), None if c is None else int(c))
                  for p, t, e, c in zip(ref.probes, text_cos, enc_cos, counts, strict=True)]
    head = f"model {model} (encoder {encoder}, {ref.precision}, {ref.tolerance})"
    wt, we = int(text_cos.argmin()), int(enc_cos.argmin())
    worst_text = f"worst probe {ref.probes[wt].name!r} cosine {text_cos[wt]:.6f}"
    worst_enc = f"worst probe {ref.probes[we].name!r} cosine {enc_cos[we]:.6f}"
    mismatched = [r for r in res.probes if r.tokens_served is not None and r.tokens_served != r.tokens_exported]
    enc_ok, text_ok = _holds(enc_cos, ref), _holds(text_cos, ref)
    if enc_ok and text_ok and not mismatched:
        res.ok = True
        res.message = (f"verify OK: {head}: {len(ref.probes)} probes; text endpoint {worst_text}, encoder with the "
                       f"exporter's tokens worst {enc_cos.min():.6f}")
        return res
    if not enc_ok:
        res.fault = "encoder"
        res.message = (f"verify FAILED: {head}: through the encoder with the exporter's tokens, {worst_enc} "
                       f"(mean {enc_cos.mean():.6f}): the encoder's numbers are not the reference's. Its weights, "
                       f"precision, execution provider or engine cache differ from the export that wrote "
                       f"{ref.path} ({ref.source}); text endpoint: {worst_text}")
        return res
    res.fault = "tokenizer"
    if mismatched:
        m = mismatched[0]
        counts_note = (f"; token counts differ on {len(mismatched)} of {len(ref.probes)} probes (e.g. {m.name!r}: "
                       f"{m.tokens_served} served, {m.tokens_exported} exported)")
    else:  # same counts: other ids (another vocab of the same shape), or the endpoint's padding / batching
        counts_note = ("; token counts match, so the ids differ (another vocab or normaliser) or the text "
                       "endpoint's padding / batching does")
    res.message = (f"verify FAILED: {head}: the text endpoint's TOKENIZER does not match the export: through the "
                   f"text endpoint {worst_text}, while the encoder given the exporter's tokens holds (worst "
                   f"{enc_cos.min():.6f}){counts_note}. Check that {model}/1/tokenizer/ and max_length in "
                   f"{model}/config.pbtxt come from the same export as {encoder}")
    return res


class Transport(Protocol):
    """What the check needs from a server: the text endpoint's encoder name, and the two kinds of inference."""

    def encoder_of(self, model: str) -> str | None: ...

    def embed_texts(self, model: str, texts: list[str]) -> tuple[np.ndarray, list[int] | None]: ...

    def embed_tokens(self, encoder: str, input_ids: list[int]) -> np.ndarray: ...


def run_check(transport: Transport, model: str, ref: Reference) -> Result:
    """Embed every probe both ways and judge; VerifyError when the server cannot be asked."""
    encoder = transport.encoder_of(model) or ref.encoder
    text_vectors, counts = transport.embed_texts(model, [p.text for p in ref.probes])
    enc_vectors = np.concatenate([transport.embed_tokens(encoder, p.input_ids) for p in ref.probes])
    return judge(ref, text_vectors, counts, enc_vectors, model, encoder)


class HttpJson:
    """Triton's HTTP/JSON v2 API with urllib (the server image has no client library)."""

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        self.base = (url if "://" in url else f"http://{url}").rstrip("/")
        self.timeout_s = timeout_s

    def _call(self, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode("utf-8")
        req = urllib.request.Request(self.base + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as err:
            detail = err.read().decode("utf-8", "replace")
            try:
                detail = json.loads(detail).get("error", detail)
            except ValueError:
                pass
            raise VerifyError(f"{self.base}{path} answered HTTP {err.code}: {detail}") from err
        except (urllib.error.URLError, OSError) as err:
            raise VerifyError(f"cannot reach Triton at {self.base} ({getattr(err, 'reason', err)}); is the server "
                              f"up and --url its HTTP address (port 8000 by default)?") from err
        return json.loads(raw) if raw else {}

    def ready(self) -> bool:
        """Triton's /v2/health/ready is 200."""
        try:
            self._call("/v2/health/ready")
            return True
        except VerifyError:
            return False

    def _timeout(self) -> dict:
        """Triton's per-request timeout (microseconds, allow_timeout_override): the long probes of a large model
        on a busy CPU outlast the text endpoint's default 5 s queue timeout; a verdict must not depend on load."""
        return {"timeout": int(self.timeout_s * 1e6)}

    def encoder_of(self, model: str) -> str | None:
        params = self._call(f"/v2/models/{model}/config").get("parameters", {})
        return params.get("onnx_model", {}).get("string_value") or None

    def embed_texts(self, model: str, texts: list[str]) -> tuple[np.ndarray, list[int] | None]:
        body = {"inputs": [{"name": "text", "shape": [len(texts), 1], "datatype": "BYTES", "data": texts}],
                "outputs": [{"name": "embedding"}, {"name": "token_count"}], "parameters": self._timeout()}
        out = {o["name"]: o for o in self._call(f"/v2/models/{model}/infer", body)["outputs"]}
        emb = np.asarray(out["embedding"]["data"], dtype=np.float32).reshape(out["embedding"]["shape"])
        counts = [int(x) for x in out["token_count"]["data"]] if "token_count" in out else None
        return emb, counts

    def embed_tokens(self, encoder: str, input_ids: list[int]) -> np.ndarray:
        n = len(input_ids)
        body = {"inputs": [{"name": "input_ids", "shape": [1, n], "datatype": "INT64", "data": input_ids},
                           {"name": "attention_mask", "shape": [1, n], "datatype": "INT64", "data": [1] * n}],
                "outputs": [{"name": "embedding"}], "parameters": self._timeout()}
        out = self._call(f"/v2/models/{encoder}/infer", body)["outputs"][0]
        return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def server_boot_id(port: int | None = None) -> str:
    """pid and start time of the local tritonserver ('' if none is visible): a restarted server is verified again.

    In a container there is one; where several run (a development machine), the one whose command line names
    PORT is preferred.
    """
    found: list[tuple[bool, str]] = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            if text[text.find("(") + 1:text.rfind(")")] != "tritonserver":
                continue
            args = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        named = port is not None and (f"-port={port}" in args or f"-port {port}" in args)
        found.append((named, f"{stat.parent.name}:{text[text.rfind(')') + 2:].split()[19]}"))
    found.sort(key=lambda f: not f[0])
    return found[0][1] if found else ""


def resolve_reference(transport: Transport, model: str, repository: str | Path | None,
                      reference: str | Path | None) -> Path:
    """--reference as given, else REPOSITORY/<the text endpoint's encoder>/1/reference.json (encoder from the
    server's config of MODEL, parameter onnx_model; MODEL_onnx when it has none)."""
    if reference:
        return Path(reference)
    if repository is None:
        raise VerifyError("no reference given: pass --reference PATH (NAME_onnx/1/reference.json of the export) or "
                          "--repository DIR")
    return reference_path(repository, model, transport.encoder_of(model))


def _log_change(log: Path | None, previous: str, message: str) -> None:
    """Append MESSAGE to LOG (e.g. /proc/1/fd/2, the container's log) when it differs from the last one."""
    if log is None or message == previous:
        return
    try:
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"bge-triton verify-ready: {message}\n")
    except OSError:
        pass  # no container log to write to: the probe's own stderr still carries the message


def _write(path: Path, doc: dict) -> None:
    """Replace PATH atomically (a probe may read it meanwhile)."""
    tmp = path.with_name(f".{path.name}.{time.monotonic_ns()}")
    tmp.write_text(json.dumps(doc, ensure_ascii=False))
    tmp.replace(path)


def ready_check(http: HttpJson, model: str, repository: str | Path | None, reference: str | Path | None,
                marker_dir: Path, log: Path | None = None, check: bool = True) -> tuple[int, str]:
    """Readiness: Triton ready AND this server start verified once (a marker keyed by the reference and the boot).

    A passed check is remembered in MARKER_DIR/MODEL.ok; a failed one is rerun at the next probe and its message
    kept in MODEL.failed (what `bge-triton serve status` and operators read) and logged when it changes.
    check=False (--marker-only): never embed; ready only when a check at start (--wait) left a valid marker.
    """
    if not http.ready():
        return FAILED, f"not ready: Triton at {http.base} is not ready (/v2/health/ready)"
    ok_file, failed_file = marker_dir / f"{model}.ok", marker_dir / f"{model}.failed"
    try:
        previous = json.loads(failed_file.read_text()).get("message", "")
    except (OSError, ValueError):
        previous = ""
    try:
        ref = load_reference(resolve_reference(http, model, repository, reference))
        key = f"{ref.sha256} {server_boot_id(urllib.parse.urlsplit(http.base).port)}"
        try:
            if json.loads(ok_file.read_text()).get("key") == key:
                return OK, ""
        except (OSError, ValueError):
            pass
        if not check:
            return FAILED, previous or (f"not verified yet: no passed check of this server start in {marker_dir} "
                                        f"(verify-ready.sh --wait runs it)")
        result = run_check(http, model, ref)
    except VerifyError as err:
        result = Result(model, "?", "?", "?", fault="unavailable", message=f"verify could not run: {err}")
        if not check:
            return FAILED, result.message
    marker_dir.mkdir(parents=True, exist_ok=True)
    if result.ok:
        failed_file.unlink(missing_ok=True)
        _write(ok_file, {"key": key, **result.to_dict()})
        _log_change(log, "", result.message)
        return OK, result.message
    ok_file.unlink(missing_ok=True)
    _write(failed_file, result.to_dict())
    _log_change(log, previous, result.message)
    return FAILED, result.message


def wait_and_check(http: HttpJson, model: str, repository: str | Path | None, reference: str | Path | None,
                   marker_dir: Path, log: Path | None, wait_s: float, every_s: float = 2.0) -> tuple[int, str]:
    """At start: poll until Triton is ready (at most WAIT_S), then check until a verdict that is not 'unavailable'."""
    deadline = time.monotonic() + wait_s
    while True:
        code, message = ready_check(http, model, repository, reference, marker_dir, log)
        unavailable = message.startswith(("not ready", "verify could not run"))
        if code == OK or not unavailable or time.monotonic() >= deadline:
            return code, message
        time.sleep(every_s)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="standalone.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="Triton's HTTP address (default 127.0.0.1:8000)")
    p.add_argument("--model", default="bge_large_zh", help="the text endpoint's name (default bge_large_zh)")
    p.add_argument("--repository", default="/models", help="model repository holding <encoder>/1/reference.json "
                   "(default /models, the server image's)")
    p.add_argument("--reference", default=None, help="reference.json (default: found through --repository)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request (default 60)")
    p.add_argument("--ready-marker", type=Path, default=None, metavar="DIR",
                   help="readiness mode: exit 0 only when Triton is ready and the check passed since it started")
    p.add_argument("--log", type=Path, default=None, help="readiness mode: append a changed verdict to this file "
                   "(e.g. /proc/1/fd/2, the container's log)")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS", help="readiness mode: wait up to SECONDS "
                   "for Triton to be ready, then check (an entrypoint's one check at start)")
    p.add_argument("--marker-only", action="store_true", help="readiness mode: never embed, only read the marker "
                   "a --wait run left (probes with a short timeout on a slow host)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    http = HttpJson(a.url, a.timeout)
    if a.ready_marker is not None:
        if a.marker_only:
            code, message = ready_check(http, a.model, a.repository, a.reference, a.ready_marker, check=False)
        else:
            code, message = wait_and_check(http, a.model, a.repository, a.reference, a.ready_marker, a.log, a.wait)
        if message:
            print(message, file=sys.stderr if code else sys.stdout, flush=True)
        return code
    try:
        result = run_check(http, a.model, load_reference(resolve_reference(http, a.model, a.repository, a.reference)))
    except VerifyError as err:
        print(f"verify could not run: {err}", file=sys.stderr)
        return CANNOT_CHECK
    print(result.table())
    print(result.message, file=sys.stdout if result.ok else sys.stderr)
    return OK if result.ok else FAILED


if __name__ == "__main__":
    sys.exit(main())
