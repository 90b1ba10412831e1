"""Fetch a hub id into the Hugging Face cache: only the files the export reads, with huggingface_hub's progress bars.

HF_ENDPOINT (a mirror), HF_TOKEN (a gated or private model) and HF_HOME (where the cache is) are read by
huggingface_hub itself; --offline / HF_HUB_OFFLINE=1 take the cache only.
"""
from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from fnmatch import fnmatch
from pathlib import Path

from bge_triton.errors import ExportError

# transformers' config, the tokenizer (BERT, RoBERTa and SentencePiece forms) and the sentence-transformers files
# that give pooling, normalisation and max length
CONFIG_FILES = (
    "config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.txt", "vocab.json", "merges.txt", "sentencepiece.bpe.model", "spiece.model",
    "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
)
POOLING_CONFIG = re.compile(r"^\d+_Pooling/config\.json$")
# weight formats in order of preference: the first the repository has is the only one fetched
WEIGHTS = (
    ("model.safetensors", "model.safetensors.index.json", "model-*-of-*.safetensors"),
    ("pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model-*-of-*.bin"),
)
LOCAL_FIX = ("or download the model where there is network and pass its directory: --model-id /path/to/model "
             "(--offline on an air-gapped host)")


def export_files(model_id: str, names: Iterable[str]) -> list[str]:
    """The repository files the export needs: config, tokenizer, pooling files and one weights format."""
    names = list(names)
    wanted = [n for n in names if n in CONFIG_FILES or POOLING_CONFIG.match(n)]
    if "config.json" not in wanted:
        raise ExportError(f"--model-id {model_id}: the repository has no config.json, so it is not a transformers "
                          "model; pass a BERT-like embedding model such as BAAI/bge-large-zh-v1.5")
    for patterns in WEIGHTS:
        weights = [n for n in names if any(fnmatch(n, p) for p in patterns)]
        if weights:
            return wanted + weights
    raise ExportError(f"--model-id {model_id}: the repository has no weights the exporter reads (model.safetensors "
                      "or pytorch_model.bin); pass a PyTorch or safetensors checkpoint")


@contextmanager
def _progress(quiet: bool) -> Iterator[None]:
    """huggingface_hub's progress bars, off for --quiet (and on again afterwards)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_off = are_progress_bars_disabled()
    if quiet:
        disable_progress_bars()
    try:
        yield
    finally:
        if quiet and not was_off:
            enable_progress_bars()


def _network_error(model_id: str, endpoint: str, err: BaseException) -> ExportError:
    return ExportError(
        f"--model-id {model_id}: cannot reach the Hugging Face hub at {endpoint} ({type(err).__name__}: {err}). "
        f"To fix: check the network, or set HF_ENDPOINT to a mirror you can reach (e.g. "
        f"HF_ENDPOINT=https://hf-mirror.com), {LOCAL_FIX}")


def _hub_error(model_id: str, revision: str, endpoint: str, err: Exception) -> ExportError:
    """The hub's answer as an ExportError that says what to do."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(err, GatedRepoError):
        return ExportError(f"--model-id {model_id} is gated on {endpoint}: accept its terms on the model's page, "
                           "then set HF_TOKEN to an access token of that account")
    if isinstance(err, RepositoryNotFoundError):
        return ExportError(f"--model-id {model_id}: no such model on {endpoint} (or it is private: set HF_TOKEN). "
                           f"Check the id (e.g. BAAI/bge-large-zh-v1.5), {LOCAL_FIX}")
    if isinstance(err, RevisionNotFoundError):
        return ExportError(f"--revision {revision}: {model_id} has no such branch, tag or commit on {endpoint}; "
                           "omit --revision for main")
    status = getattr(getattr(err, "response", None), "status_code", None)
    if isinstance(err, HfHubHTTPError) and status in (401, 403):
        return ExportError(f"--model-id {model_id}: {endpoint} refused access ({status}); set HF_TOKEN to an "
                           "access token that may read this model")
    if isinstance(err, HfHubHTTPError):
        return ExportError(f"--model-id {model_id}: {endpoint} answered {status or 'an error'} ({err}); try again "
                           f"later, or set HF_ENDPOINT to a mirror, {LOCAL_FIX}")
    return _network_error(model_id, endpoint, err)


def cached(model_id: str, revision: str, cache_dir: Path | None) -> Path:
    """The cached snapshot (no network); ExportError with the fixes when it is not there."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model_id, revision=revision, local_files_only=True,
                                      cache_dir=str(cache_dir) if cache_dir else None))
    except Exception as err:  # LocalEntryNotFoundError, HFValidationError, ...: all mean "not here"
        raise ExportError(
            f"--model-id {model_id!r} is not a local directory and is not in the Hugging Face cache "
            f"({cache_dir or 'HF_HOME'}), and --offline / HF_HUB_OFFLINE=1 forbid downloading "
            f"({type(err).__name__}). To fix: run without --offline where the hub (or an HF_ENDPOINT mirror) is "
            "reachable, or pass a local model directory (--model-id /path/to/bge-large-zh-v1.5, e.g. a `git clone` "
            "of the hub repository), or --model-id synthetic:bge-large-zh for random weights with the exact "
            "architecture.") from err


def download(model_id: str, revision: str = "main", cache_dir: Path | None = None, quiet: bool = False) -> Path:
    """Download what the export needs of `model_id` into the Hugging Face cache (files already there are kept)."""
    import requests
    from huggingface_hub import HfApi, constants, snapshot_download

    endpoint = constants.ENDPOINT
    try:
        info = HfApi().model_info(model_id, revision=revision, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except (requests.ConnectionError, requests.Timeout) as err:
        try:  # no network: a snapshot already in the cache will do
            return cached(model_id, revision, cache_dir)
        except ExportError:
            raise _network_error(model_id, endpoint, err) from err
    except Exception as err:  # huggingface_hub's HTTP errors (not found, gated, 5xx) and HFValidationError
        raise _hub_error(model_id, revision, endpoint, err) from err
    files = export_files(model_id, (s.rfilename for s in info.siblings or []))
    if not quiet:
        print(f"downloading {model_id} ({revision}, {len(files)} files: {', '.join(files)}) from {endpoint} into "
              f"the Hugging Face cache", file=sys.stderr, flush=True)
    try:
        with _progress(quiet):
            return Path(snapshot_download(model_id, revision=revision, allow_patterns=files,
                                          cache_dir=str(cache_dir) if cache_dir else None))
    except Exception as err:  # a connection lost midway, or the hub's HTTP errors
        raise _hub_error(model_id, revision, endpoint, err) from err
