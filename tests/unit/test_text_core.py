"""The text endpoint's settings and its one error map (text_core.py beside model.py, no Triton)."""
from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import json_format

from bge_triton.errors import ModelConfigError
from bge_triton.repository import DEFAULT_CANONICAL, endpoint_modules, load_config, set_text_settings, text_settings

MODEL_DIR = DEFAULT_CANONICAL / "bge_large_zh" / "1"
text_core = endpoint_modules(MODEL_DIR)[0]  # the shipped module, by the name the stub imports
BadInput, Cancelled, EncoderFailed = text_core.BadInput, text_core.Cancelled, text_core.EncoderFailed
EncoderOverloaded, TextError, TextSettings = text_core.EncoderOverloaded, text_core.TextError, text_core.TextSettings
TokenizerFailed, TooLong, encoder_error = text_core.TokenizerFailed, text_core.TooLong, text_core.encoder_error
triton_code = text_core.triton_code


@pytest.mark.parametrize("error, code", [
    (BadInput("text 0 is empty"), "INVALID_ARG"),
    (TooLong("text 0 has 600 tokens"), "INVALID_ARG"),
    (EncoderOverloaded("queue full"), "UNAVAILABLE"),
    (EncoderFailed("ORT failed"), "INTERNAL"),
    (TokenizerFailed("tokenizer raised"), "INTERNAL"),
    (Cancelled("cancelled by the client"), "CANCELLED"),
])
def test_each_error_kind_has_its_triton_code(error: TextError, code: str) -> None:
    assert triton_code(error) == code


def test_every_error_kind_is_mapped() -> None:
    kinds = {cls.kind for cls in (BadInput, TooLong, EncoderOverloaded, EncoderFailed, TokenizerFailed, Cancelled)}
    assert kinds == set(text_core.TRITON_CODES)


@pytest.mark.parametrize("message", [
    "Exceeds maximum queue size",  # queue full (default_queue_policy.max_queue_size)
    "Request timeout expired",  # queue timeout with timeout_action REJECT
    "Server is stopping",  # a BLS call during shutdown (python_backend r24.10 request_executor.cc)
    "Server not ready",  # a BLS call after SIGTERM on a real 2.51 server
])
def test_triton_overload_messages_are_overload_even_with_code_internal(message: str) -> None:
    # python_backend 2.51 hands a BLS error back with code INTERNAL whatever the encoder said
    err = encoder_error("bge_large_zh_onnx", message, unavailable=False)
    assert isinstance(err, EncoderOverloaded) and triton_code(err) == "UNAVAILABLE"
    assert message in err.message and "bge_large_zh_onnx" in err.message


def test_unavailable_code_is_overload_and_other_failures_are_internal() -> None:
    assert triton_code(encoder_error("enc", "model is shutting down", unavailable=True)) == "UNAVAILABLE"
    failed = encoder_error("enc", "onnxruntime: index 30000 out of range")
    assert isinstance(failed, EncoderFailed) and triton_code(failed) == "INTERNAL"
    assert "index 30000 out of range" in failed.message


def test_settings_parse_types_and_ignore_other_parameters() -> None:
    s = TextSettings.from_params({"token_budget": "4096", "metrics_flush_s": "0.5", "encoder": " bls ",
                                  "pooling": "cls", "synthetic": "true"}, "m")
    assert s.token_budget == 4096 and isinstance(s.token_budget, int)
    assert s.metrics_flush_s == 0.5 and s.encoder == "bls"
    assert s.onnx_model == "m_onnx"  # default: <name>_onnx
    assert TextSettings.from_params({"onnx_model": "other"}, "m").onnx_model == "other"
    assert TextSettings.from_params(s.to_params()) == s  # written and read back unchanged


@pytest.mark.parametrize("params, named", [
    ({"token_budget": "lots"}, "token_budget='lots'"),
    ({"sub_batch_max": "0"}, "sub_batch_max=0"),
    ({"split_overhead_tokens": "-1"}, "split_overhead_tokens=-1"),
    ({"max_in_flight": "1.5"}, "max_in_flight='1.5'"),
])
def test_bad_setting_is_an_error_naming_it(params: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        TextSettings.from_params(params, "m")


def test_model_py_and_the_repository_read_the_same_settings() -> None:
    """model.py reads Triton's JSON model config; bge_triton.repository reads the protobuf: same settings."""
    cfg = load_config(DEFAULT_CANONICAL / "bge_large_zh")
    as_json = json_format.MessageToDict(cfg, preserving_proto_field_name=True)  # Triton's model_config JSON
    params = {k: v.get("string_value", "") for k, v in as_json["parameters"].items()}
    from_json = TextSettings.from_params(params, as_json["name"])
    assert from_json.to_params() == text_settings(cfg).to_params()
    assert from_json.onnx_model == "bge_large_zh_onnx"


def test_set_text_settings_writes_through_the_schema_and_rejects_unknown_keys() -> None:
    cfg = load_config(DEFAULT_CANONICAL / "bge_large_zh")
    set_text_settings(cfg, token_budget=1024, max_in_flight=3)
    assert cfg.parameters["token_budget"].string_value == "1024"
    assert text_settings(cfg).max_in_flight == 3
    assert set(TextSettings.keys()) <= set(cfg.parameters)  # every setting explicit in the config
    with pytest.raises(ModelConfigError, match="not text endpoint settings"):
        set_text_settings(cfg, token_budgett=1)
    with pytest.raises(ModelConfigError, match="pad_to_multiple=0"):
        set_text_settings(cfg, pad_to_multiple=0)


def test_core_imports_only_the_standard_library() -> None:
    import ast
    import sys

    tree = ast.parse((MODEL_DIR / "text_core.py").read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names <= set(sys.stdlib_module_names) | {"__future__"}, names
    assert Path(text_core.__file__).resolve() == (MODEL_DIR / "text_core.py").resolve()
