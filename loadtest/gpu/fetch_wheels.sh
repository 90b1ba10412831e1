#!/usr/bin/env bash
# Download what a bare GPU host lacks for loadtest/gpu/run.sh into loadtest/gpu/wheels/ (git-ignored):
# nvidia-pytriton (~53 MB: tritonserver 2.51, python backend, stubs for Python 3.8-3.13), and for the
# kit's shared bench code (the SDK's request bytes, configs in Triton's schema) tritonclient[grpc]'s
# imports built for the GPU host's Python (GPU_PYTHON_VERSION, default 3.12): tritonclient, grpcio,
# protobuf, python-rapidjson, typing_extensions, packaging (~8 MB; with pytriton ~58 MiB of the 64 MiB
# that travels). torch/transformers/numpy come with the host. Versions: requirements.lock.
# Usage: bash loadtest/gpu/fetch_wheels.sh   (on a machine with PyPI access)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
lock="$here/../../requirements.lock"
dest="$here/wheels"
pin() { grep -i "^$1==" "$lock"; }
mkdir -p "$dest"
python3 -m pip download --no-deps --only-binary=:all: --dest "$dest" "nvidia-pytriton==0.7.0"
python3 -m pip download --no-deps --only-binary=:all: --dest "$dest" \
  --python-version "${GPU_PYTHON_VERSION:-3.12}" --platform manylinux2014_x86_64 \
  "$(pin tritonclient)" "$(pin grpcio)" "$(pin protobuf)" "$(pin python-rapidjson)" \
  "$(pin typing_extensions)" "$(pin packaging)"
du -ch "$dest"/*.whl | tail -n 1
echo "carry loadtest/gpu/wheels with the working tree (64 MiB budget), then: bash loadtest/gpu/run.sh"
