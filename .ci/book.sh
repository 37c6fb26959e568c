#!/usr/bin/env bash
# The documentation book (docs/, table of contents docs/SUMMARY.md), run by .ci/run and usable by
# hand from the workspace root:
#
#   .ci/book.sh tools      install the pinned mdbook into the cache (a cached one costs nothing)
#   .ci/book.sh build      build the book into target/book (CARGO_TARGET_DIR/book when set)
#   .ci/book.sh links      check every link of the book and the README (files and anchors)
#   .ci/book.sh            all of the above, as CI runs them
#
# mdbook is built from source with `cargo install --locked` at the version pinned below, without
# its `serve` and `watch` features (a web server and a file watcher that CI never uses and that
# double the build), into CONTROLLER_SHARDING_CACHE (default ~/.cache/controller-sharding, as
# .ci/supply-chain.sh and e2e/control-plane.sh use), outside the checkout.
# CONTROLLER_SHARDING_TOOL_JOBS limits the build's parallel jobs (default: all cores). Locally,
# `"$(.ci/book.sh path)" serve docs` needs a build with the default features.
#
# The links are checked by tests of our own (`book::` in e2e/tests/e2e, run with every test run),
# which read the Markdown sources of the book and the README alike: mdbook-linkcheck's releases
# are built against mdbook 0.4, and it would not see the README. Every link to a file of the
# checkout must resolve, anchors included; external links are counted, not followed (CI reaches no
# web site).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

MDBOOK_VERSION=0.5.4


log() { echo "book: $*" >&2; }
die() { log "error: $*"; exit 1; }
# tool_root, install_tool.
source .ci/tools.sh
MDBOOK=$(tool_root mdbook "$MDBOOK_VERSION")/bin/mdbook

tools() {
  install_tool mdbook "$MDBOOK_VERSION" --no-default-features --features search
}

build() {
  tools
  local out=${CARGO_TARGET_DIR:-$PWD/target}/book
  # docs/book.toml sets create-missing = false: a page named in SUMMARY.md that does not exist
  # fails the build instead of being created empty.
  "$MDBOOK" build docs --dest-dir "$out" >&2
  [ -f "$out/index.html" ] || die "mdbook wrote no $out/index.html"
  log "built the book into $out"
}

links() {
  cargo test --quiet -p sharding-e2e --test e2e -- book:: >&2
}

case "${1:-all}" in
  tools) tools ;;
  build) build ;;
  links) links ;;
  path) echo "$MDBOOK" ;;
  all)
    build
    links
    ;;
  *) die "unknown command ${1} (tools, build, links, path, or none for all)" ;;
esac
