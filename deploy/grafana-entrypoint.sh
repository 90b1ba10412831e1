#!/bin/sh
# Entry of Grafana in the monitoring profile: the admin password is $GRAFANA_ADMIN_PASSWORD when set, else the
# one kept in $SECRETS_DIR/admin_password (made at first start, in the grafana-data volume). Grafana applies it
# when it creates the admin user (first start). Read it: docker compose exec grafana cat /var/lib/grafana/admin_password
set -eu
. "$(dirname "$0")/secret.sh"
if [ -z "${GF_SECURITY_ADMIN_PASSWORD:-}" ]; then
  GF_SECURITY_ADMIN_PASSWORD=$(keep_secret "${SECRETS_DIR:-/var/lib/grafana}/admin_password")
  export GF_SECURITY_ADMIN_PASSWORD
fi
exec "$@"
