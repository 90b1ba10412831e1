"""Bad input to `bge-triton export` gives an ExportError that names the value and the fix."""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from bge_triton.errors import ExportError
from bge_triton.export.__main__ import main
from bge_triton.export.settings import ExportSettings, build_parser, parse_settings
from bge_triton.export.source import inspect_model

MINILM = "sentence-transformers/all-MiniLM-L6-v2"


def _settings(tmp_path: Path, **kw) -> ExportSettings:
    base = {"model": MINILM, "repository": tmp_path / "repo", "name": "m", "cache_dir": tmp_path / "cache"}
    return ExportSettings(**{**base, **kw})


def test_missing_dir(tmp_path):
    with pytest.raises(ExportError, match=r"no such directory.*synthetic:bge-large-zh"):
        inspect_model(_settings(tmp_path, model=str(tmp_path / "nope")).check())


def test_offline_hub_id_not_cached_names_alternatives(tmp_path):
    with pytest.raises(ExportError, match=r"BAAI/bge-large-zh-v1.5.*not in the Hugging Face cache.*--offline.*"
                                          r"local model directory"):
        inspect_model(_settings(tmp_path, model="BAAI/bge-large-zh-v1.5", hf_cache=tmp_path / "hf",
                                offline=True).check())


def test_not_bert_like(tmp_path):
    d = tmp_path / "gpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8}))
    with pytest.raises(ExportError, match=r"'gpt2' model, not BERT-like"):
        inspect_model(_settings(tmp_path, model=str(d)).check())


