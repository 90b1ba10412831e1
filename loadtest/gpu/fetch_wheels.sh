#!/usr/bin/env bash
# Download what a bare GPU host lacks for loadtest/gpu/run.sh into loadtest/gpu/wheels/ (git-ignored).
# Only nvidia-pytriton (~55 MB: tritonserver 2.51, python backend, stubs for Python 3.8-3.13).
# The bench's client is stdlib HTTP, so no tritonclient; torch/transformers/numpy come with the host.
# Usage: bash loadtest/gpu/fetch_wheels.sh   (on a machine with PyPI access)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dest="$here/wheels"
mkdir -p "$dest"
python3 -m pip download --no-deps --only-binary=:all: --dest "$dest" "nvidia-pytriton==0.7.0"
du -ch "$dest"/*.whl | tail -n 1
echo "carry loadtest/gpu/wheels with the working tree (64 MiB budget), then: bash loadtest/gpu/run.sh"
