"""Which kind of model a directory holds (embedder or reranker), from its config's `architectures`.

A cross-encoder (BAAI/bge-reranker-*: *ForSequenceClassification with one label) is exported as a reranker; a
bare encoder (*Model, or a masked-LM checkpoint) as an embedder; anything else is refused with what to pass.
"""
from __future__ import annotations

from bge_triton.errors import ExportError

TASKS = ("embed", "rerank")
EMBED_SUFFIXES = ("Model", "ForMaskedLM", "ForPreTraining")
RERANK_SUFFIX = "ForSequenceClassification"


def model_task(cfg: dict, forced: str | None, spec: str) -> str:
    """'embed' or 'rerank' for a model config (config.json as a dict); `forced` is --task (None = from the config)."""
    archs = [str(a) for a in cfg.get("architectures") or []]
    labels = int(cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 1)
    is_classifier = any(a.endswith(RERANK_SUFFIX) for a in archs)
    if forced is not None and forced not in TASKS:
        raise ExportError(f"--task {forced!r} is not one of {TASKS}; omit it to read the kind from the model's "
                          "config.json (architectures).")
    if forced == "embed" or (forced is None and not is_classifier and
                             (not archs or any(a.endswith(EMBED_SUFFIXES) for a in archs))):
        return "embed"
    if not is_classifier:
        raise ExportError(f"--model {spec!r} is a {archs} model: the kit serves embedders (BertModel, XLMRobertaModel) "
                          f"and rerankers (*{RERANK_SUFFIX} with one label, e.g. BAAI/bge-reranker-large). Pass one "
                          "of those" + ("; --task rerank needs a sequence-classification head" if forced else "") + ".")
    if labels != 1:
        raise ExportError(f"--model {spec!r} is a {archs} classifier with {labels} labels; a reranker has one (one "
                          "relevance logit per pair). Pass a cross-encoder such as BAAI/bge-reranker-large, or "
                          "--task embed to export its encoder trunk as an embedder.")
    return "rerank"
