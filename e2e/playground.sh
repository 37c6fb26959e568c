#!/usr/bin/env bash
# A local playground: a real control plane on loopback, the sharder and three checksum-controller
# shards as local processes, the example ring and 60 Secrets split between the shards.
#
#   e2e/playground.sh [up]               start everything; stays in the foreground, Ctrl-C stops
#                                        and removes everything
#   e2e/playground.sh status             ring, shard states and how the objects are distributed
#   e2e/playground.sh add-shard NAME     start another shard
#   e2e/playground.sh remove-shard NAME  stop a shard (it releases its Lease on the way out)
#   e2e/playground.sh down               stop a running `up` from another terminal
#   e2e/playground.sh --cluster [COMMAND] the same example in a real cluster: a node, images,
#                                        `kubectl apply -k` (e2e/playground-cluster.sh; root)
#
# The other commands talk to the `up` running in another terminal through the state directory
# ${TMPDIR:-/tmp}/controller-sharding-playground (override with CONTROLLER_SHARDING_PLAYGROUND);
# its kubeconfig is the file `kubeconfig` there. The sharder listens on fixed loopback ports:
# health 8081, metrics 8080 (plain HTTP), webhook 9443 (override with PLAYGROUND_HEALTH_PORT,
# PLAYGROUND_METRICS_PORT, PLAYGROUND_WEBHOOK_PORT).
#
# PLAYGROUND_RING_KIND=ControllerRing runs the example as a ControllerRing (docs/protocol.md §15)
# instead of a ClusterRing; `up` records the kind in the state directory for the other commands.
#
# The processes run with the control plane's admin credentials, so the RBAC of config/ and deploy/
# plays no part here; the manifests test in the e2e suite checks those against the API server.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [ "${1:-}" = --cluster ]; then
  shift
  exec bash "$ROOT/e2e/playground-cluster.sh" "$@"
fi
SCRIPT="$ROOT/e2e/playground.sh"
STATE=${CONTROLLER_SHARDING_PLAYGROUND:-${TMPDIR:-/tmp}/controller-sharding-playground}
HEALTH_PORT=${PLAYGROUND_HEALTH_PORT:-8081}
METRICS_PORT=${PLAYGROUND_METRICS_PORT:-8080}
WEBHOOK_PORT=${PLAYGROUND_WEBHOOK_PORT:-9443}
NAMESPACE=playground
RING=checksum-controller
SHARDS=(shard-0 shard-1 shard-2)
SECRETS=60
RING_KIND=${PLAYGROUND_RING_KIND:-$(cat "$STATE/ring-kind" 2>/dev/null || echo ClusterRing)}
case "$RING_KIND" in
  ClusterRing)
    # The ring's label keys (docs/protocol.md §2); the ring name is short, so nothing is cut.
    SUFFIX="clusterring-$(printf %s "$RING" | sha256sum | cut -c1-8)-$RING"
    RING_FILE="$ROOT/deploy/clusterring/clusterring.yaml"
    ;;
  ControllerRing)
    # docs/protocol.md §15: the ring name itself.
    SUFFIX=$RING
    RING_FILE="$ROOT/deploy/controllerring/controllerring.yaml"
    ;;
  *) echo "playground: PLAYGROUND_RING_KIND must be ClusterRing or ControllerRing" >&2; exit 2 ;;
esac
RING_RESOURCE=$(printf %s "$RING_KIND" | tr '[:upper:]' '[:lower:]')
SHARD_LABEL="shard.alpha.sharding.timebertt.dev/$SUFFIX"
DRAIN_LABEL="drain.alpha.sharding.timebertt.dev/$SUFFIX"
RING_LABEL="alpha.sharding.timebertt.dev/$RING_RESOURCE"
KUBECONFIG_FILE="$STATE/kubeconfig"

log() { echo "playground: $*" >&2; }
die() { log "error: $*"; exit 1; }

# The kubectl built with the control plane (same release as the server).
KUBECTL="$(bash "$ROOT/e2e/control-plane.sh" bin-dir)/kubectl"
k() { "$KUBECTL" --kubeconfig "$KUBECONFIG_FILE" "$@"; }

usage() {
  sed -n '2,/^set -euo/p' "$SCRIPT" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 2
}

# Whether pid $1 is alive and runs binary $2 (pids recorded earlier may have been reused).
is_ours() {
  local pid=$1 binary=$2
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null &&
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$binary"
}

