# Sourced by the entry scripts of docker-compose.yml (tests/unit/test_reliability_security.py runs them with sh).
# keep_secret FILE: print the secret kept in FILE; at first use, write a random 40-character one (mode 0600).
keep_secret() {
  if [ ! -s "$1" ]; then
    mkdir -p "$(dirname "$1")"
    (umask 077 && LC_ALL=C tr -dc 'A-Za-z0-9' </dev/urandom | head -c 40 >"$1.tmp" && mv "$1.tmp" "$1")
  fi
  cat "$1"
}
