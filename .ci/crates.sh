#!/usr/bin/env bash
# Checks that the crates meant for the registry can be published and stay usable, run by .ci/run
# and usable by hand from the workspace root (docs/crates.md explains the policy behind them):
#
#   .ci/crates.sh docs      cargo doc of each published crate with rustdoc warnings denied
#                           (broken intra-doc links, bad doc syntax; missing docs are denied by
#                           the library crates themselves)
#   .ci/crates.sh msrv      cargo check of each published crate with the toolchain of its
#                           declared rust-version (installed with rustup when missing)
#   .ci/crates.sh package   cargo package of the published crates together (each one's tarball is
#                           unpacked and built against its siblings' tarballs, so a path
#                           dependency without a version or a file left out of a package fails),
#                           then cargo publish --dry-run of the same set
#   .ci/crates.sh api [REV] cargo semver-checks of each published library against its baseline:
#                           REV (a git revision) if given, else the newest version of the crate in
#                           the registry; a crate never published and no REV is skipped, said so
#   .ci/crates.sh tools     build the pinned cargo-semver-checks into the cache
#   .ci/crates.sh           docs, msrv, package and api, as CI runs them
#
# The published crates are the workspace members whose manifest does not say `publish = false`.
# cargo-semver-checks is built like the tools of .ci/supply-chain.sh, once, into
# CONTROLLER_SHARDING_CACHE (default ~/.cache/controller-sharding).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

CARGO_SEMVER_CHECKS_VERSION=0.51.0


# Scratch space of this run, removed when it ends.
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT

log() { echo "crates: $*" >&2; }
die() { log "error: $*"; exit 1; }
# tool_root, install_tool, ensure_jq.
source .ci/tools.sh

# The workspace members meant for the registry, one `name kind...` line each (kinds of their
# targets: lib, bin, ...), from cargo metadata.
published() {
  ensure_jq
  cargo metadata --locked --no-deps --format-version 1 | jq -r '
    .workspace_members as $members
    | .packages[]
    | select(.id as $id | $members | index($id))
    | select(.publish != [])
    | "\(.name) \([.targets[].kind[]] | unique | join(" "))"'
}

# -p flags for every published crate; for libraries only with `lib`.
package_flags() {
  local filter=${1:-} name kinds
  while read -r name kinds; do
    if [ -z "$filter" ] || [[ " $kinds " == *" $filter "* ]]; then
      printf -- '-p\n%s\n' "$name"
    fi
  done < <(published)
}

docs() {
  local flags
  mapfile -t flags < <(package_flags lib)
  [ "${#flags[@]}" -gt 0 ] || die "no published library crate found"
  log "cargo doc ${flags[*]}"
  RUSTDOCFLAGS="-D warnings" cargo doc --locked --no-deps "${flags[@]}"
}

# The rust-version every published crate declares; they must agree.
msrv_version() {
  ensure_jq
  local versions
  versions=$(cargo metadata --locked --no-deps --format-version 1 |
    jq -r '.packages[] | select(.publish != []) | .rust_version // "none"' | sort -u)
  [ "$(wc -l <<<"$versions")" = 1 ] || die "published crates declare different rust-versions: $versions"
  [ "$versions" != none ] || die "published crates declare no rust-version"
  echo "$versions"
}

msrv() {
  local version flags
  version=$(msrv_version)
  if ! rustup run "$version" rustc --version >/dev/null 2>&1; then
    log "installing the Rust $version toolchain (minimal profile, about 80 MB)"
    rustup toolchain install "$version" --profile minimal >&2
  fi
  mapfile -t flags < <(package_flags)
  log "cargo +$version check ${flags[*]}"
  # The lock file as committed: the MSRV claim holds for the versions we test with.
  cargo "+$version" check --locked "${flags[@]}"
}

package() {
  local flags name kinds
  mapfile -t flags < <(package_flags)
  # cargo package verifies a crate against its siblings' packages, unpacked from a temporary
  # registry in the target directory into CARGO_HOME and compiled like registry crates, which
  # cargo takes as immutable: an unpacked copy or a build of the same name and version is reused.
  # With a target directory kept across runs (as .ci/run keeps it), a dependent would be verified
  # against the previous run's sources. Remove both for the project's own crates first.
  while read -r name kinds; do
    rm -rf "${CARGO_HOME:-$HOME/.cargo}"/registry/src/-*/"$name"-[0-9]*
  done < <(published)
  cargo clean --locked --quiet "${flags[@]}"
  log "cargo package ${flags[*]}"
  # --allow-dirty: check the tree as it is, also by hand before a commit; the real
  # `cargo publish` of a release refuses uncommitted changes by itself.
  # The unpacked packages build without the workspace's profiles, so their dependencies would get
  # debug info the workspace's builds leave out (profile.dev.package."*") and all be compiled
  # again: without debug info they reuse most of what the workspace built (2 min instead of 12).
  CARGO_PROFILE_DEV_DEBUG=false cargo package --locked --allow-dirty "${flags[@]}"
  log "cargo publish --dry-run ${flags[*]}"
  # The packages were built just above; the dry run adds the registry's own checks.
  cargo publish --dry-run --locked --allow-dirty --no-verify "${flags[@]}"
}

tools() {
  install_tool cargo-semver-checks "$CARGO_SEMVER_CHECKS_VERSION"
}

# api [REV]: semver checks of the published libraries against REV or their newest release.
api() {
  local rev=${1:-} name kinds baseline info checked=0
  local bin
  bin=$(tool_root cargo-semver-checks "$CARGO_SEMVER_CHECKS_VERSION")/bin/cargo-semver-checks
  while read -r name kinds; do
    [[ " $kinds " == *" lib "* ]] || continue
    if [ -n "$rev" ]; then
      baseline=(--baseline-rev "$rev")
    # Asked from outside the workspace, where cargo info would describe the member itself. Only
    # "not found" skips the crate: a registry that cannot be reached fails the check instead of
    # passing it unchecked.
    elif info=$(cd "$SCRATCH" && cargo info --quiet "$name" 2>&1); then
      baseline=()
    elif grep -q "could not find \`$name\`" <<<"$info"; then
      log "$name: never published, no baseline; skipped (give a git revision to compare with)"
      continue
    else
      die "could not ask the registry for $name: $info"
    fi
    # Built only when a crate has a baseline: until the first release CI pays nothing for it.
    tools
    log "cargo semver-checks -p $name ${baseline[*]}"
    "$bin" semver-checks check-release -p "$name" "${baseline[@]}"
    checked=$((checked + 1))
  done < <(published)
  log "API checked for $checked crates"
}

all() {
  echo "--- crates: cargo doc, rustdoc warnings denied"
  docs
  echo "--- crates: MSRV check"
  msrv
  echo "--- crates: cargo package, cargo publish --dry-run"
  package
  echo "--- crates: public API against the newest release (cargo semver-checks)"
  api
}

case ${1:-all} in
  docs | msrv | package | tools | all) "${@:-all}" ;;
  api) shift; api "$@" ;;
  *) die "unknown command ${1}; see the top of $0" ;;
esac
