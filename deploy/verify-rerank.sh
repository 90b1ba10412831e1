# Sourced by verify-ready.sh once the embedder passed and the repository holds the reranker $rerank: check the
# served reranker once per server start (rerank_standalone.py: 48 requests), remember a pass, log a change.
# Reads: here, repo, rerank, log, and verify-ready.sh's arguments ("$@": --marker-only never checks).
state=${VERIFY_STATE_DIR:-/tmp/bge-triton-verify}
pid=
for d in /proc/[0-9]*; do
  if [ "$(cat "$d/comm" 2>/dev/null)" = tritonserver ]; then pid=${d#/proc/}; break; fi
done
# the pass holds for this tritonserver process and these reference scores
key="$pid $(stat -c %Y "/proc/$pid" 2>/dev/null) $(cat "$repo"/*/1/reference.json 2>/dev/null | cksum)"
if [ -f "$state/$rerank.ok" ] && [ "$(cat "$state/$rerank.ok")" = "$key" ]; then exit 0; fi
case " $* " in *" --marker-only "*) exit 1 ;; esac
rscript=${VERIFY_RERANK_SCRIPT:-}
if [ -z "$rscript" ]; then
  for candidate in "$here/bge_triton_rerank_verify.py" "$here/../src/bge_triton/verify/rerank_standalone.py"; do
    if [ -f "$candidate" ]; then rscript=$candidate; break; fi
  done
fi
if [ -z "$rscript" ]; then
  echo "verify-ready: no reranker check script: copy src/bge_triton/verify/rerank_standalone.py to" \
    "$here/bge_triton_rerank_verify.py or set VERIFY_RERANK_SCRIPT" >&2
  exit 1
fi
out=$("${VERIFY_PYTHON:-python3}" "$rscript" --url "${VERIFY_URL:-http://127.0.0.1:8000}" --model "$rerank" \
  --repository "$repo" --timeout "${VERIFY_TIMEOUT_S:-10}" 2>&1)
rc=$?
mkdir -p "$state" 2>/dev/null
if [ "$rc" -eq 0 ]; then
  printf '%s\n' "$key" >"$state/$rerank.ok"
  rm -f "$state/$rerank.failed"
  if [ -n "$log" ]; then printf 'verify-ready: %s\n' "$out" >>"$log" 2>/dev/null; fi
  exit 0
fi
if [ ! -f "$state/$rerank.failed" ] || [ "$(cat "$state/$rerank.failed")" != "$out" ]; then
  printf '%s\n' "$out" >"$state/$rerank.failed" 2>/dev/null
  if [ -n "$log" ]; then printf 'verify-ready: %s (exit %s)\n' "$out" "$rc" >>"$log" 2>/dev/null; fi
fi
printf '%s\n' "$out" >&2
exit 1
