# Sourced by the CI scripts that need tools built from crates (cargo-deny, cargo-cyclonedx,
# cargo-semver-checks, mdbook): each is built once at a pinned version and cached outside the
# checkout, in CONTROLLER_SHARDING_CACHE (default ~/.cache/controller-sharding, as
# e2e/control-plane.sh uses). The sourcing script defines `log` and `die`.
# CONTROLLER_SHARDING_TOOL_JOBS limits a build's parallel jobs (default: all cores).

CACHE_DIR=${CONTROLLER_SHARDING_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/controller-sharding}
TOOLS_DIR=$CACHE_DIR/tools

# tool_root NAME VERSION: the directory cargo install uses as its root for that release.
tool_root() { echo "$TOOLS_DIR/$1-$2"; }

# install_tool NAME VERSION [CARGO INSTALL FLAGS...]: build the crate NAME at exactly VERSION, with
# the dependency versions its own Cargo.lock names, unless it is already in the cache.
install_tool() {
  local name=$1 version=$2 root
  shift 2
  root=$(tool_root "$name" "$version")
  if [ -x "$root/bin/$name" ]; then
    return
  fi
  log "building $name $version (once; cached in $root)"
  local started=$SECONDS jobs=() partial
  mkdir -p "$TOOLS_DIR"
  # Built beside its final place and moved there when complete, so an interrupted build or a
  # concurrent one never leaves a half-installed tool behind.
  partial=$(mktemp -d "$root.partial.XXXXXX")
  if [ -n "${CONTROLLER_SHARDING_TOOL_JOBS:-}" ]; then
    jobs=(-j "$CONTROLLER_SHARDING_TOOL_JOBS")
  fi
  # A temporary target directory that cargo removes afterwards, whatever CARGO_TARGET_DIR says.
  # The environment overrides the crates' own release profiles (cargo-deny asks for fat LTO and
  # one codegen unit, the slowest build there is) with cargo's defaults: these tools run for
  # seconds, their build time is what CI pays.
  env -u CARGO_TARGET_DIR \
    CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 \
    cargo install --locked --quiet "${jobs[@]}" --root "$partial" "$@" "$name@$version" >&2 ||
    { rm -rf "$partial"; die "failed to build $name $version"; }
  rm -rf "$root"
  # -T: should a concurrent run have finished first, keep its copy instead of nesting this one.
  mv -T "$partial" "$root" 2>/dev/null || rm -rf "$partial"
  [ -x "$root/bin/$name" ] || die "$name $version built, but $root/bin/$name is missing"
  log "built $name $version in $((SECONDS - started))s"
}

# ensure_jq: Debian's jq where it is missing and we may install it.
ensure_jq() {
  command -v jq >/dev/null && return
  [ "$(id -u)" = 0 ] || die "jq is needed: install it (Debian: apt-get install jq)"
  log "installing jq"
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends jq >&2
}
