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
"$py" -c "import importlib.util as u, sys; m = [m for m in ('torch', 'transformers', 'numpy') if not u.find_spec(m)]
sys.exit(f'run.sh: missing Python packages: {\", \".join(m)} (pip install them, or set PYTHON=)' if m else 0)" || exit 2
"$py" -c "import sysconfig as c, sys; sys.exit(not c.get_config_var('Py_ENABLE_SHARED'))" \
  || echo "run.sh: warning: no shared libpython; the python backend stub may not start" >&2
if ! "$py" -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('pytriton') is None)" \
   && ! ls "$here"/wheels/nvidia_pytriton-*.whl >/dev/null 2>&1; then
  echo "run.sh: no nvidia-pytriton: $fetch" >&2; exit 2
fi
# wheels only for what the host lacks: the grpc stack for the bench code, tokenizers for the text endpoint
# (transformers usually brought one; a second copy in front could break transformers' pin)
site="$here/.work/site"
for need in "grpc:google.protobuf, grpc, tritonclient.grpc.model_config_pb2" "tokenizers:tokenizers"; do
  "$py" -c "import ${need#*:}" 2>/dev/null && continue
  if [ "${need%%:*}" = grpc ]; then
    whls=$(ls "$here"/wheels/*.whl 2>/dev/null | grep -v -e nvidia_pytriton -e /tokenizers- || true)
  else whls=$(ls "$here"/wheels/tokenizers-*.whl 2>/dev/null || true); fi
  [ -n "$whls" ] || { echo "run.sh: no ${need%%:*} wheels: $fetch" >&2; exit 2; }
  "$py" -m pip install --quiet --no-index --no-deps --target "$site" $whls
  [[ ":${PYTHONPATH:-}:" == *":$site:"* ]] || export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
done
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,utilization.gpu --format=csv
exec "$py" "$here/bench_gpu.py" "$@"
