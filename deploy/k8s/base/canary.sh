#!/bin/sh
# Canary embedding for the Triton pod's readiness and liveness probes (exec; shipped as a ConfigMap).
# Triton 2.51 keeps reporting a model ready after its python stub died, so /v2/health/ready cannot see it:
# this embeds one text through the text endpoint's HTTP/JSON API (curl + the image's python3, no client
# library) and exits 0 only when every answer is a finite unit vector of CANARY_DIM floats. HTTP 429/503
# (queue full, queue timeout) count as alive: an overloaded pod sheds load, restarting it would not help.
# Env: CANARY_URL (http://127.0.0.1:8000), CANARY_MODEL (bge_large_zh), CANARY_INPUT (text),
#      CANARY_DIM (1024), CANARY_REPEAT (4: one request per instance, twice), CANARY_TIMEOUT_S (3).
set -u
url="${CANARY_URL:-http://127.0.0.1:8000}/v2/models/${CANARY_MODEL:-bge_large_zh}/infer"
input="${CANARY_INPUT:-text}"
timeout_s="${CANARY_TIMEOUT_S:-3}"
# the request's own queue timeout (microseconds) ends before curl's, so a full queue answers 503, not a hang
queue_us=$((timeout_s * 500000))
body="{\"inputs\":[{\"name\":\"${input}\",\"shape\":[1,1],\"datatype\":\"BYTES\",\"data\":[\"canary 探针\"]}],\"parameters\":{\"timeout\":${queue_us}}}"
i=0
while [ "$i" -lt "${CANARY_REPEAT:-4}" ]; do
  i=$((i + 1))
  answer=$(curl -sS --max-time "$timeout_s" -H 'Content-Type: application/json' -d "$body" -w '\n%{http_code}' "$url" 2>&1)
  rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "canary: curl exit $rc on $url: $answer" >&2
    exit 1
  fi
  code=$(printf '%s' "$answer" | tail -n 1)
  case "$code" in
    200) ;;
    429|503) echo "canary: HTTP $code (overloaded, alive): $(printf '%s' "$answer" | head -n 1)"; exit 0 ;;
    *) echo "canary: HTTP $code from $url: $(printf '%s' "$answer" | head -n 1)" >&2; exit 1 ;;
  esac
  printf '%s' "$answer" | head -n 1 | CANARY_DIM="${CANARY_DIM:-1024}" python3 -c '
import json, math, os, sys
out = json.load(sys.stdin)["outputs"][0]["data"]
dim = int(os.environ["CANARY_DIM"])
if len(out) != dim or not all(math.isfinite(x) for x in out):
    sys.exit(f"canary: expected {dim} finite floats, got {len(out)}")
norm = math.sqrt(sum(x * x for x in out))
if abs(norm - 1.0) > 1e-2:
    sys.exit(f"canary: embedding norm {norm:.4f}, expected 1 (L2-normalised)")
' || exit 1
done
echo "canary: ${CANARY_REPEAT:-4} embeddings of ${CANARY_DIM:-1024} dims from ${CANARY_MODEL:-bge_large_zh}"
