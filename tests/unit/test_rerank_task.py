"""The exporter tells an embedder from a reranker by the config's architectures, and refuses what it cannot serve."""
from __future__ import annotations

import pytest

from bge_triton.errors import ExportError
from bge_triton.export.rerank_synthetic import XLMR_SPECIALS, build_vocab
from bge_triton.export.task import model_task


@pytest.mark.parametrize("archs, forced, task", [
    (["BertModel"], None, "embed"),
    (["XLMRobertaModel"], None, "embed"),
    (["BertForMaskedLM"], None, "embed"),
    ([], None, "embed"),  # no architectures: a bare encoder as before
    (["XLMRobertaForSequenceClassification"], None, "rerank"),
    (["BertForSequenceClassification"], None, "rerank"),
    (["XLMRobertaForSequenceClassification"], "embed", "embed"),  # the trunk, on request
])
def test_task_from_architectures(archs, forced, task) -> None:
    assert model_task({"architectures": archs}, forced, "m") == task


@pytest.mark.parametrize("cfg, forced, words", [
    ({"architectures": ["LlamaForCausalLM"]}, None, "LlamaForCausalLM"),
    ({"architectures": ["BertForTokenClassification"]}, None, "rerankers"),
    ({"architectures": ["BertModel"]}, "rerank", "needs a sequence-classification head"),
    ({"architectures": ["BertForSequenceClassification"], "id2label": {"0": "a", "1": "b", "2": "c"}}, None,
     "3 labels"),
    ({"architectures": ["BertModel"]}, "classify", "--task 'classify'"),
])
def test_a_model_it_cannot_serve_is_refused_with_the_fix(cfg, forced, words) -> None:
    with pytest.raises(ExportError, match="") as err:
        model_task(cfg, forced, "m")
    assert words in str(err.value)


def test_a_cross_encoder_dir_is_not_exported_as_an_embedder(tmp_path) -> None:
    import json

    from bge_triton.export.settings import ExportSettings
    from bge_triton.export.source import inspect_model

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["XLMRobertaForSequenceClassification"],
                                                      "model_type": "xlm-roberta", "num_labels": 1}))
    s = ExportSettings(model=str(tmp_path), repository=tmp_path / "repo", name="m", cache_dir=tmp_path / "c")
    with pytest.raises(ExportError, match="is a reranker"):
        inspect_model(s)


def test_synthetic_reranker_vocab_keeps_xlmr_special_ids() -> None:
    vocab = build_vocab()
    assert vocab[:4] == list(XLMR_SPECIALS) and vocab[-1] == "<mask>" and len(vocab) == len(set(vocab))
    assert "好" in vocab


def test_a_reranker_export_names_the_command_that_regenerates_it(tmp_path) -> None:
    from bge_triton.export.run_record import command_line
    from bge_triton.export.settings import parse_settings

    argv = ["--model-id", "synthetic:bge-reranker-small", "--repository", str(tmp_path / "r"), "--model", "rr",
            "--precision", "int8", "--task", "rerank", "--seed", "3", "--cache-dir", str(tmp_path / "c")]
    s = parse_settings(argv, {})
    line = command_line(s)
    assert line.startswith("bge-triton export --model-id synthetic:bge-reranker-small ")
    assert "--task rerank" in line and "--model rr" in line
    again = parse_settings(line.split()[2:] + ["--cache-dir", str(tmp_path / "c")], {})
    assert again == s
