#!/usr/bin/env bash
# GPU bench on a bare GPU host (docs/gpu.md): real tritonserver from the nvidia-pytriton wheel, synthetic
# BGE-Large-zh in torch fp16, five batching scenarios and the shipped text endpoint -> reports/gpu/.
# Needs: NVIDIA GPU + driver, python3 (3.8-3.13, shared libpython) with torch (CUDA), transformers, numpy, and
# loadtest/gpu/wheels/ from fetch_wheels.sh (what the host lacks is installed into loadtest/gpu/.work/site).
# No network, no Docker. Usage: bash src/bge_triton/loadtest/gpu/run.sh [bench_gpu.py flags, e.g. --device cpu]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${PYTHON:-python3}"
cd "$here/../../../.."
fetch="run 'bash src/bge_triton/loadtest/gpu/fetch_wheels.sh' where PyPI is reachable"
"$py" - <<'PY'
import importlib.util, sys, sysconfig
if missing := [m for m in ("torch", "transformers", "numpy") if importlib.util.find_spec(m) is None]:
    sys.exit(f"run.sh: missing Python packages: {', '.join(missing)} (pip install them, or set PYTHON=)")
if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
    print("run.sh: warning: no shared libpython; the python backend stub may not start", file=sys.stderr)
PY
if ! "$py" -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('pytriton') is None)" \
   && ! ls "$here"/wheels/nvidia_pytriton-*.whl >/dev/null 2>&1; then
  echo "run.sh: no nvidia-pytriton: $fetch" >&2; exit 2
fi
# wheels only for what the host lacks: the grpc stack for the bench code, tokenizers for the text endpoint
# (transformers usually brought one; a second copy in front could break transformers' pin)
site="$here/.work/site" installed=""
if ! "$py" -c "import google.protobuf, grpc, tritonclient.grpc.model_config_pb2" 2>/dev/null; then
  whls=$(ls "$here"/wheels/*.whl 2>/dev/null | grep -v -e nvidia_pytriton -e /tokenizers- || true)
  [ -n "$whls" ] || { echo "run.sh: no grpc wheels: $fetch" >&2; exit 2; }
  "$py" -m pip install --quiet --no-index --no-deps --target "$site" $whls && installed=1
fi
if ! "$py" -c "import tokenizers" 2>/dev/null; then
  whls=$(ls "$here"/wheels/tokenizers-*.whl 2>/dev/null || true)
  [ -n "$whls" ] || { echo "run.sh: no tokenizers wheels: $fetch" >&2; exit 2; }
  "$py" -m pip install --quiet --no-index --no-deps --target "$site" $whls && installed=1
fi
[ -n "$installed" ] && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,utilization.gpu --format=csv
exec "$py" "$here/bench_gpu.py" "$@"
