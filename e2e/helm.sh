#!/usr/bin/env bash
# Helm, built from its Go module at a pinned version and cached like the control plane, for the
# chart's tests and release.sh:
#
#   e2e/helm.sh provision     build and cache helm (idempotent); prints its path
#   e2e/helm.sh path          print where the cached helm is (whether built or not)
#
# HELM_VERSION overrides the pinned release. Helm's module has no replace directives, so a plain
# `go install MODULE@VERSION` builds exactly the released source. Go's module and build caches are
# shared with e2e/control-plane.sh under CONTROLLER_SHARDING_CACHE.
set -euo pipefail

HELM_VERSION=${HELM_VERSION:-3.22.0}
CACHE_DIR=${CONTROLLER_SHARDING_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/controller-sharding}
TOOL_DIR=$CACHE_DIR/tools/helm-$HELM_VERSION
GO_DIR=$CACHE_DIR/go

log() { echo "helm: $*" >&2; }
die() { log "error: $*"; exit 1; }

works() {
  local out
  out=$("$TOOL_DIR/helm" version --template '{{.Version}}' 2>/dev/null) || return 1
  [ "$out" = "v$HELM_VERSION" ]
}

provision() {
  if works; then echo "$TOOL_DIR/helm"; return; fi
  local go
  go=$(command -v go || true)
  if [ -z "$go" ] && [ -x /usr/local/go/bin/go ]; then go=/usr/local/go/bin/go; fi
  [ -n "$go" ] || die "no go: run e2e/control-plane.sh provision first (it installs one)"
  export GOMODCACHE=$GO_DIR/mod GOCACHE=$GO_DIR/build GOPATH=$GO_DIR/path
  export GOTOOLCHAIN=local GOFLAGS="-modcacherw" CGO_ENABLED=0 GOWORK=off
  local tmp=$TOOL_DIR.tmp started=$SECONDS
  rm -rf "$tmp" && mkdir -p "$tmp"
  log "building helm v$HELM_VERSION with $("$go" version | awk '{print $3}') (first time: a few minutes)"
  # The version helm reports comes from ldflags, as in its own Makefile.
  GOBIN=$tmp "$go" install -trimpath \
    -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=v$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean" \
    "helm.sh/helm/v3/cmd/helm@v$HELM_VERSION" >&2
  rm -rf "$TOOL_DIR" && mv "$tmp" "$TOOL_DIR"
  works || die "the helm built in $TOOL_DIR does not report v$HELM_VERSION"
  log "built and cached $TOOL_DIR/helm in $((SECONDS - started))s"
  echo "$TOOL_DIR/helm"
}

case "${1:-}" in
  provision) provision ;;
  path) echo "$TOOL_DIR/helm" ;;
  *) echo "usage: $0 provision | path" >&2; exit 2 ;;
esac
