#!/usr/bin/env bash
# GPU bench on a bare GPU host: real tritonserver from the nvidia-pytriton wheel + synthetic
# BGE-Large-zh (24 layers, hidden 1024) in torch fp16: five batching scenarios and the shipped text
# endpoint (model_repository/bge_large_zh/1, BLS to an encoder of the committed contract), reports/gpu/.
# Needs: NVIDIA GPU + driver, python3 (3.8-3.13, built with a shared libpython) with torch (CUDA),
# transformers, numpy; and loadtest/gpu/wheels/ from fetch_wheels.sh (nvidia-pytriton, unless it is
# installed; tritonclient and its grpc imports, and tokenizers, unless importable: installed into
# loadtest/gpu/.work/site; the synthetic tokenizer.json and a review sample for the text endpoint).
# No network, no Docker.
# Usage: bash src/bge_triton/loadtest/gpu/run.sh [bench_gpu.py flags...]   e.g. --device cpu for a dry run
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../../../.." && pwd)"
py="${PYTHON:-python3}"
cd "$root"

"$py" - <<'PY'
import importlib.util, sys, sysconfig
missing = [m for m in ("torch", "transformers", "numpy") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"run.sh: missing Python packages: {', '.join(missing)} (pip install them, or set PYTHON=)")
if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
    print("run.sh: warning: this Python has no shared libpython; the python backend stub may not start",
          file=sys.stderr)
PY
if ! "$py" -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('pytriton') is None)" \
   && ! ls "$here"/wheels/nvidia_pytriton-*.whl >/dev/null 2>&1; then
  echo "run.sh: no nvidia-pytriton: run 'bash src/bge_triton/loadtest/gpu/fetch_wheels.sh' where PyPI is reachable" >&2
  exit 2
fi
# wheels only for what the host lacks: the grpc stack for the bench code, tokenizers for the text
# endpoint (transformers usually brought one; a second copy in front could break transformers' pin)
site="$here/.work/site"
groups=()
"$py" -c "import google.protobuf, grpc, tritonclient.grpc.model_config_pb2" 2>/dev/null || groups+=(grpc)
"$py" -c "import tokenizers" 2>/dev/null || groups+=(tokenizers)
for group in ${groups[@]+"${groups[@]}"}; do
  if [ "$group" = tokenizers ]; then
    whls=$(ls "$here"/wheels/tokenizers-*.whl 2>/dev/null || true)
  else
    whls=$(ls "$here"/wheels/*.whl 2>/dev/null | grep -v -e nvidia_pytriton -e /tokenizers- || true)
  fi
  if [ -z "$whls" ]; then
    echo "run.sh: no $group wheels: run 'bash src/bge_triton/loadtest/gpu/fetch_wheels.sh' where PyPI is reachable" >&2
    exit 2
  fi
  "$py" -m pip install --quiet --no-index --no-deps --target "$site" $whls
done
if [ ${#groups[@]} -gt 0 ]; then
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,utilization.gpu --format=csv
fi
exec "$py" "$here/bench_gpu.py" "$@"
