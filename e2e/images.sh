#!/usr/bin/env bash
# Builds the product images offline, the way the in-cluster tests and `playground.sh --cluster`
# run them, and writes them as OCI archives for `control-plane.sh load-images`:
#
#   e2e/images.sh build OUTDIR [--tag TAG] [--source DIR]
#                                 OUTDIR/sharder.tar, OUTDIR/checksum-controller.tar
#
#   e2e/images.sh previous-release
#                                 the release before this checkout's, for the upgrade test: its
#                                 bundle (dist/*.yaml) and both images tagged release-COMMIT, built
#                                 once and cached; prints the directory holding them
#
# The previous release is the parent of the newest commit that changed dist/ (the bundle as
# released before it), the commit that made the first bundle while there was only one, or
# UPGRADE_FROM (any commit with dist/) when set. It needs the checkout's history, which a plain
# `git clone` has.
#
# --source DIR builds another tree of the project (the upgrade test's previous release, extracted
# with `git archive`) with its own Dockerfiles; --tag names the images NAME:TAG instead of
# NAME:latest, so both releases can sit in the node side by side.
#
# The release builds share one target directory in the cache (IMAGES_TARGET_DIR overrides it), so
# a new checkout or a previous release recompiles only the project's own crates; a lock keeps two
# builds from overwriting each other's binaries before they are copied.
#
# The images come from the product's own Dockerfile.sharder and Dockerfile.checksum-controller
# (built with Debian's podman): the binaries are release builds of this checkout, handed in as the
# build context named `build` (the Dockerfiles' compile stage, which needs the Rust image, does
# not run), and RUNTIME_BASE is a base of the distroless image's content made from this machine's
# Debian libraries (e2e/node/runtime-base.Containerfile). Tagged `docker.io/library/NAME:latest`,
# the name a pod's `image: NAME:latest` resolves to.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=e2e/control-plane.sh
CACHE_DIR=${CONTROLLER_SHARDING_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/controller-sharding}
. "$root/e2e/node.sh"

log() { echo "images: $*" >&2; }
die() { log "error: $*"; exit 1; }

IMAGES=(sharder checksum-controller)

# The files of the runtime base: every library the binaries load (as ldd resolves them, under the
# paths the dynamic loader looks in), CA certificates, and the two users.
runtime_base_context() {
  local ctx=$1
  shift
  local rootfs=$ctx/rootfs
  mkdir -p "$rootfs/etc" "$rootfs/tmp" "$rootfs/home/nonroot"
  chmod 1777 "$rootfs/tmp"
  local bin lib
  for bin in "$@"; do
    for lib in $(ldd "$bin" | awk '/=>/ {print $3} !/=>/ && $1 ~ /^\// {print $1}'); do
      mkdir -p "$rootfs$(dirname "$lib")"
      cp -L "$lib" "$rootfs$lib"
    done
  done
  if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    mkdir -p "$rootfs/etc/ssl/certs"
    cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/"
  fi
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' \
    >"$rootfs/etc/passwd"
  printf 'root:x:0:\nnonroot:x:65532:\n' >"$rootfs/etc/group"
  chown 65532:65532 "$rootfs/home/nonroot"
  cp "$root/e2e/node/runtime-base.Containerfile" "$ctx/Containerfile"
}

