#!/usr/bin/env bash
# Builds the product images offline, the way the in-cluster tests and `playground.sh --cluster`
# run them, and writes them as OCI archives for `control-plane.sh load-images`:
#
#   e2e/images.sh build OUTDIR    OUTDIR/sharder.tar, OUTDIR/checksum-controller.tar
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
  local out=${1:?usage: build OUTDIR}
  mkdir -p "$out"
  out=$(cd "$out" && pwd)
  command -v podman >/dev/null || die "podman not found: install Debian's podman package"
  local started=$SECONDS
  log "building release binaries of ${IMAGES[*]}"
  (cd "$root" && cargo build --release --locked -q \
    -p kube-sharder --bin sharder -p sharding-checksum-controller --bin checksum-controller)
  local target
  target=$(cd "$root" && cargo metadata --format-version 1 --no-deps |
    sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
  [ -d "$target/release" ] || die "no release directory under $target"

  local work
  work=$(mktemp -d)
  trap 'rm -rf "$work"' RETURN
  local binaries=() name
  for name in "${IMAGES[@]}"; do binaries+=("$target/release/$name"); done
  runtime_base_context "$work/base" "${binaries[@]}"
  local base=localhost/controller-sharding/runtime-base:test
  podman_local build -q --pull=never -t "$base" "$work/base" >/dev/null ||
    die "failed to build the runtime base"

  mkdir -p "$work/empty"
  for name in "${IMAGES[@]}"; do
    mkdir -p "$work/$name/out"
    cp "$target/release/$name" "$work/$name/out/$name"
    local image=docker.io/library/$name:latest
    podman_local build -q --pull=never --build-context "build=$work/$name" \
      --build-arg "RUNTIME_BASE=$base" -f "$root/Dockerfile.$name" -t "$image" "$work/empty" \
      >/dev/null || die "failed to build $image from Dockerfile.$name"
    rm -f "$out/$name.tar"
    podman_local save -q --format oci-archive -o "$out/$name.tar" "$image" ||
      die "failed to save $image"
  done
  log "built ${IMAGES[*]} into $out in $((SECONDS - started))s"
}

case "${1:-}" in
  build) shift; build "$@" ;;
  *) echo "usage: $0 build OUTDIR" >&2; exit 2 ;;
esac
