#!/usr/bin/env bash
# The project's test command: provisions the local control plane (first run: builds and caches
# etcd and Kubernetes from Go modules, 10-20 minutes), builds the binaries the end-to-end tests
# start as processes, and runs every test of the workspace. Extra arguments go to `cargo test`.
# With KUBECONFIG set, the end-to-end tests use that cluster instead of starting one.
#
# Without arguments and without KUBECONFIG it then runs the chaos soak (docs/chaos.md) twice,
# about a minute each: once with a fixed seed whose plan holds every kind of fault at these
# settings, once with a random seed, printed first so a failure can be replayed with --seed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${KUBECONFIG:-}" ]; then
  bash e2e/control-plane.sh provision
fi
# The monitoring tests run promtool and a Prometheus server of their own (Debian's package).
if ! command -v "${PROMTOOL:-promtool}" >/dev/null 2>&1 ||
  ! command -v "${PROMETHEUS:-prometheus}" >/dev/null 2>&1; then
  echo "promtool or prometheus not found: install Debian's prometheus package" \
    "(sudo apt-get install prometheus), or set PROMTOOL and PROMETHEUS" >&2
  exit 1
fi
cargo build --workspace --bins
cargo test --workspace "$@"
if [ $# -eq 0 ] && [ -z "${KUBECONFIG:-}" ]; then
  chaos=(cargo run -q -p sharding-e2e --bin chaos --
    --duration 30s --fault-interval 3s --lease-duration 8s --settle 5s)
  "${chaos[@]}" --seed 20
  "${chaos[@]}"
fi
