#!/usr/bin/env bash
# Build the repository's images with docker or podman from a clean tree, and push them to your registry:
#   bge-triton-server:local    deploy/Dockerfile.server            (podman names it localhost/bge-triton-server:local)
#   bge-triton-gateway:local   deploy/Dockerfile.gateway
#   bge-triton-kit:local       deploy/Dockerfile.kit, target exporter
#   bge-triton-loadtest:local  deploy/Dockerfile.kit, target loadtest (LOADTEST=0 skips it)
#
#   bash deploy/build-images.sh                                  # build (podman when installed, else docker)
#   bash deploy/build-images.sh --push registry.example.com/bge  # build, tag REGISTRY/bge-triton-*:VERSION, push,
#                                                                # and print the `images:` block of your overlay
# Flags: --push REGISTRY (tag and push; VERSION = the kit's version, PUSH_TAG overrides), --registry REGISTRY (tag
# only, no push), the tree: `git archive HEAD` (default; --tree=TREEISH another commit or tree), --worktree (the
# tracked and untracked-but-not-ignored files as on disk, so no ignored file - venv, exports, reports - enters a
# build) or --here (the directory this script lies in, as it is: an extracted archive, as the deploy tests build).
# Settings (environment): ENGINE (podman or docker), TAG (local), PUSH_TAG, TRITON_IMAGE, PYTHON_IMAGE (the bases;
# default the real images), TORCH_WHEELS (podman only: a directory holding torch-2.13.0+cpu for cp311, mounted into
# the exporter's build as /wheels; default: the first find-links directory of this host's pip that holds one; none:
# the PyTorch CPU index, the Dockerfile's default), TIMINGS (a file: one "image seconds bytes" line per image),
# BUILD_CONTEXT_DIR (/var/tmp/bge-triton-build-context, locked while a build runs).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
TAG=${TAG:-local}
TRITON_IMAGE=${TRITON_IMAGE:-nvcr.io/nvidia/tritonserver:24.10-py3}
PYTHON_IMAGE=${PYTHON_IMAGE:-docker.io/library/python:3.11-slim}
source=archive
treeish=HEAD
registry=
push=0
usage() { sed -n '2,20p' "$0"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --worktree) source=worktree ;;
    --tree=*) treeish=${1#--tree=} ;;
    --here) source=here ;;
    --push|--registry)
      [ $# -ge 2 ] && [ -n "$2" ] || { echo "build-images.sh: $1 needs a registry, e.g. $1 registry.example.com/bge" >&2; exit 2; }
      [ "$1" = --push ] && push=1
      registry=${2%/}; shift ;;
    --push=*) push=1; registry=${1#--push=}; registry=${registry%/} ;;
    --registry=*) registry=${1#--registry=}; registry=${registry%/} ;;
    -h|--help) usage; exit 0 ;;
    *) echo "build-images.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "${ENGINE:-}" ]; then
  if command -v podman >/dev/null 2>&1; then ENGINE=podman; elif command -v docker >/dev/null 2>&1; then ENGINE=docker
  else echo "build-images.sh: neither podman nor docker is installed" >&2; exit 3; fi
fi
case "$ENGINE" in podman|docker) ;; *) echo "build-images.sh: ENGINE=$ENGINE: use podman or docker" >&2; exit 2 ;; esac
log() { echo "[images $(date -u +%H:%M:%S)] $*" >&2; }
exists() { "$ENGINE" image inspect "$1" >/dev/null 2>&1; }
for base in "$TRITON_IMAGE" "$PYTHON_IMAGE"; do
  # docker pulls a missing base itself; podman is told never to (--pull=never), so its bases must be there
  if [ "$ENGINE" = podman ] && ! exists "$base"; then
    echo "build-images.sh: no local image $base: \`podman pull $base\` (or, offline, deploy/standins/build.sh)" >&2
    exit 3
  fi
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
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$ctx/pyproject.toml" | head -1)

engine_args=()
torch_args=()
if [ "$ENGINE" = podman ]; then
  engine_args=(--pull=never --layers)
  if [ -z "${TORCH_WHEELS:-}" ]; then
    for dir in $(python3 -m pip config list 2>/dev/null | sed -n "s/.*find-links='\(.*\)'/\1/p") /opt/wheels; do
      if compgen -G "$dir/torch-2.13.0+cpu-cp311-*.whl" >/dev/null; then TORCH_WHEELS=$dir; break; fi
    done
  fi
  if [ -n "${TORCH_WHEELS:-}" ]; then
    torch_args=(-v "$TORCH_WHEELS:/wheels:ro" --build-arg TORCH_FIND_LINKS=/wheels)
    log "torch from $TORCH_WHEELS"
  fi
fi

built=()
build() {  # build NAME [build args...]
  local name=$1 t0=$SECONDS
  shift
  local image="$name:$TAG"
  log "$image: building ($ENGINE)"
  local before
  before=$("$ENGINE" image inspect --format '{{.Id}}' "$image" 2>/dev/null || true)
  "$ENGINE" build "${engine_args[@]}" -t "$image" "$@" "$ctx" >&2
  local secs=$((SECONDS - t0)) size
  size=$("$ENGINE" image inspect --format '{{.Size}}' "$image")
  # the image this build superseded (untagged now): removed, unless a container still uses it
  if [ -n "$before" ] && [ "$before" != "$("$ENGINE" image inspect --format '{{.Id}}' "$image")" ]; then
    "$ENGINE" rmi "$before" >/dev/null 2>&1 || true
  fi
  log "$image: built in ${secs} s, $((size / 1000000)) MB"
  [ -z "${TIMINGS:-}" ] || echo "$image $secs $size" >>"$TIMINGS"
  built+=("$name")
}
build bge-triton-server -f "$ctx/deploy/Dockerfile.server" --build-arg "TRITON_IMAGE=$TRITON_IMAGE"
build bge-triton-gateway -f "$ctx/deploy/Dockerfile.gateway" --build-arg "PYTHON_IMAGE=$PYTHON_IMAGE"
build bge-triton-kit -f "$ctx/deploy/Dockerfile.kit" --target exporter --build-arg "PYTHON_IMAGE=$PYTHON_IMAGE" \
  "${torch_args[@]}"
if [ "${LOADTEST:-1}" != 0 ]; then
  build bge-triton-loadtest -f "$ctx/deploy/Dockerfile.kit" --target loadtest --build-arg "PYTHON_IMAGE=$PYTHON_IMAGE"
fi

[ -n "$registry" ] || exit 0
remote_tag=${PUSH_TAG:-$version}
for name in "${built[@]}"; do
  "$ENGINE" tag "$name:$TAG" "$registry/$name:$remote_tag"
  if [ "$push" = 1 ]; then
    log "$registry/$name:$remote_tag: pushing"
    "$ENGINE" push "$registry/$name:$remote_tag" >&2
  else
    log "$registry/$name:$remote_tag: tagged (not pushed: --push pushes)"
  fi
done
# the `images:` block of a Kustomize overlay over deploy/k8s (docs/k8s.md, step 2), on stdout
echo "images:"
for name in "${built[@]}"; do
  printf '  - name: %s\n    newName: %s\n    newTag: "%s"\n' "$name" "$registry/$name" "$remote_tag"
done
