#!/usr/bin/env bash
# Build the local base image and the stand-ins of the two registry images the kit's Dockerfiles start FROM,
# with rootful podman, each only when podman does not already hold it (cached between runs):
#   localhost/debian-bookworm-min            debootstrap minbase of Debian bookworm + this machine's CA bundle
#   docker.io/library/python:3.11-slim       stand-in (Dockerfile.python)
#   nvcr.io/nvidia/tritonserver:24.10-py3    stand-in (Dockerfile.tritonserver)
# How each stand-in differs from the real image: deploy/standins/README.md. Installs nothing on the host: it
# needs podman, debootstrap and /etc/containers/containers.conf (see .ci/run). FORCE=1 rebuilds all three.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
BASE_IMAGE=${BASE_IMAGE:-localhost/debian-bookworm-min}
PYTHON_IMAGE=${PYTHON_IMAGE:-docker.io/library/python:3.11-slim}
TRITON_IMAGE=${TRITON_IMAGE:-nvcr.io/nvidia/tritonserver:24.10-py3}
SUITE=${SUITE:-bookworm}

need() { command -v "$1" >/dev/null 2>&1 || { echo "build.sh: $1 is not installed ($2)" >&2; exit 3; }; }
have() { [ "${FORCE:-0}" != 1 ] && podman image exists "$1"; }
log() { echo "[standins $(date -u +%H:%M:%S)] $*" >&2; }
need podman "apt-get install -y podman buildah catatonit"

# the Debian mirror apt uses on this machine (deb822 .sources first, then a one-line sources.list); MIRROR overrides.
# No mirror is written here: the host's apt sources name the one this machine reaches.
mirror() {
  local m=${MIRROR:-}
  [ -n "$m" ] || m=$(awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  [ -n "$m" ] || m=$(awk '$1 == "deb" && $0 !~ /security/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  [ -n "$m" ] || { echo "build.sh: no Debian mirror in /etc/apt/sources.list.d/*.sources or /etc/apt/sources.list;" \
    "set MIRROR=<the URL apt would use>" >&2; exit 3; }
  echo "$m"
}

if have "$BASE_IMAGE"; then
  log "$BASE_IMAGE: present"
else
  need debootstrap "apt-get install -y debootstrap"
  t0=$SECONDS
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  root="$work/rootfs"
  url=$(mirror)
  log "$BASE_IMAGE: debootstrap $SUITE from $url"
  debootstrap --variant=minbase --include=ca-certificates "$SUITE" "$root" "$url" >"$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
  # HTTPS from these machines is re-signed by a local CA: the images trust it too (pip in builds)
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
    chroot "$root" update-ca-certificates >/dev/null
  fi
  if compgen -G "/etc/apt/sources.list.d/*.sources" >/dev/null; then
    cp /etc/apt/sources.list.d/*.sources "$root/etc/apt/sources.list.d/"
    rm -f "$root/etc/apt/sources.list"
  fi
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | podman import --change 'CMD ["bash"]' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - "$BASE_IMAGE" >/dev/null
  rm -rf "$work"; trap - EXIT
  log "$BASE_IMAGE: built in $((SECONDS - t0)) s"
fi

build() {  # build IMAGE DOCKERFILE
  if have "$1"; then log "$1: present"; return; fi
  local t0=$SECONDS
  log "$1: building ($2)"
  podman build --pull=never --build-arg "BASE=$BASE_IMAGE" -t "$1" -f "$here/$2" "$here" >&2
  log "$1: built in $((SECONDS - t0)) s"
}
build "$PYTHON_IMAGE" Dockerfile.python
build "$TRITON_IMAGE" Dockerfile.tritonserver
