#!/usr/bin/env bash
# Supply-chain checks of the workspace, run by .ci/run and usable by hand from the workspace root:
#
#   .ci/supply-chain.sh tools          install the pinned cargo-deny and cargo-cyclonedx into the
#                                      cache (idempotent: a cached tool costs nothing)
#   .ci/supply-chain.sh deny           cargo deny check licenses bans sources (deny.toml)
#   .ci/supply-chain.sh advisories [--offline]
#                                      cargo deny check advisories: needs network access and git,
#                                      to fetch the RustSec advisory database (not run by CI);
#                                      --offline uses the copy fetched before
#   .ci/supply-chain.sh sbom [DIR]     write a CycloneDX JSON SBOM of each shipped binary,
#                                      DIR/sharder.cdx.json and DIR/checksum-controller.cdx.json
#                                      (DIR defaults to target/sbom), and check them
#   .ci/supply-chain.sh check-sbom DIR check SBOMs already in DIR
#   .ci/supply-chain.sh                all of the above, as CI runs them
#
# The tools are built from source with `cargo install --locked` at the versions pinned below, into
# CONTROLLER_SHARDING_CACHE (default ~/.cache/controller-sharding, as e2e/control-plane.sh uses),
# outside the checkout. CONTROLLER_SHARDING_TOOL_JOBS limits the build's parallel jobs (default:
# all cores). Bump a version here to move to another release; the old one stays in the cache until
# the cache is deleted.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

CARGO_DENY_VERSION=0.20.2
CARGO_CYCLONEDX_VERSION=0.5.9


# Scratch space of this run, removed when it ends.
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT

log() { echo "supply-chain: $*" >&2; }
die() { log "error: $*"; exit 1; }
# tool_root, install_tool, ensure_jq.
source .ci/tools.sh


tools() {
  install_tool cargo-deny "$CARGO_DENY_VERSION"
  install_tool cargo-cyclonedx "$CARGO_CYCLONEDX_VERSION"
  ensure_jq
}

deny() {
  install_tool cargo-deny "$CARGO_DENY_VERSION"
  # --locked: a Cargo.lock that does not match the manifests is an error, not silently updated.
  "$(tool_root cargo-deny "$CARGO_DENY_VERSION")/bin/cargo-deny" --locked \
    check --hide-inclusion-graph licenses bans sources
}

# advisories [FLAG...]: FLAGs go to cargo-deny, e.g. --offline to use the database fetched before.
advisories() {
  install_tool cargo-deny "$CARGO_DENY_VERSION"
  "$(tool_root cargo-deny "$CARGO_DENY_VERSION")/bin/cargo-deny" --locked "$@" check advisories
}

# The shipped binaries: binary name and the package that builds it.
SHIPPED=("sharder kube-sharder" "checksum-controller sharding-checksum-controller")

# sbom DIR: write DIR/<binary>.cdx.json for each shipped binary (CycloneDX 1.5 JSON) and check them.
# cargo-cyclonedx writes its files next to each package's Cargo.toml, for every package of the
# workspace; it runs on a copy of the sources so the checkout is never touched.
sbom() {
  local out=${1:-target/sbom} copy
  install_tool cargo-cyclonedx "$CARGO_CYCLONEDX_VERSION"
  ensure_jq
  copy=$(mktemp -d "$SCRATCH/sources.XXXXXX")
  tar -c --exclude=./target --exclude=./.git . | tar -x -C "$copy"
  # The SBOM describes Cargo.lock as committed; refuse a lock file cargo would have to change.
  cargo metadata --locked --format-version 1 --manifest-path "$copy/Cargo.toml" >/dev/null
  (cd "$copy" && "$(tool_root cargo-cyclonedx "$CARGO_CYCLONEDX_VERSION")/bin/cargo-cyclonedx" \
    cyclonedx --quiet --format json --spec-version 1.5 --describe binaries)
  mkdir -p "$out"
  local entry bin pkg dir
  for entry in "${SHIPPED[@]}"; do
    read -r bin pkg <<<"$entry"
    dir=$(cargo metadata --locked --no-deps --format-version 1 --manifest-path "$copy/Cargo.toml" |
      jq -r --arg pkg "$pkg" '.packages[] | select(.name == $pkg) | .manifest_path' | xargs dirname)
    [ -f "$dir/${bin}_bin.cdx.json" ] || die "cargo-cyclonedx wrote no SBOM for $bin in $dir"
    # Package ids of the workspace's own crates name their directory: the checkout's, not the copy's.
    jq --arg copy "$copy" --arg root "$PWD" \
      'walk(if type == "string" then split($copy) | join($root) else . end)' \
      "$dir/${bin}_bin.cdx.json" >"$out/$bin.cdx.json"
  done
  check_sbom "$out"
  self_test_check "$out"
  log "SBOMs in $out: $(cd "$out" && echo *.cdx.json)"
}