up_running() {
  [ -f "$STATE/up.pid" ] && kill -0 "$(cat "$STATE/up.pid")" 2>/dev/null
}

require_up() {
  up_running || die "no playground is running (start one with: $SCRIPT up)"
}

# Waits until "$@" succeeds, at most $1 seconds; $2 says what for.
wait_for() {
  local timeout=$1 what=$2
  shift 2
  local deadline=$((SECONDS + timeout))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || { log "timed out after ${timeout}s waiting for $what"; return 1; }
    sleep 0.5
  done
}

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

binary_dir() {
  local target
  target=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps |
    sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
  [ -n "$target" ] || die "cannot find cargo's target directory"
  echo "$target/debug"
}

# Starts shard $1 in a session of its own (so Ctrl-C in a terminal does not reach it; `up` stops
# everything in order).
start_shard() {
  local name=$1 bin
  bin=$(cat "$STATE/bin-dir")/checksum-controller
  KUBECONFIG=$KUBECONFIG_FILE setsid "$bin" \
    --ring "$RING" --ring-kind "$RING_KIND" --namespace "$NAMESPACE" --lease-namespace "$NAMESPACE" \
    --shard-name "$name" >"$STATE/logs/$name.log" 2>&1 </dev/null &
  echo $! >"$STATE/pids/shard-$name"
}

shard_holds_lease() {
  [ "$(k -n "$NAMESPACE" get lease "$1" -o 'jsonpath={.spec.holderIdentity}')" = "$1" ]
}

ring_available() {
  local available
  available=$(k get "$RING_RESOURCE" "$RING" -o 'jsonpath={.status.availableShards}')
  [ "$available" = "$1" ]
}

webhook_configured() {
  [ -n "$(k get mutatingwebhookconfigurations -l "$RING_LABEL=$RING" -o name)" ]
}

# Go templates for kubectl: the shard (or "(unassigned)") of every object, with a note on drains.
# Objects without any labels have no label map, hence the `with`.
SHARD_OF='{{$s := ""}}{{$d := ""}}{{with .metadata.labels}}{{$s = index . "'$SHARD_LABEL'"}}{{$d = index . "'$DRAIN_LABEL'"}}{{end}}'
SHARD_TEMPLATE='{{range .items}}'$SHARD_OF'{{if $s}}{{$s}}{{else}}(unassigned){{end}}{{if $d}} (draining){{end}}{{"\n"}}{{end}}'
UNASSIGNED_TEMPLATE='{{range .items}}'$SHARD_OF'{{if not $s}}{{.metadata.name}}{{"\n"}}{{end}}{{end}}'

unassigned_secrets() {
  k -n "$NAMESPACE" get secrets -o go-template="$UNASSIGNED_TEMPLATE"
}

all_secrets_assigned() {
  [ -z "$(unassigned_secrets)" ]
}

checksums_written() {
  [ "$(k -n "$NAMESPACE" get configmaps -o name | grep -c '/checksums-')" -ge "$SECRETS" ]
}

# Counts objects of $1 per value of the shard label (and how many carry the drain label).
distribution() {
  k -n "$NAMESPACE" get "$1" -o go-template="$SHARD_TEMPLATE" |
    sort | uniq -c | awk '{count=$1; $1=""; printf "  %-28s %d\n", substr($0, 2), count}'
}

status() {
  require_up
  echo "$RING_KIND:"
  k get "$RING_RESOURCE" "$RING" | sed 's/^/  /'
  echo
  echo "Shard Leases (namespace $NAMESPACE):"
  k -n "$NAMESPACE" get leases -l "$RING_LABEL=$RING" \
    -o custom-columns='NAME:.metadata.name,HOLDER:.spec.holderIdentity,STATE:.metadata.labels.alpha\.sharding\.timebertt\.dev/state,RENEWED:.spec.renewTime' |
    sed 's/^/  /'
  echo
  echo "Secrets per shard:"
  distribution secrets
  echo "ConfigMaps per shard:"
  distribution configmaps
  echo
  echo "Metrics: http://127.0.0.1:$METRICS_PORT/metrics"
}

add_shard() {
  local name=${1:-}
  [[ $name =~ ^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$ ]] || die "shard name must be a DNS label, got '$name'"
  require_up
  if is_ours "$(cat "$STATE/pids/shard-$name" 2>/dev/null)" checksum-controller; then
    die "shard $name is already running"
  fi
  start_shard "$name"
  wait_for 30 "shard $name to acquire its Lease" shard_holds_lease "$name" ||
    die "shard $name did not join; its log is $STATE/logs/$name.log"
  log "shard $name joined (log: $STATE/logs/$name.log)"
}

