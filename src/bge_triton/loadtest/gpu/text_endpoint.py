"""The shipped text endpoint on the GPU bench: the committed model.py (BLS) over a torch encoder with the ONNX encoder's
contract.

The bare GPU host cannot import bge_triton.server (it needs pytriton's own imports), so the endpoint's
file list is repeated here (a unit test keeps it equal to server.repository.TEXT_ENDPOINT_FILES) and the
committed configs are read through Triton's schema. The encoder keeps its name, inputs (input_ids /
attention_mask INT64 [-1]), output, max_batch_size, dynamic_batching block and instance count; only
its backend becomes python (bert_model.py: synthetic weights in torch, SDPA) and its output width the
model's. The text endpoint's config is taken whole but for that width.
"""
from __future__ import annotations

import json
import math
import shutil
import urllib.request
from pathlib import Path

import numpy as np
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from bge_triton.loadtest.gpu import scenarios
from bge_triton.loadtest.gpu.tritonproc import BenchError
from bge_triton.paths import CANONICAL_REPOSITORY

COMMITTED = CANONICAL_REPOSITORY
TEXT_MODEL = "bge_large_zh"
TEXT_ENDPOINT_FILES = ("model.py", "text_core.py", "text_scheduler.py", "text_stages.py")
KEY = "text_endpoint"
PROBE_TEXT = "今天天气很好，适合检索增强生成。"


def load_committed(name: str, repository: Path = COMMITTED) -> mc.ModelConfig:
    """One committed config.pbtxt, parsed with Triton's schema."""
    return text_format.Parse((repository / name / "config.pbtxt").read_text(encoding="utf-8"), mc.ModelConfig())


def _set_width(cfg: mc.ModelConfig, hidden: int) -> None:
    del cfg.output[0].dims[:]
    cfg.output[0].dims.append(hidden)


def encoder_config(committed: mc.ModelConfig, dims: scenarios.ModelDims, device: str, dtype: str,
                   seed: int) -> mc.ModelConfig:
    """The committed encoder's contract and batching, served by bert_model.py in torch."""
    cfg = mc.ModelConfig(name=committed.name, backend="python", max_batch_size=committed.max_batch_size)
    cfg.input.extend(committed.input)
    cfg.output.extend(committed.output)
    _set_width(cfg, dims.hidden)
    cfg.dynamic_batching.CopyFrom(committed.dynamic_batching)
    for group in committed.instance_group or [mc.ModelInstanceGroup(count=1)]:  # python backend: torch picks the device
        cfg.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=max(group.count, 1))
    scenarios.set_encoder_params(cfg, dims, device, dtype, seed, "as_given", 0,
                                 min(committed.max_batch_size, 64), 64)
    return cfg


def text_config(committed: mc.ModelConfig, hidden: int) -> mc.ModelConfig:
    """The committed text endpoint's config, its output width set to the synthetic model's."""
    cfg = mc.ModelConfig()
    cfg.CopyFrom(committed)
    _set_width(cfg, hidden)
    return cfg


def write_models(root: Path, dims: scenarios.ModelDims, device: str, dtype: str, seed: int,
                 tokenizer_json: Path, repository: Path = COMMITTED) -> scenarios.Scenario:
    """Add the text endpoint (committed files, copied unchanged) and its encoder to ROOT; the report's row."""
    text = load_committed(TEXT_MODEL, repository)
    enc = load_committed(text.parameters["onnx_model"].string_value, repository)
    models = ((encoder_config(enc, dims, device, dtype, seed), {"model.py": scenarios.MODEL_SOURCE}),
              (text_config(text, dims.hidden), {n: repository / TEXT_MODEL / "1" / n for n in TEXT_ENDPOINT_FILES}))
    for cfg, files in models:
        version = root / cfg.name / "1"
        version.mkdir(parents=True)
        (root / cfg.name / "config.pbtxt").write_text(scenarios.GENERATED + text_format.MessageToString(cfg))
        for dst, src in files.items():
            shutil.copyfile(src, version / dst)
    tok_dir = root / text.name / "1" / text.parameters["tokenizer_dir"].string_value
    tok_dir.mkdir()
    shutil.copyfile(tokenizer_json, tok_dir / "tokenizer.json")
    db = enc.dynamic_batching
    return scenarios.Scenario(
        KEY, f"shipped text endpoint (model.py, BLS) -> {enc.name}, committed batching, review texts",
        enc.max_batch_size, tuple(db.preferred_batch_size), db.max_queue_delay_microseconds, "reviews",
        "length_aware", model=text.name, encoder=enc.name)


def token_moments(tokenizer_json: Path, texts: list[str], max_length: int = 512) -> tuple[float, float]:
    """Mean tokens and mean tokens^2 of the texts as the endpoint tokenizes them (truncated): for the FLOPs."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.enable_truncation(max_length)
    lengths = np.array([len(e.ids) for e in tok.encode_batch(texts)], dtype=float)
    return float(lengths.mean()), float((lengths ** 2).mean())


def embedding(server_url: str, model: str, hidden: int, inputs: list[dict]) -> np.ndarray:
    """One JSON request; its embedding, checked: shape [1, hidden] and unit L2 norm (BenchError otherwise)."""
    body = {"inputs": inputs, "outputs": [{"name": "embedding"}]}  # the text endpoint also has token_count
    req = urllib.request.Request(f"{server_url}/v2/models/{model}/infer", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())["outputs"][0]
    emb = np.asarray(out["data"], dtype=np.float64).reshape(out["shape"])
    if emb.shape != (1, hidden) or abs(math.sqrt(float((emb ** 2).sum())) - 1.0) > 1e-2:
        raise BenchError(f"{model}: embedding shape {list(emb.shape)}, expected [1, {hidden}] with unit norm")
    return emb


def check(server_url: str, sc: scenarios.Scenario, tokenizer_json: Path, hidden: int) -> float:
    """A text through the shipped model.py, and its tokens straight to the encoder: the cosine of the two."""
    from tokenizers import Tokenizer

    via_text = embedding(server_url, sc.model_name, hidden, [{"name": "text", "shape": [1, 1], "datatype": "BYTES",
                                                              "data": [PROBE_TEXT]}])
    ids = Tokenizer.from_file(str(tokenizer_json)).encode(PROBE_TEXT).ids
    width = -(-len(ids) // 8) * 8  # the endpoint pads to pad_to_multiple 8
    row, mask = ids + [0] * (width - len(ids)), [1] * len(ids) + [0] * (width - len(ids))
    direct = embedding(server_url, sc.encoder_name, hidden, [
        {"name": "input_ids", "shape": [1, width], "datatype": "INT64", "data": row},
        {"name": "attention_mask", "shape": [1, width], "datatype": "INT64", "data": mask}])
    cosine = float((via_text * direct).sum())
    if cosine < 0.999:
        raise BenchError(f"{sc.model_name} and {sc.encoder_name} disagree on the same tokens: cosine {cosine:.4f}")
    return cosine
