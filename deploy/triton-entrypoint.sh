#!/bin/sh
# Entry of the server image (deploy/Dockerfile.server): Triton's admin APIs (model repository, shared memory,
# logging, trace) always answer 403 without the header "$TRITON_ADMIN_HEADER: <key>" (gRPC metadata
# triton-grpc-protocol-<header>); inference, health, metadata, config and statistics stay open.
# The key: $TRITON_ADMIN_KEY when set, else the one kept in $SECRETS_DIR/admin_key (made at first start, kept
# in the compose volume `triton-secrets`). Read it: docker compose exec triton cat /secrets/admin_key
set -eu
. "$(dirname "$0")/secret.sh"
if [ "${1:-}" != tritonserver ]; then exec "$@"; fi  # e.g. `docker compose run --rm triton bash`
header=${TRITON_ADMIN_HEADER:-triton-admin-key}
key=${TRITON_ADMIN_KEY:-}
if [ -z "$key" ]; then
  key=$(keep_secret "${SECRETS_DIR:-/secrets}/admin_key")
fi
case "$key" in
  *[!A-Za-z0-9._~+-]*) echo "TRITON_ADMIN_KEY holds a character outside A-Z a-z 0-9 . _ ~ + -; make one with:" \
    "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'" >&2; exit 64 ;;
esac
if [ "${#key}" -lt 16 ]; then
  echo "TRITON_ADMIN_KEY is ${#key} characters; use at least 16 (python3 -c 'import secrets; print(secrets.token_urlsafe(32))')," \
    "or unset it to use the generated key in ${SECRETS_DIR:-/secrets}/admin_key" >&2
  exit 64
fi
case "$header" in
  *[!A-Za-z0-9-]*|'') echo "TRITON_ADMIN_HEADER '$header' is not a header name of letters, digits and '-'" >&2; exit 64 ;;
esac
apis=model-repository,shared-memory,logging,trace
exec "$@" "--http-restricted-api=$apis:$header=$key" "--grpc-restricted-protocol=$apis:$header=$key"