# Sends SIGTERM to the process in pid file $1 (running binary $2) and waits up to $3 seconds.
stop_process() {
  local pidfile=$1 binary=$2 timeout=$3 pid
  pid=$(cat "$pidfile" 2>/dev/null || true)
  if is_ours "$pid" "$binary"; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq $((timeout * 10))); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      log "$(basename "$pidfile") did not stop within ${timeout}s; killing it"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  rm -f "$pidfile"
}

remove_shard() {
  local name=${1:-}
  [ -n "$name" ] || die "usage: $SCRIPT remove-shard NAME"
  require_up
  [ -f "$STATE/pids/shard-$name" ] || die "no shard $name is running"
  stop_process "$STATE/pids/shard-$name" checksum-controller 15
  log "shard $name stopped and released its Lease; the sharder moves its objects"
}

# Stops everything `up` started and removes the state directory. Safe to run more than once.
cleanup() {
  [ -d "$STATE" ] || return 0
  # A second Ctrl-C must not cut the cleanup short.
  trap '' INT
  log "stopping"
  local pidfile
  # Shards first (they release their Leases while the API server is still up), then the sharder,
  # then the control plane.
  for pidfile in "$STATE"/pids/shard-*; do
    [ -e "$pidfile" ] && stop_process "$pidfile" checksum-controller 15
  done
  [ -e "$STATE/pids/sharder" ] && stop_process "$STATE/pids/sharder" sharder 15
  bash "$ROOT/e2e/control-plane.sh" stop "$STATE/control-plane" || true
  rm -rf "$STATE"
  log "stopped and cleaned up"
}

# Runs detached from `up`: if `up` dies without cleaning up (SIGKILL), clean up after it.
watchdog() {
  local owner=$1
  while kill -0 "$owner" 2>/dev/null && [ -d "$STATE" ]; do sleep 1; done
  if [ -d "$STATE" ] && [ "$(cat "$STATE/up.pid" 2>/dev/null)" = "$owner" ]; then
    cleanup
  fi
}

print_help() {
  cat <<EOF

The playground is up. In another terminal:

  export KUBECONFIG=$KUBECONFIG_FILE
  $SCRIPT status                 # ring, shards, objects per shard
  $SCRIPT add-shard shard-3      # another shard joins
  $SCRIPT remove-shard shard-0   # a shard leaves (releases its Lease)
  watch -n1 $SCRIPT status       # watch objects move
  $KUBECTL -n $NAMESPACE get secrets -L $SHARD_LABEL -w

Metrics: http://127.0.0.1:$METRICS_PORT/metrics    Logs: $STATE/logs/
Ctrl-C stops everything and removes $STATE.
EOF
}