def test_dir_without_config(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    with pytest.raises(ExportError, match="has no config.json"):
        inspect_model(_settings(tmp_path, model=str(d)).check())


def test_max_length_above_positions(tmp_path):
    with pytest.raises(ExportError, match=r"--max-length 1024 exceeds the model's 512 positions"):
        inspect_model(_settings(tmp_path, max_length=1024).check())


def test_repository_is_a_file(tmp_path):
    f = tmp_path / "repo.txt"
    f.write_text("x")
    with pytest.raises(ExportError, match="is a file, not a directory"):
        _settings(tmp_path, repository=f).check()


@pytest.mark.parametrize("kw,match", [({"opset": 22}, "--opset 22 is outside"), ({"precision": "int4"}, "int4"),
                                      ({"name": "bad name!"}, "not a valid Triton model name"),
                                      ({"int8_recipe": "int3"}, "--int8-recipe 'int3' is not one of")])
def test_bad_flags(tmp_path, kw, match):
    with pytest.raises(ExportError, match=match):
        _settings(tmp_path, **kw).check()


def test_unknown_synthetic_kind(tmp_path):
    with pytest.raises(ExportError, match="synthetic:bge-large-zh or synthetic:bge-small-zh"):
        inspect_model(_settings(tmp_path, model="synthetic:bge-huge").check())


def test_pooling_override_and_default(tmp_path):
    assert inspect_model(_settings(tmp_path).check()).pooling == "mean"
    src = inspect_model(_settings(tmp_path, pooling="cls").check())
    assert src.pooling == "cls" and "--pooling cls" in src.pooling_origin


def test_cli_exit_code_and_message(tmp_path, capsys):
    rc = main(["--model-id", str(tmp_path / "missing"), "--repository", str(tmp_path / "r"), "--model", "m",
               "--precision", "fp32"])
    assert rc == 1 and "no such directory" in capsys.readouterr().err


def test_every_flag_reaches_the_settings(tmp_path):
    """Each flag lands in its ExportSettings field; a flag that is parsed and then dropped fails here."""
    values = {"--model-id": "synthetic:bge-small-zh", "--repository": str(tmp_path / "r"), "--model": "m2",
              "--precision": "int8", "--max-length": "64", "--pooling": "mean", "--opset": "18",
              "--int8-recipe": "plain", "--seed": "3", "--cache-dir": str(tmp_path / "c"),
              "--hf-cache": str(tmp_path / "hf"), "--threads": "1", "--retrieval-queries": "7",
              "--retrieval-corpus": "70", "--server-onnxruntime": "1.23.2", "--revision": "v2",
              "--instance-kind": "cpu", "--task": "embed"}
    aliases = {"--name"}  # the older spelling of --model: tested below
    switches = {"--quiet", "--offline", "--skip-existing"}
    field = {"--model-id": "model", "--model": "name"}
    flags = {a.option_strings[0] for a in build_parser()._actions if a.option_strings} - {"-h", "--version"}
    assert flags == set(values) | switches | aliases, "a new flag needs a value in this test"
    s = parse_settings([x for kv in values.items() for x in kv] + sorted(switches), environ={})
    assert {f: str(getattr(s, field.get(f, f[2:].replace("-", "_")))) for f in values} == values
    assert s.quiet and s.offline and s.skip_existing
    s = parse_settings(list(values.items())[0] + ("--repository", "r"), environ={})
    assert not (s.quiet or s.offline or s.skip_existing) and s.name == "bge_large_zh"


def test_defaults_need_no_flag(tmp_path):
    s = parse_settings(["--cache-dir", str(tmp_path / "c")], environ={})
    assert (s.model, s.name, s.repository, s.precision) == ("BAAI/bge-large-zh-v1.5", "bge_large_zh",
                                                            Path("model_repository"), "fp16")


def test_older_model_flag_is_read_as_model_id(tmp_path, capsys):
    """`--model HUB_ID --name NAME` (the older spelling) still works and says how it was read."""
    s = parse_settings(["--model", "synthetic:bge-small-zh", "--name", "m3", "--cache-dir", str(tmp_path)],
                       environ={})
    assert (s.model, s.name) == ("synthetic:bge-small-zh", "m3")
    assert "reading --model synthetic:bge-small-zh as --model-id" in capsys.readouterr().err
    s = parse_settings(["--model-id", "a/b", "--model", "m4", "--cache-dir", str(tmp_path)], environ={})
    assert (s.model, s.name) == ("a/b", "m4") and capsys.readouterr().err == ""


def test_hub_id_in_both_model_flags_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_settings(["--model-id", "a/b", "--model", "c/d"], environ={})
    assert exc.value.code == 2 and "--model is the served model's name" in capsys.readouterr().err


def test_environment_and_hf_hub_offline(tmp_path):
    env = {"BGE_TRITON_MODEL_ID": "synthetic:bge-small-zh", "BGE_TRITON_PRECISION": "int8", "HF_HUB_OFFLINE": "1",
           "BGE_TRITON_CACHE_DIR": str(tmp_path / "c")}
    s = parse_settings([], environ=env)
    assert (s.model, s.precision, s.offline, s.cache_dir) == ("synthetic:bge-small-zh", "int8", True, tmp_path / "c")


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_settings(["--help"])
    assert exc.value.code == 0 and "--retrieval-queries" in capsys.readouterr().out


def test_unwritable_cache_dir_is_an_export_error_naming_the_flag(tmp_path):
    """A read-only cache dir (a pod's read-only root filesystem) gives an ExportError with the fix, no OSError."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user that writes anywhere (root without CAP restrictions)")
        with pytest.raises(ExportError, match=r"--cache-dir .*not writable.*pass --cache-dir DIR"):
            _settings(tmp_path, cache_dir=ro / "cache").check()
    finally:
        ro.chmod(0o700)


def test_cache_dir_that_is_a_file_is_an_export_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ExportError, match=r"--cache-dir .*file/cache.*not writable.*writable absolute directory"):
        _settings(tmp_path, cache_dir=blocker / "cache").check()


def test_relative_cache_dir_is_resolved_and_named_when_unwritable(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _settings(tmp_path, cache_dir=Path("rel/cache")).check().cache_dir == tmp_path / "rel" / "cache"
    (tmp_path / "blocked").write_text("x")
    with pytest.raises(ExportError, match=r"--cache-dir blocked/c \(relative: resolved against the current directory"):
        _settings(tmp_path, cache_dir=Path("blocked/c")).check()


def test_default_cache_dir_follows_xdg_then_cwd_then_tmp(tmp_path):
    from bge_triton.export.settings import default_cache_dir

    assert default_cache_dir({"XDG_CACHE_HOME": str(tmp_path / "x")}) == tmp_path / "x" / "bge-triton"
    assert default_cache_dir({}, tmp_path / ".kit") == tmp_path / ".kit" / "cache"
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if not os.access(ro, os.W_OK):
            assert default_cache_dir({}, ro / ".kit") == Path(tempfile.gettempdir()) / "bge-triton-cache"
    finally:
        ro.chmod(0o700)
    s = parse_settings(["--model-id", "m/x", "--repository", str(tmp_path / "r"), "--model", "m"],
                       environ={"XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert s.cache_dir == tmp_path / "xdg" / "bge-triton"


def test_int8_recipe_the_server_cannot_run_is_refused_with_versions(tmp_path):
    with pytest.raises(ExportError, match=r"nbits8 .*needs ONNX Runtime >= 1\.22\.0.*server runs 1\.19\.2.*24\.10.*"
                                          r"--int8-recipe qdq8"):
        _settings(tmp_path, precision="int8", int8_recipe="nbits8").check()
    assert _settings(tmp_path, precision="int8", int8_recipe="nbits8", server_onnxruntime="1.23.2").check()
    assert _settings(tmp_path, precision="int8").check().int8_recipe == "qdq8"  # auto, for 1.19.2
    local = _settings(tmp_path, precision="int8", server_onnxruntime="local").check()  # the kit's own: fast recipe
    assert local.int8_recipe == "nbits8" and local.server_onnxruntime == importlib.metadata.version("onnxruntime")
    assert _settings(tmp_path, precision="int8", server_onnxruntime="1.22.1").check().int8_recipe == "nbits8"
    assert _settings(tmp_path, precision="fp16", int8_recipe="nbits8").check()  # not int8: nothing to refuse
    with pytest.raises(ExportError, match="--server-onnxruntime 'latest' is not a version"):
        _settings(tmp_path, server_onnxruntime="latest").check()


def test_settings_import_no_other_export_step():
    """The former circle settings -> optimize -> onnx_export/source -> settings is gone: settings imports leaves."""
    code = ("import sys, bge_triton.export.settings; "
            "print(sorted(m for m in sys.modules if m.startswith('bge_triton.export.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(out) == ["bge_triton.export.recipes", "bge_triton.export.settings"]
