"""Check a served reranker against the reference scores its export wrote; python3 stdlib + numpy only.

The export of a cross-encoder writes NAME_onnx/1/reference.json (format bge-triton-rerank-reference/1): query /
document pairs, the exporter's tokens, PyTorch's logits and the tolerance (max abs difference) of the precision it
wrote. This scores the pairs twice through Triton's HTTP/JSON v2 API: through the text-pair endpoint (the served
tokenizer and pair template + encoder), and through the encoder with the exporter's tokens. Encoder off: its
weights or precision differ from the reference. Encoder on but endpoint off: the tokenizer (or max_length) differs.
Like standalone.py it imports nothing from the kit, so the server image can run this file as a readiness check.

    python3 rerank_standalone.py --url http://127.0.0.1:8000 --model bge_reranker --repository /models

Exit: 0 verified; 1 off the reference; 2 could not check (no server, no file).
"""
from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import numpy as np

RERANK_FORMAT = "bge-triton-rerank-reference/1"
OK, FAILED, CANNOT_CHECK = 0, 1, 2


class RerankVerifyError(Exception):
    """The check could not run; the message says why."""


def _call(base: str, path: str, body: dict | None, timeout_s: float) -> dict:
    data = None if body is None else json.dumps(body).encode("utf-8")
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as err:
        raise RerankVerifyError(f"{base}{path} answered HTTP {err.code}: "
                                f"{err.read().decode('utf-8', 'replace')[:300]}") from err
    except (urllib.error.URLError, OSError) as err:
        raise RerankVerifyError(f"cannot reach Triton at {base} ({getattr(err, 'reason', err)}); is the server up and "
                                "--url its HTTP address (port 8000 by default)?") from err
    return json.loads(raw) if raw else {}


def load_rerank_reference(path: str | Path) -> dict:
    """reference.json of a reranker export; RerankVerifyError names the file and the fix."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise RerankVerifyError(f"cannot read {path} ({err}): export the reranker with `bge-triton export`") from err
    if doc.get("format") != RERANK_FORMAT:
        raise RerankVerifyError(f"{path} is not a {RERANK_FORMAT} file (format {doc.get('format')!r}): re-export")
    return doc


def served_scores(base: str, model: str, encoder: str, ref: dict, timeout_s: float) -> tuple[np.ndarray, np.ndarray]:
    """(the endpoint's logits, the encoder's logits from the stored tokens) of every reference pair, in order."""
    params = {"timeout": int(timeout_s * 1e6), "truncate": True}
    pairs = ref["pairs"]
    text = np.empty(len(pairs))
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(pairs):
        groups.setdefault(p["query"], []).append(i)
    for query, idx in groups.items():
        body = {"inputs": [{"name": "query", "shape": [1, 1], "datatype": "BYTES", "data": [query]},
                           {"name": "documents", "shape": [1, len(idx)], "datatype": "BYTES",
                            "data": [pairs[i]["document"] for i in idx]}],
                "outputs": [{"name": "score"}], "parameters": params}
        out = _call(base, f"/v2/models/{model}/infer", body, timeout_s)["outputs"][0]
        text[idx] = np.asarray(out["data"], dtype=np.float64)
    enc = np.empty(len(pairs))
    for i, p in enumerate(pairs):
        n = len(p["input_ids"])
        inputs = [{"name": "input_ids", "shape": [1, n], "datatype": "INT64", "data": p["input_ids"]},
                  {"name": "attention_mask", "shape": [1, n], "datatype": "INT64", "data": [1] * n}]
        if "token_type_ids" in p:
            inputs.append({"name": "token_type_ids", "shape": [1, n], "datatype": "INT64",
                           "data": p["token_type_ids"]})
        body = {"inputs": inputs, "outputs": [{"name": "score"}], "parameters": {"timeout": params["timeout"]}}
        enc[i] = float(_call(base, f"/v2/models/{encoder}/infer", body, timeout_s)["outputs"][0]["data"][0])
    return text, enc


def judge(ref: dict, text: np.ndarray, enc: np.ndarray) -> tuple[bool, str]:
    """The verdict in words: which path is off, by how much, against which tolerance."""
    want = np.asarray([p["score"] for p in ref["pairs"]])
    tol = float(ref["tolerance"]["max_abs"])
    enc_diff, text_diff = float(np.abs(enc - want).max()), float(np.abs(text - want).max())
    what = f"{ref['model']} ({ref['source']}, {ref['precision']})"
    if enc_diff > tol:
        return False, (f"{what}: the encoder {ref['encoder']} scores the exporter's tokens {enc_diff:.3e} off PyTorch "
                       f"(tolerance {tol:.3e}): its weights or precision are not the reference's; re-export or "
                       "redeploy the model")
    if text_diff > tol:
        worst = int(np.abs(text - want).argmax())
        return False, (f"{what}: the text-pair endpoint is {text_diff:.3e} off PyTorch on pair {worst} (tolerance "
                       f"{tol:.3e}) while its encoder holds: the served tokenizer or max_length differs from the "
                       "export's; redeploy NAME/1/tokenizer with the model")
    return True, (f"{what} verified: {len(want)} pairs within {max(enc_diff, text_diff):.3e} of PyTorch "
                  f"(tolerance {tol:.3e})")


def check(url: str, model: str, reference: str | Path | None, repository: str | Path | None,
          timeout_s: float = 60.0) -> tuple[int, str]:
    """Exit code and message of one check."""
    base = (url if "://" in url else f"http://{url}").rstrip("/")
    try:
        encoder = _call(base, f"/v2/models/{model}/config", None, timeout_s).get("parameters", {}).get(
            "onnx_model", {}).get("string_value") or f"{model}_onnx"
        if reference is None:
            if repository is None:
                raise RerankVerifyError("pass --reference PATH or --repository DIR")
            reference = Path(repository) / encoder / "1" / "reference.json"
        ref = load_rerank_reference(reference)
        text, enc = served_scores(base, model, encoder, ref, timeout_s)
    except RerankVerifyError as err:
        return CANNOT_CHECK, f"verify could not run: {err}"
    ok, message = judge(ref, text, enc)
    return (OK if ok else FAILED), message


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rerank_standalone.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="Triton's HTTP address (default 127.0.0.1:8000)")
    p.add_argument("--model", default="bge_reranker", help="the text-pair endpoint (default bge_reranker)")
    p.add_argument("--repository", default="/models", help="repository holding <encoder>/1/reference.json")
    p.add_argument("--reference", default=None, help="reference.json (default: found through --repository)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request (default 60)")
    a = p.parse_args(argv)
    code, message = check(a.url, a.model, a.reference, a.repository, a.timeout)
    print(message, file=sys.stdout if code == OK else sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
