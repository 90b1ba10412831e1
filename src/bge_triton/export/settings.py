"""The exporter's one settings object, built once from command-line flags and passed down to every step."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from bge_triton import flags
from bge_triton.errors import ExportError
from bge_triton.paths import STATE_DIR

from .recipes import AUTO, DEFAULT_RECIPE, LOCAL, RECIPES, SERVER_IMAGE_ORT, pick_recipe, version_tuple

PRECISIONS = ("fp32", "fp16", "int8")
POOLINGS = ("cls", "mean")
MIN_OPSET = 14  # optimum's BERT export needs 14 (scaled_dot_product / Trilu)
MAX_OPSET = 21  # Triton 24.10 ships ONNX Runtime 1.19, which reads opset <= 21
DEFAULT_OPSET = 17
SYNTHETIC_PREFIX = "synthetic:"
REAL_QUERIES, REAL_CORPUS = 100, 1000  # the int8 top-k neighbour check on real weights
CACHE_FIX = ("pass --cache-dir DIR with a writable absolute directory (on a read-only root filesystem: a volume "
             "such as an emptyDir, or /tmp/bge-triton-cache)")


def default_cache_dir(environ: Mapping[str, str], cwd_state: Path = STATE_DIR) -> Path:
    """$XDG_CACHE_HOME/bge-triton when set; else ./.kit/cache when the current directory is writable; else
    <tmp>/bge-triton-cache (a read-only root filesystem, e.g. a Kubernetes pod, still has a writable /tmp)."""
    if environ.get("XDG_CACHE_HOME"):
        return Path(environ["XDG_CACHE_HOME"]) / "bge-triton"
    here = cwd_state.parent
    if os.access(cwd_state if cwd_state.exists() else here, os.W_OK):
        return cwd_state / "cache"
    return Path(tempfile.gettempdir()) / "bge-triton-cache"


def usable_cache_dir(path: Path) -> Path:
    """PATH made absolute and created; ExportError naming --cache-dir when it cannot be written."""
    full = path.expanduser().absolute()
    try:
        full.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=full, prefix=".write-test-"):
            pass
    except OSError as err:
        relative = f" (relative: resolved against the current directory {Path.cwd()})" if not path.is_absolute() else ""
        raise ExportError(f"--cache-dir {path}{relative} is not writable: {err.strerror or err}. To fix: "
                          f"{CACHE_FIX}.") from err
    return full


@dataclass(frozen=True)
class Thresholds:
    """Fidelity bars an export must meet against the PyTorch reference (real weights only, see validate.py)."""

    min_cosine_float: float = 0.999  # fp32 and fp16: worst text
    min_cosine_int8: float = 0.98
    mean_cosine_int8: float = 0.99
    topk_agreement_int8: float = 0.95  # top-k neighbours of the queries agree with fp32
    topk: int = 10
    # batch of N (padded) vs N singles through the same graph, max abs difference of the unit vectors
    batch_max_abs: dict = field(default_factory=lambda: {"fp32": 1e-4, "fp16": 5e-3, "int8": 1e-2})


@dataclass(frozen=True)
class ExportSettings:
    """Everything one `bge-triton export` run needs; nothing else reads flags or the environment."""

    model: str
    repository: Path
    name: str
    precision: str = "fp16"
    max_length: int | None = None  # None: the model's own (sentence-transformers max_seq_length, else positions)
    pooling: str | None = None  # None: from 1_Pooling/config.json, CLS when absent
    opset: int = DEFAULT_OPSET
    int8_recipe: str = AUTO  # export.recipes.RECIPES, or auto: the fastest the server's ONNX Runtime runs
    server_onnxruntime: str = SERVER_IMAGE_ORT  # the ONNX Runtime of the server that will load the graph (or local)
    seed: int = 0  # synthetic weights and the validation sample are drawn with it
    cache_dir: Path = STATE_DIR / "cache"  # synthetic model dirs and intermediate ONNX files
    hf_cache: Path | None = None  # a Hugging Face hub cache dir to look in (default: transformers' own)
    threads: int = 0  # ONNX Runtime intra-op threads for validation; 0 = ORT default
    retrieval_queries: int | None = None  # None: 100 (real weights) / not run (synthetic, see neighbour_check)
    retrieval_corpus: int | None = None  # None: 1000 (real weights) / not run (synthetic)
    retrieval_max_length: int = 128  # truncation for the neighbour check only: keeps it to a minute on CPU
    thresholds: Thresholds = field(default_factory=Thresholds)
    quiet: bool = False  # no progress bars (tests)
    offline: bool = False  # a hub id comes from the Hugging Face cache only (--offline, HF_HUB_OFFLINE=1)
    revision: str = "main"  # the hub revision a hub id is downloaded at
    skip_existing: bool = False  # nothing to do when the repository holds a validated export of this model
    instance_kind: str | None = None  # gpu | cpu: the device the written configs are put on
    task: str | None = None  # embed | rerank; None = from the model's config.json architectures (export.task)

    @property
    def synthetic(self) -> bool:
        """True when the model is generated here with random weights (every output must say so)."""
        return self.model.startswith(SYNTHETIC_PREFIX)

    def neighbour_check(self, synthetic: bool) -> tuple[int, int] | None:
        """(queries, corpus) of the int8 top-k check, or None where it is not run.

        Real weights: 100 queries over 1000 texts, enforced (the agreement's standard error is reported with it).
        Synthetic weights: not run unless --retrieval-queries or --retrieval-corpus is given, and then reported,
        not enforced: two graphs over 100+ texts cost the demo's export minutes and buy no verdict.
        """
        if synthetic and self.retrieval_queries is None and self.retrieval_corpus is None:
            return None
        q = REAL_QUERIES if self.retrieval_queries is None else self.retrieval_queries
        return q, REAL_CORPUS if self.retrieval_corpus is None else self.retrieval_corpus

    def check(self) -> ExportSettings:
        """Reject bad values early, each with the value and the fix."""
        if self.precision not in PRECISIONS:
            raise ExportError(f"--precision {self.precision!r} is not one of {PRECISIONS}; pick fp16 (GPU) or int8 "
                              "(CPU).")
        server_ort = self.server_onnxruntime
        if server_ort == LOCAL:
            from importlib.metadata import PackageNotFoundError, version

            try:
                server_ort = version("onnxruntime")
            except PackageNotFoundError as err:
                raise ExportError("--server-onnxruntime local: onnxruntime is not installed here; pip install "
                                  "'bge-triton-kit[export]'") from err
        if not version_tuple(server_ort) or version_tuple(server_ort)[0] < 1:
            raise ExportError(f"--server-onnxruntime {server_ort!r} is not a version such as {SERVER_IMAGE_ORT} "
                              f"(or {LOCAL}: this kit's onnxruntime).")
        name = pick_recipe(server_ort) if self.int8_recipe == AUTO else self.int8_recipe
        if name not in RECIPES:
            raise ExportError(f"--int8-recipe {self.int8_recipe!r} is not one of {[AUTO, *sorted(RECIPES)]}; omit it "
                              f"for {AUTO}.")
        recipe = RECIPES[name]
        if self.precision == "int8" and not recipe.runs_on(server_ort):
            runs = sorted(n for n, r in RECIPES.items() if r.runs_on(server_ort))
            raise ExportError(
                f"--int8-recipe {recipe.name} writes a graph that needs ONNX Runtime >= {recipe.min_ort}, but the "
                f"server runs {server_ort} (--server-onnxruntime; {SERVER_IMAGE_ORT} is Triton 24.10's, "
                f"the default image). Use --int8-recipe {DEFAULT_RECIPE} (runs there; recipes that do: {runs}), or "
                f"--server-onnxruntime with the version of a newer image (>= {recipe.min_ort}), or {LOCAL} for the "
                f"local server (this kit's onnxruntime).")
        if self.instance_kind is not None and self.instance_kind not in INSTANCE_KINDS:
            raise ExportError(f"--instance-kind {self.instance_kind!r} is not one of {INSTANCE_KINDS}.")
        if self.pooling is not None and self.pooling not in POOLINGS:
            raise ExportError(f"--pooling {self.pooling!r} is not one of {POOLINGS}; omit it to use the model's own.")
        if not MIN_OPSET <= self.opset <= MAX_OPSET:
            raise ExportError(
                f"--opset {self.opset} is outside {MIN_OPSET}..{MAX_OPSET}; Triton 24.10 (ONNX Runtime 1.19) reads "
                f"opset <= {MAX_OPSET}. Use --opset {DEFAULT_OPSET}."
            )
        if self.max_length is not None and self.max_length < 8:
            raise ExportError(f"--max-length {self.max_length} is too small; use at least 8 (BGE: 512).")
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ExportError(f"--model {self.name!r} is not a valid Triton model name; use letters, digits and _ "
                              "(e.g. bge_large_zh).")
        if self.repository.exists() and not self.repository.is_dir():
            raise ExportError(f"--repository {self.repository} is a file, not a directory; pass a model repository "
                              "folder.")
        q, c = self.neighbour_check(synthetic=False) or (REAL_QUERIES, REAL_CORPUS)
        if q < 1 or c < self.thresholds.topk:
            raise ExportError(
                f"--retrieval-queries {q} / --retrieval-corpus {c} too small; "
                f"need >= 1 query and >= {self.thresholds.topk} texts."
            )
        return replace(self, cache_dir=usable_cache_dir(Path(self.cache_dir)), int8_recipe=name,
                       server_onnxruntime=server_ort)


DEFAULT_MODEL_ID = "BAAI/bge-large-zh-v1.5"
DEFAULT_REPOSITORY = Path("model_repository")
INSTANCE_KINDS = ("gpu", "cpu")
DESCRIPTION = """\
Export a BERT-like embedding model (BGE-Large-zh) to a validated ONNX encoder, with pooling and L2 normalisation
in the graph, and write it into a Triton model repository as NAME_onnx (encoder) + NAME (text endpoint).

A hub id is downloaded into the Hugging Face cache (only the weights, config, tokenizer and pooling files the
export reads); HF_ENDPOINT selects a mirror, HF_TOKEN a gated or private model; --offline (or HF_HUB_OFFLINE=1)
uses only the cache or a local directory.

  bge-triton export --model-id BAAI/bge-large-zh-v1.5 --precision fp16          # GPU
  bge-triton export --model-id /data/bge-large-zh-v1.5 --precision int8 --offline
  bge-triton export --model-id synthetic:bge-large-zh --precision fp32          # random weights, no download"""


def _is_served_name(text: str) -> bool:
    """A Triton model name (letters, digits, _ and -), as opposed to a hub id, a path or synthetic:..."""
    return bool(text) and text.replace("_", "").replace("-", "").isalnum()


def build_parser() -> argparse.ArgumentParser:
    """The `bge-triton export` command line."""
    p = flags.parser("bge-triton export", DESCRIPTION)
    p.add_argument("--model-id", default=None, metavar="ID", help=(
        "what to export: a hub id (downloaded into the Hugging Face cache), a local model directory, or "
        f"synthetic:bge-large-zh / synthetic:bge-small-zh (random weights, labelled SYNTHETIC) "
        f"(default: {DEFAULT_MODEL_ID})"))
    flags.add_model(p, None, help=(
        "the served model's name: writes NAME_onnx (encoder) and NAME (text endpoint). A hub id, path or "
        f"synthetic:... given here (the older spelling) is read as --model-id (default: {flags.DEFAULT_MODEL})"))
    p.add_argument("--name", default=None, metavar="NAME", help="the older spelling of --model (the served name) "
                   "(default: --model's)")
    p.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY, metavar="DIR",
                   help="the Triton model repository to write into")
    flags.add_precision(p)
    p.add_argument("--revision", default="main", help="the hub revision (branch, tag or commit) to download")
    p.add_argument("--offline", action="store_true", help="never download: take a hub id from the Hugging Face "
                   "cache only (also HF_HUB_OFFLINE=1), for air-gapped hosts")
    p.add_argument("--skip-existing", action="store_true", help="do nothing when --repository already holds a "
                   "validated export of this --model-id at this --precision (for a deployment's start-up)")
    p.add_argument("--instance-kind", choices=INSTANCE_KINDS, default=None, help="then put the repository's "
                   "models on this device: cpu rewrites every KIND_GPU instance group to KIND_CPU (a host without "
                   "a GPU), gpu puts the ONNX encoder back on KIND_GPU (default: as written, the encoder on the GPU)")
    p.add_argument("--max-length", type=int, default=None,
                   help="max tokens per text (default: the model's own, BGE 512)")
    p.add_argument("--pooling", choices=POOLINGS, default=None, help="override the model's pooling (default: its "
                   "1_Pooling/config.json, CLS when absent)")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset, {MIN_OPSET}..{MAX_OPSET}")
    p.add_argument("--int8-recipe", default=AUTO, help=f"INT8 quantisation recipe, one of {sorted(RECIPES)}. {AUTO}: "
                   f"nbits8 (int8 compute, fast on a CPU) where the server's ONNX Runtime runs it (>= 1.22), else "
                   f"{DEFAULT_RECIPE} (per-channel int8 weights, float compute: runs on 1.19.2, no CPU speed-up)")
    p.add_argument("--server-onnxruntime", default=SERVER_IMAGE_ORT, metavar="VERSION",
                   help=f"the ONNX Runtime of the server that will load the graph ({SERVER_IMAGE_ORT}: Triton 24.10's; "
                   f"{LOCAL}: this kit's, for the local CPU server); a recipe it cannot run is refused")
    p.add_argument("--seed", type=int, default=0, help="seed of synthetic weights and of the validation sample")
    p.add_argument("--cache-dir", type=Path, default=None, metavar="DIR", help="where synthetic models and "
                   "intermediate files go (default: $XDG_CACHE_HOME/bge-triton, else ./.kit/cache when writable, "
                   "else <tmp>/bge-triton-cache)")
    p.add_argument("--hf-cache", type=Path, default=None, metavar="DIR", help="the Hugging Face hub cache to "
                   "download into and read from (default: huggingface_hub's, $HF_HOME/hub or "
                   "~/.cache/huggingface/hub)")
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads in validation (0: its own "
                   "choice)")
    p.add_argument("--retrieval-queries", type=int, default=None, help="queries of the int8 top-10 neighbour check "
                   f"(default: {REAL_QUERIES}, enforced; synthetic models: not run unless given, then reported only)")
    p.add_argument("--retrieval-corpus", type=int, default=None, help="texts searched by the neighbour check "
                   f"(default: {REAL_CORPUS}; synthetic models: not run unless given)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--task", choices=("embed", "rerank"), default=None, help="what to export: an embedder or a "
                   "reranker (default: read from the model's config.json; *ForSequenceClassification = rerank)")
    return p