# check-sbom DIR: check each shipped binary's SBOM in DIR twice, for the host platform that
# cargo-cyclonedx describes:
# - it lists exactly the packages that the binary's package reaches through normal and build
#   dependencies in `cargo metadata`, each at its locked version (.ci/sbom-check.jq);
# - every package `cargo tree -p <package>` shows is in it. cargo tree resolves features for that
#   package alone, as `cargo build -p` does, while cargo metadata unifies them over the whole
#   workspace: the SBOM may list a few crates that only another member's features pull in (h2 and
#   httpdate for checksum-controller, from the sharder's HTTP/2 server), never fewer.
check-sbom() { check_sbom "$@"; }
check_sbom() {
  local dir=$1 host meta entry bin pkg file problems failed=0
  ensure_jq
  host=$(rustc -vV | sed -n 's/^host: //p')
  meta=$(mktemp "$SCRATCH/metadata.XXXXXX")
  cargo metadata --locked --format-version 1 --filter-platform "$host" >"$meta"
  for entry in "${SHIPPED[@]}"; do
    read -r bin pkg <<<"$entry"
    file=$dir/$bin.cdx.json
    [ -f "$file" ] || { log "$file: missing"; failed=1; continue; }
    problems=$(jq -n -r --slurpfile meta "$meta" --slurpfile bom "$file" \
      --arg pkg "$pkg" --arg bin "$bin" -f .ci/sbom-check.jq) || {
      log "$file: could not be read as a CycloneDX document"; failed=1; continue; }
    cargo tree --locked --quiet -p "$pkg" -e normal,build --target "$host" --prefix none \
      --format '{p}' | sed -e 's/ (.*//' -e 's/ v/ /' | grep -vx "$pkg .*" | sort -u \
      >"$SCRATCH/tree"
    [ -s "$SCRATCH/tree" ] || die "cargo tree -p $pkg listed no dependencies"
    jq -r '.components[]? | "\(.name) \(.version)"' "$file" | sort -u >"$SCRATCH/listed"
    problems=$(printf '%s\n' "$problems" \
      "$(comm -23 "$SCRATCH/tree" "$SCRATCH/listed" | sed 's/^/missing (cargo tree): /')" |
      sed '/^$/d')
    if [ -n "$problems" ]; then
      log "$file does not match the dependency tree:"
      head -n 30 <<<"$problems" | sed 's/^/  /' >&2
      [ "$(wc -l <<<"$problems")" -le 30 ] || log "  ... $(($(wc -l <<<"$problems") - 30)) more"
      failed=1
    else
      log "$file: $(jq '.components | length' "$file") packages, as cargo metadata and cargo tree say"
    fi
  done
  return "$failed"
}

# The check must be able to fail: an SBOM missing one package, and one with a package's version
# changed, are both refused.
self_test_check() {
  local good=$1 bad
  bad=$(mktemp -d "$SCRATCH/tampered.XXXXXX")
  cp "$good"/*.cdx.json "$bad/"
  jq 'del(.components[0])' "$good/sharder.cdx.json" >"$bad/sharder.cdx.json"
  if check_sbom "$bad" 2>/dev/null; then die "the SBOM check accepts an SBOM missing a package"; fi
  cp "$good/sharder.cdx.json" "$bad/"
  jq '.components[-1].version += ".1"' "$good/checksum-controller.cdx.json" \
    >"$bad/checksum-controller.cdx.json"
  if check_sbom "$bad" 2>/dev/null; then die "the SBOM check accepts a wrong version"; fi
}

# No arguments: what CI runs.
all() {
  tools
  deny
  sbom target/sbom
}

case ${1:-all} in
  tools | deny | advisories | sbom | check-sbom | all) "${@:-all}" ;;
  *) die "unknown command ${1}; see the top of $0" ;;
esac
