#!/usr/bin/env bash
# Download what a bare GPU host lacks for loadtest/gpu/run.sh into loadtest/gpu/wheels/ (git-ignored):
# nvidia-pytriton (tritonserver 2.51, python backend; 55 MB as published, slimmed below to the stub of
# the GPU host's Python: ~40 MB), and for the kit's shared bench code (the SDK's request bytes, configs
# in Triton's schema) tritonclient[grpc]'s imports built for that Python (GPU_PYTHON_VERSION, default
# 3.12): tritonclient, grpcio, protobuf, python-rapidjson, typing_extensions, packaging, plus tokenizers
# for the text endpoint (run.sh installs it only where transformers did not bring one). Then the kit's
# Python (KIT_PYTHON, default .venv/bin/python) writes the synthetic tokenizer.json and a review sample
# (loadtest/gpu/assets.py) and checks the folder stays under the 64 MiB that travels.
# torch/transformers/numpy come with the host. Versions: requirements.lock.
# Usage: bash src/bge_triton/loadtest/gpu/fetch_wheels.sh   (on a machine with PyPI access and the kit installed)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../../../.." && pwd)"
lock="$root/requirements.lock"
dest="$here/wheels"
pyver="${GPU_PYTHON_VERSION:-3.12}"
pin() { grep -i "^$1==" "$lock"; }
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