def _model_id(p: argparse.ArgumentParser, a: argparse.Namespace) -> tuple[str, str, str | None]:
    """(model id, served name, a note) from --model-id and --model; an older `--model HUB_ID|DIR|synthetic:...`
    (anything that cannot be a served name) is read as --model-id, with a note saying so."""
    model_id, name, note = a.model_id, a.model, None
    if name is not None and not _is_served_name(name):
        if model_id is not None:
            p.error(f"--model {name!r} with --model-id {model_id!r}: --model is the served model's name (e.g. "
                    f"{flags.DEFAULT_MODEL}); give the hub id or directory in --model-id only")
        note = f"reading --model {name} as --model-id {name} (--model is the served name; see --help)"
        model_id, name = name, None
    if a.name is not None:
        if name is not None and name != a.name:
            p.error(f"--name {a.name} and --model {name} name the served model twice; give --model only")
        name = a.name
    return model_id or DEFAULT_MODEL_ID, name or flags.DEFAULT_MODEL, note


def parse_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> ExportSettings:
    """Build and check the settings from flags, BGE_TRITON_* variables, HF_HUB_OFFLINE and $XDG_CACHE_HOME."""
    env = os.environ if environ is None else environ
    p = build_parser()
    a = flags.parse(p, argv, env)
    model_id, name, note = _model_id(p, a)
    if note:
        print(f"note: {note}", file=sys.stderr)
    cache_dir = a.cache_dir if a.cache_dir is not None else default_cache_dir(env)
    offline = a.offline or env.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    return ExportSettings(
        model=model_id, repository=a.repository, name=name, precision=a.precision, max_length=a.max_length,
        pooling=a.pooling, opset=a.opset, int8_recipe=a.int8_recipe,
        server_onnxruntime=a.server_onnxruntime, seed=a.seed, cache_dir=cache_dir, hf_cache=a.hf_cache,
        threads=a.threads, retrieval_queries=a.retrieval_queries, retrieval_corpus=a.retrieval_corpus,
        quiet=a.quiet, offline=offline, revision=a.revision, skip_existing=a.skip_existing,
        instance_kind=a.instance_kind, task=a.task,
    ).check()
