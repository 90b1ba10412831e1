#!/usr/bin/env bash
# Build the repository's images with podman from a clean tree, never pulling (the bases must be local: the real
# images, or the stand-ins of deploy/standins/build.sh):
#   localhost/bge-triton-server:local    deploy/Dockerfile.server
#   localhost/bge-triton-kit:local       deploy/Dockerfile.kit, target exporter
#   localhost/bge-triton-loadtest:local  deploy/Dockerfile.kit, target loadtest (LOADTEST=0 skips it)
#   localhost/bge-triton-gateway:local   deploy/Dockerfile.gateway
# The tree: `git archive HEAD` (default; --tree=TREEISH another commit or tree), or --worktree: the tracked and
# untracked-but-not-ignored files as they are on disk (what the next commit would hold), so no ignored file (venv,
# exports, reports) can enter a build; or --here: the directory this script lies in, as it is (an extracted
# archive: what the deploy tests build, with this script from that same tree).
# Settings (environment): TAG (local), TRITON_IMAGE, PYTHON_IMAGE (the bases; default the real names, which the
# stand-ins carry), TORCH_WHEELS (a directory holding torch-2.13.0+cpu for cp311: mounted into the exporter's
# build as /wheels; default: the first find-links directory of this host's pip that holds one; none: the
# PyTorch CPU index, the Dockerfile's default), TIMINGS (a file: one "image seconds bytes" line per image),
# BUILD_CONTEXT_DIR (/var/tmp/bge-triton-build-context, locked while a build runs).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
TAG=${TAG:-local}
TRITON_IMAGE=${TRITON_IMAGE:-nvcr.io/nvidia/tritonserver:24.10-py3}
PYTHON_IMAGE=${PYTHON_IMAGE:-docker.io/library/python:3.11-slim}
source=archive
treeish=HEAD
for arg in "$@"; do
  case "$arg" in
    --worktree) source=worktree ;;
    --tree=*) treeish=${arg#--tree=} ;;
    --here) source=here ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "build-images.sh: unknown argument $arg (use --worktree, --tree=TREEISH, --here or nothing)" >&2; exit 2 ;;
  esac
done
log() { echo "[images $(date -u +%H:%M:%S)] $*" >&2; }
for base in "$TRITON_IMAGE" "$PYTHON_IMAGE"; do
  podman image exists "$base" || { echo "build-images.sh: no local image $base: run deploy/standins/build.sh" \
    "(or pull the real one)" >&2; exit 3; }
done

# One fixed context directory, one build at a time: podman's layer cache (buildah 1.28) keys a COPY on the context's
# path as well as its content, so a fresh temporary directory per run would rebuild every image every time.
ctx=${BUILD_CONTEXT_DIR:-/var/tmp/bge-triton-build-context}
exec 9>"$ctx.lock"
flock 9
rm -rf "$ctx" && mkdir -p "$ctx"
trap 'rm -rf "$ctx"' EXIT
if [ "$source" = archive ]; then
  git -C "$repo" archive --format=tar "$treeish" | tar -x -C "$ctx"
  log "context: git archive $treeish ($(git -C "$repo" rev-parse --short "$treeish"))"
elif [ "$source" = here ]; then
  tar -C "$repo" --exclude=./model_repository --exclude=./.git -c . | tar -x -C "$ctx"
  log "context: $repo as it is"
else
  (cd "$repo" && git ls-files -z --cached --others --exclude-standard \
    | tar --null --ignore-failed-read -T - -c 2>/dev/null) | tar -x -C "$ctx"
  log "context: working tree (tracked + untracked, nothing ignored)"
fi

if [ -z "${TORCH_WHEELS:-}" ]; then
  for dir in $(python3 -m pip config list 2>/dev/null | sed -n "s/.*find-links='\(.*\)'/\1/p") /opt/wheels; do
    if compgen -G "$dir/torch-2.13.0+cpu-cp311-*.whl" >/dev/null; then TORCH_WHEELS=$dir; break; fi
  done
fi
torch_args=()
if [ -n "${TORCH_WHEELS:-}" ]; then
  torch_args=(-v "$TORCH_WHEELS:/wheels:ro" --build-arg TORCH_FIND_LINKS=/wheels)
  log "torch from $TORCH_WHEELS"
fi

build() {  # build IMAGE CONTEXT [podman build args...]
  local image=$1 context=$2 t0=$SECONDS
  shift 2
  log "$image: building"
  local before
  before=$(podman image inspect --format '{{.Id}}' "$image" 2>/dev/null || true)
  podman build --pull=never --layers -t "$image" "$@" "$context" >&2
  local secs=$((SECONDS - t0)) size
  size=$(podman image inspect --format '{{.Size}}' "$image")
  # the image this build superseded (untagged now): removed, unless a container still uses it
  if [ -n "$before" ] && [ "$before" != "$(podman image inspect --format '{{.Id}}' "$image")" ]; then
    podman rmi "$before" >/dev/null 2>&1 || true
  fi
  log "$image: built in ${secs} s, $((size / 1000000)) MB"
  [ -z "${TIMINGS:-}" ] || echo "$image $secs $size" >>"$TIMINGS"
}
build "localhost/bge-triton-server:$TAG" "$ctx" -f "$ctx/deploy/Dockerfile.server" \
  --build-arg "TRITON_IMAGE=$TRITON_IMAGE"
build "localhost/bge-triton-gateway:$TAG" "$ctx" -f "$ctx/deploy/Dockerfile.gateway" \
  --build-arg "PYTHON_IMAGE=$PYTHON_IMAGE"
build "localhost/bge-triton-kit:$TAG" "$ctx" -f "$ctx/deploy/Dockerfile.kit" --target exporter \
  --build-arg "PYTHON_IMAGE=$PYTHON_IMAGE" "${torch_args[@]}"
if [ "${LOADTEST:-1}" != 0 ]; then
  build "localhost/bge-triton-loadtest:$TAG" "$ctx" -f "$ctx/deploy/Dockerfile.kit" --target loadtest \
    --build-arg "PYTHON_IMAGE=$PYTHON_IMAGE"
fi
