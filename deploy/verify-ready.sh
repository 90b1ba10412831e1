#!/bin/sh
# Readiness of the Triton server image: exit 0 only when Triton is ready AND the served model reproduces the
# reference vectors its export wrote (NAME_onnx/1/reference.json; `bge-triton verify`, docs/export.md). Checked
# once per server start: a pass is remembered in $VERIFY_STATE_DIR/<model>.ok (keyed by the reference file and the
# tritonserver process), so later probes cost one /v2/health/ready; a failure is rerun at every probe, kept in
# $VERIFY_STATE_DIR/<model>.failed and written to $VERIFY_LOG when it changes, with the message `bge-triton verify`
# prints (model, precision, worst probe and its cosine; a tokenizer mismatch says TOKENIZER).
#
# Usage:
#   sh verify-ready.sh                 # healthcheck / readinessProbe: 0 ready + verified, 1 otherwise
#   sh verify-ready.sh --wait 600 &    # entrypoint, once at start: wait for Triton, check, log the verdict
#   sh verify-ready.sh --marker-only   # probe that never embeds: ready + the marker a --wait run left
# The first check embeds 13 probes (two at max length): a probe's timeout must cover it (GPU: well under a second;
# BGE-large on a CPU: seconds). Where it cannot, start `--wait` in the entrypoint and probe with `--marker-only`.
# Compose:    healthcheck: test: ["CMD", "sh", "/opt/bge-triton/verify-ready.sh"]
# Kubernetes: readinessProbe: exec: command: ["sh", "/opt/bge-triton/verify-ready.sh"]  (timeoutSeconds >= 15)
# Needs python3 + numpy (the NGC image has both) and the check script beside this file as bge_triton_verify.py
# (copied from src/bge_triton/verify/standalone.py; in a checkout the source file is found directly).
# Env (defaults): VERIFY_URL (http://127.0.0.1:8000), VERIFY_MODEL (bge_large_zh), VERIFY_REPOSITORY (/models),
#   VERIFY_REFERENCE (unset: <repository>/<the text endpoint's encoder>/1/reference.json),
#   VERIFY_STATE_DIR (/tmp/bge-triton-verify: must be writable, e.g. the pod's /tmp emptyDir),
#   VERIFY_LOG (/proc/1/fd/2, the container's log; empty: none), VERIFY_TIMEOUT_S (10: per request),
#   VERIFY_PYTHON (python3), VERIFY_SCRIPT (the check script's path).
# The reranker: when the repository holds $VERIFY_RERANK_MODEL (bge_reranker; empty: never), the embedder's pass is
# followed by a check of the served reranker's scores against its export's reference (48 requests, once per server
# start: a pass is kept in $VERIFY_STATE_DIR/<reranker>.ok); its script: bge_triton_rerank_verify.py beside this
# file (copied from src/bge_triton/verify/rerank_standalone.py) or VERIFY_RERANK_SCRIPT.
set -u
here=$(cd "$(dirname "$0")" && pwd)
script=${VERIFY_SCRIPT:-}
if [ -z "$script" ]; then
  for candidate in "$here/bge_triton_verify.py" "$here/../src/bge_triton/verify/standalone.py"; do
    if [ -f "$candidate" ]; then script=$candidate; break; fi
  done
fi
if [ -z "$script" ]; then
  echo "verify-ready: no check script: copy src/bge_triton/verify/standalone.py to $here/bge_triton_verify.py" \
    "or set VERIFY_SCRIPT" >&2
  exit 1
fi
log=${VERIFY_LOG-/proc/1/fd/2}
set -- --ready-marker "${VERIFY_STATE_DIR:-/tmp/bge-triton-verify}" "$@"
if [ -n "$log" ]; then set -- --log "$log" "$@"; fi
if [ -n "${VERIFY_REFERENCE:-}" ]; then set -- --reference "$VERIFY_REFERENCE" "$@"; fi
"${VERIFY_PYTHON:-python3}" "$script" --url "${VERIFY_URL:-http://127.0.0.1:8000}" \
  --model "${VERIFY_MODEL:-bge_large_zh}" --repository "${VERIFY_REPOSITORY:-/models}" \
  --timeout "${VERIFY_TIMEOUT_S:-10}" "$@" || exit $?
case " $* " in *" --help "*|*" -h "*) exit 0 ;; esac
rerank=${VERIFY_RERANK_MODEL-bge_reranker}
repo=${VERIFY_REPOSITORY:-/models}
if [ -z "$rerank" ] || [ ! -f "$repo/$rerank/config.pbtxt" ]; then exit 0; fi
. "$here/verify-rerank.sh"
