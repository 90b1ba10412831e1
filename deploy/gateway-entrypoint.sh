#!/bin/sh
# Entry of the compose `gateway` service: the bearer key is $GATEWAY_API_KEY when set, else the one kept in
# $SECRETS_DIR/gateway_key (made at first start, in the gateway-secrets volume), so `docker compose up` needs no
# variable and the gateway never serves without a key. Read it: docker compose exec gateway cat /secrets/gateway_key
set -eu
. "$(dirname "$0")/secret.sh"
keys="${SECRETS_DIR:-/secrets}/gateway_key"
if [ -n "${GATEWAY_API_KEY:-}" ]; then
  (umask 077 && mkdir -p "$(dirname "$keys")" && printf '%s\n' "$GATEWAY_API_KEY" >"$keys")
else
  keep_secret "$keys" >/dev/null
fi
# RERANK_MODEL set (compose's setting): serve the reranker the exporter wrote as bge_reranker too
if [ -n "${RERANK_MODEL:-}" ]; then set -- "$@" "--rerank-model=${RERANK_SERVED_NAME:-bge_reranker}"; fi
exec python -m bge_triton.gateway --api-keys-file "$keys" "$@"
