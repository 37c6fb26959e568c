#!/usr/bin/env bash
# The project's test command: provisions the local control plane and node (first run: builds and
# caches etcd and Kubernetes from Go modules, 8-20 minutes; as root, installs the Debian packages
# the tests need), builds the binaries the end-to-end tests start as processes, and runs every test
# of the workspace, the in-cluster tests (images built offline, a real node) included. Extra
# arguments go to `cargo test`.
# With KUBECONFIG set, the end-to-end tests use that cluster instead of starting one.
#
# Without arguments and without KUBECONFIG it then runs the chaos soak (docs/chaos.md) twice,
# about a minute and a half each: once with a fixed seed whose plan holds every kind of fault at these
# settings, once with a random seed, printed first so a failure can be replayed with --seed, and with
# the webhook ring's shards leaving their ConfigMaps to the sharder (synced children first).
set -euo pipefail
cd "$(dirname "$0")/.."

# A test process's control plane (and node) is stopped by a watchdog once that process has exited,
# in the background. Wait for those stops before returning, so that a machine or container torn
# down right after this command (as CI's are) is not left with etcd's data in /dev/shm, state
# directories, or a node's mounts, network namespaces and iptables rules. The test processes'
# logs are kept where a run failed (and named), removed where it passed.
started=$(mktemp "${TMPDIR:-/tmp}/controller-sharding-started.XXXXXX")
log_dirs=$(mktemp "${TMPDIR:-/tmp}/controller-sharding-log-dirs.XXXXXX")
export CONTROLLER_SHARDING_STARTED=$started CONTROLLER_SHARDING_LOG_DIRS=$log_dirs
finish() {
  local status=$? dir waited=$SECONDS count=0 left=0 deadline=$((SECONDS + 60))
  while read -r dir; do
    count=$((count + 1))
    while [ -d "$dir" ] && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2; done
    # Its watchdog did not finish in time (or was killed): the owner is gone, so stop it here.
    if [ -d "$dir" ]; then bash e2e/control-plane.sh stop "$dir" || true; fi
    if [ -d "$dir" ]; then
      echo "the control plane in $dir is still there after stopping it" >&2
      left=$((left + 1))
    fi
  done <"$started"
  rm -f "$started"
  echo "control planes the tests started: $count, not stopped: $left (waited $((SECONDS - waited))s)"
  if [ "$left" -gt 0 ] && [ "$status" -eq 0 ]; then status=1; fi
  if [ "$status" -eq 0 ]; then
    while read -r dir; do
      # Only what log_dir() (e2e/src/process.rs) names.
      case $dir in */controller-sharding-e2e-logs-[0-9]*) rm -rf "$dir" ;; esac
    done <"$log_dirs"
  elif [ -s "$log_dirs" ]; then
    echo "the test processes' logs are kept in:" >&2
    sed 's/^/  /' "$log_dirs" >&2
  fi
  rm -f "$log_dirs"
  exit "$status"
}
trap finish EXIT
if [ -z "${KUBECONFIG:-}" ]; then
  # As root this also installs the node's Debian packages for the in-cluster tests.
  bash e2e/control-plane.sh provision
fi
# The monitoring tests run promtool and a Prometheus server of their own (Debian's package).
if ! command -v "${PROMTOOL:-promtool}" >/dev/null 2>&1 ||
  ! command -v "${PROMETHEUS:-prometheus}" >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    echo "installing Debian's prometheus package (promtool and the server)" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  else
    echo "promtool or prometheus not found: install Debian's prometheus package" \
      "(sudo apt-get install prometheus), or set PROMTOOL and PROMETHEUS" >&2
    exit 1
  fi
fi
if reason=$(bash e2e/control-plane.sh node-support); then
  echo "the in-cluster tests (e2e/tests/in_cluster) run on a node of their own"
else
  echo "the in-cluster tests (e2e/tests/in_cluster) will be skipped: $reason" >&2
fi
cargo build --workspace --bins
cargo test --workspace "$@"
if [ $# -eq 0 ] && [ -z "${KUBECONFIG:-}" ]; then
  chaos=(cargo run -q -p sharding-loadtest --bin chaos --
    --duration 50s --fault-interval 3s --lease-duration 8s --settle 5s)
  "${chaos[@]}" --seed 20
  "${chaos[@]}" --leave-children-to-sharder
fi