build() {
  local out=${1:?usage: build OUTDIR [--tag TAG] [--source DIR]}
  shift
  local tag=latest source=$root
  while [ $# -gt 0 ]; do
    case "$1" in
      --tag) tag=${2:?--tag needs a value}; shift 2 ;;
      --source) source=$(cd "${2:?--source needs a directory}" && pwd); shift 2 ;;
      *) die "unknown argument $1" ;;
    esac
  done
  mkdir -p "$out"
  out=$(cd "$out" && pwd)
  command -v podman >/dev/null || die "podman not found: install Debian's podman package"
  command -v flock >/dev/null || die "flock not found: install Debian's util-linux package"
  local started=$SECONDS
  local target=${IMAGES_TARGET_DIR:-$CACHE_DIR/targets/images}
  mkdir -p "$target"
  exec {lock}>"$target/.images.lock"
  flock "$lock"
  log "building release binaries of ${IMAGES[*]} from $source"
  (cd "$source" && CARGO_TARGET_DIR=$target cargo build --release --locked -q \
    -p kube-sharder --bin sharder -p sharding-checksum-controller --bin checksum-controller)

  local work
  work=$(mktemp -d)
  # Expanded now and removed once run: a RETURN trap is global, and would otherwise fire again
  # when the caller (previous_release) returns, where $work is not set.
  trap "rm -rf '$work'; trap - RETURN" RETURN
  local binaries=() name
  for name in "${IMAGES[@]}"; do
    mkdir -p "$work/$name/out"
    cp "$target/release/$name" "$work/$name/out/$name"
    binaries+=("$work/$name/out/$name")
  done
  flock -u "$lock"
  exec {lock}>&-
  runtime_base_context "$work/base" "${binaries[@]}"
  local base=localhost/controller-sharding/runtime-base:test
  podman_local build -q --pull=never -t "$base" "$work/base" >/dev/null ||
    die "failed to build the runtime base"

  mkdir -p "$work/empty"
  for name in "${IMAGES[@]}"; do
    local image=docker.io/library/$name:$tag
    podman_local build -q --pull=never --build-context "build=$work/$name" \
      --build-arg "RUNTIME_BASE=$base" -f "$source/Dockerfile.$name" -t "$image" "$work/empty" \
      >/dev/null || die "failed to build $image from Dockerfile.$name"
    rm -f "$out/$name.tar"
    podman_local save -q --format oci-archive -o "$out/$name.tar" "$image" ||
      die "failed to save $image"
  done
  log "built ${IMAGES[*]} ($tag) into $out in $((SECONDS - started))s"
}

previous_release() {
  command -v git >/dev/null || die "git not found: the upgrade test builds the previous release from the history"
  local commit
  if [ -n "${UPGRADE_FROM:-}" ]; then
    commit=$(git -C "$root" rev-parse --verify -q "$UPGRADE_FROM^{commit}") ||
      die "UPGRADE_FROM=$UPGRADE_FROM is no commit of this checkout"
  else
    local last
    last=$(git -C "$root" log -n1 --format=%H HEAD -- dist) ||
      die "cannot read the history of $root"
    [ -n "$last" ] || die "no commit in this checkout's history changed dist/"
    commit=$(git -C "$root" rev-parse --verify -q "$last^") ||
      die "the history ends at $last, the commit that changed dist/: fetch the full history (not a shallow clone)"
    # Until dist/ has changed a second time, the first bundle is the previous release.
    if ! git -C "$root" cat-file -e "$commit:dist/install.yaml" 2>/dev/null; then
      commit=$last
      [ "$commit" != "$(git -C "$root" rev-parse HEAD)" ] ||
        die "this checkout's HEAD made the first release bundle: there is no previous release to upgrade from"
    fi
  fi
  local releases=$CACHE_DIR/releases
  local dir=$releases/$commit
  mkdir -p "$releases"
  exec {source_lock}>"$releases/.lock"
  flock "$source_lock"
  if [ ! -f "$dir/complete" ]; then
    log "building the previous release ${commit:0:12} (once; cached in $dir)"
    # One fixed path for every previous release, so its crates' build artifacts are reused.
    local src=$CACHE_DIR/release-source
    rm -rf "$src" "$dir"
    mkdir -p "$src" "$dir"
    git -C "$root" archive "$commit" | tar -x -C "$src" || die "git archive $commit failed"
    local file
    for file in install.yaml admission-policies.yaml example.yaml; do
      [ -f "$src/dist/$file" ] || die "${commit:0:12} has no dist/$file: it is older than the release bundle"
      cp "$src/dist/$file" "$dir/$file"
    done
    local tag=release-${commit:0:12}
    build "$dir" --tag "$tag" --source "$src"
    echo "$tag" >"$dir/tag"
    echo "$commit" >"$dir/complete"
    # Keep the three newest.
    find "$releases" -mindepth 1 -maxdepth 1 -type d -printf '%T@ %p\n' | sort -rn |
      tail -n +4 | cut -d' ' -f2- | xargs -r rm -rf
  fi
  flock -u "$source_lock"
  echo "$dir"
}

case "${1:-}" in
  build) shift; build "$@" ;;
  previous-release) previous_release ;;
  *) echo "usage: $0 build OUTDIR [--tag TAG] [--source DIR] | previous-release" >&2; exit 2 ;;
esac