up() {
  if [ -d "$STATE" ]; then
    up_running && die "a playground is already running (state in $STATE)"
    log "removing the leftovers of an earlier playground in $STATE"
    cleanup
  fi
  local tool
  for tool in cargo openssl curl setsid sha256sum; do
    command -v "$tool" >/dev/null || die "$tool is needed"
  done
  local port
  for port in "$HEALTH_PORT" "$METRICS_PORT" "$WEBHOOK_PORT"; do
    port_free "$port" || die "port $port on 127.0.0.1 is in use; stop what listens there or set PLAYGROUND_*_PORT"
  done

  mkdir -p "$STATE/pids" "$STATE/logs" "$STATE/sharder"
  echo $$ >"$STATE/up.pid"
  echo "$RING_KIND" >"$STATE/ring-kind"
  trap cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  setsid bash "$SCRIPT" __watchdog $$ >/dev/null 2>&1 </dev/null &
  local started=$SECONDS

  log "building the sharder and checksum-controller"
  (cd "$ROOT" && cargo build --bins -p kube-sharder -p kubectl-sharding -p sharding-checksum-controller)
  binary_dir >"$STATE/bin-dir"

  log "starting the control plane"
  bash "$ROOT/e2e/control-plane.sh" provision
  # In a session of its own, like the sharder and the shards: Ctrl-C reaches only this script, which
  # then stops the shards before the control plane they need to release their Leases.
  setsid -w bash "$ROOT/e2e/control-plane.sh" start "$STATE/control-plane" $$
  cp "$STATE/control-plane/kubeconfig" "$KUBECONFIG_FILE"

  log "installing the ClusterRing and ControllerRing CRDs"
  local plural
  for plural in clusterrings controllerrings; do
    k apply --server-side -f "$ROOT/config/crds/sharding.timebertt.dev_$plural.yaml" >/dev/null
    k wait --for condition=Established --timeout 60s "crd/$plural.sharding.timebertt.dev" >/dev/null
  done
  k create -f "$ROOT/config/crds/namespace.yaml" >/dev/null
  k create namespace "$NAMESPACE" >/dev/null
  # The example ring covers namespaces that opt in with this label (deploy/clusterring/clusterring.yaml).
  k label namespace "$NAMESPACE" checksum-controller=enabled >/dev/null

  log "starting the sharder"
  local dir="$STATE/sharder"
  # The same generator as the e2e harness's test sharders (e2e/src/certs.rs).
  bash "$ROOT/e2e/certs.sh" "$dir" playground-ca 2>/dev/null
  cat >"$dir/config.yaml" <<EOF
apiVersion: config.sharding.timebertt.dev/v1alpha1
kind: SharderConfig
clientConnection:
  kubeconfig: $KUBECONFIG_FILE
health:
  bindAddress: 127.0.0.1:$HEALTH_PORT
metrics:
  bindAddress: 127.0.0.1:$METRICS_PORT
  # Plain HTTP for curl and a local Prometheus; installs serve HTTPS to authorized tokens only.
  secure: false
webhook:
  server:
    bindAddress: 127.0.0.1:$WEBHOOK_PORT
    certDir: $dir
  config:
    # The API server runs on this machine, so it reaches the webhook on loopback by URL.
    clientConfig:
      url: https://127.0.0.1:$WEBHOOK_PORT
      caBundleFile: $dir/ca.crt
gracefulShutdown: 5s
shutdownDelay: 1s
EOF
  setsid "$(cat "$STATE/bin-dir")/sharder" --config "$dir/config.yaml" \
    >"$STATE/logs/sharder.log" 2>&1 </dev/null &
  echo $! >"$STATE/pids/sharder"
  wait_for 60 "the sharder to be ready" curl -sf "http://127.0.0.1:$HEALTH_PORT/readyz" ||
    { tail -n 20 "$STATE/logs/sharder.log" >&2; die "the sharder did not become ready"; }

  log "creating the $RING_KIND and starting ${#SHARDS[@]} shards"
  k create -f "$RING_FILE" >/dev/null
  local shard
  for shard in "${SHARDS[@]}"; do start_shard "$shard"; done
  wait_for 60 "${#SHARDS[@]} available shards" ring_available "${#SHARDS[@]}" ||
    die "the ring did not get ${#SHARDS[@]} available shards; logs are in $STATE/logs"
  wait_for 30 "the ring's webhook configuration" webhook_configured ||
    die "the sharder wrote no webhook configuration; see $STATE/logs/sharder.log"

  log "creating $SECRETS Secrets"
  local i
  for i in $(seq 0 $((SECRETS - 1))); do
    printf -- '---\napiVersion: v1\nkind: Secret\nmetadata:\n  name: sample-%02d\nstringData:\n  password: "%s"\n' \
      "$i" "$RANDOM$RANDOM"
  done | k -n "$NAMESPACE" create -f - >/dev/null
  wait_for 60 "every Secret to be assigned" all_secrets_assigned ||
    die "Secrets left unassigned: $(unassigned_secrets | tr '\n' ' ')"
  wait_for 60 "the checksum ConfigMaps" checksums_written ||
    log "not every checksum ConfigMap is there yet; see the shard logs in $STATE/logs"
  log "ready after $((SECONDS - started))s"
  echo
  status
  print_help

  # Stay in the foreground; the traps stop everything on Ctrl-C.
  while true; do
    if ! is_ours "$(cat "$STATE/pids/sharder" 2>/dev/null)" sharder; then
      log "the sharder exited; last lines of its log:"
      tail -n 20 "$STATE/logs/sharder.log" >&2 || true
      exit 1
    fi
    sleep 1
  done
}

case "${1:-up}" in
  up) up ;;
  status) status ;;
  add-shard) add_shard "${2:-}" ;;
  remove-shard) remove_shard "${2:-}" ;;
  down)
    require_up
    kill -TERM "$(cat "$STATE/up.pid")"
    while up_running || [ -d "$STATE" ]; do sleep 0.2; done
    log "stopped"
    ;;
  __watchdog) watchdog "$2" ;;
  -h | --help | help) usage ;;
  *) usage ;;
esac
