#!/usr/bin/env bash
# The playground in a real cluster: a control plane with a node (containerd, kubelet, kube-proxy,
# kube-scheduler), the images built offline from Dockerfile.sharder and
# Dockerfile.checksum-controller, and the install of docs/install-kustomize.md done as a user does it
# (`kubectl apply -k config/overlays/no-cert-manager`, `kubectl apply -k deploy`). Needs root.
#
#   e2e/playground-cluster.sh [up]     start everything; stays in the foreground, Ctrl-C stops
#                                      and removes everything (pods, mounts, the bridge, rules)
#   e2e/playground-cluster.sh status   ring, shard pods and how the Secrets are spread
#   e2e/playground-cluster.sh down     stop a running `up` from another terminal
#
# Also reached as `e2e/playground.sh --cluster [COMMAND]`. State, logs and the kubeconfig live in
# ${TMPDIR:-/tmp}/controller-sharding-cluster-playground (CONTROLLER_SHARDING_PLAYGROUND overrides).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
SCRIPT="$ROOT/e2e/playground-cluster.sh"
STATE=${CONTROLLER_SHARDING_PLAYGROUND:-${TMPDIR:-/tmp}/controller-sharding-cluster-playground}
PLANE=$STATE/control-plane
KUBECONFIG_FILE=$PLANE/kubeconfig
NAMESPACE=playground
SECRETS=60
RING=checksum-controller
SHARD_LABEL="shard.alpha.sharding.timebertt.dev/clusterring-$(printf %s "$RING" | sha256sum | cut -c1-8)-$RING"

log() { echo "playground: $*" >&2; }
die() { log "error: $*"; exit 1; }

KUBECTL="$(bash "$ROOT/e2e/control-plane.sh" bin-dir)/kubectl"
k() { "$KUBECTL" --kubeconfig "$KUBECONFIG_FILE" "$@"; }

usage() {
  sed -n '2,/^set -euo/p' "$SCRIPT" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 2
}

# The shell block of the section under heading $2 of the page $1 (as e2e::docs::shell_block finds
# it: the first sh block before the next heading; fences of other languages are skipped).
doc_block() {
  awk -v h="$2" '
    !s && $0 == h {s = 1; next}
    !s {next}
    p && /^```$/ {exit}
    p {print; next}
    /^```sh$/ {p = 1; next}
    /^```/ {f = !f; next}
    !f && /^#/ {exit}
  ' "$ROOT/$1"
}

up_running() { [ -f "$STATE/up.pid" ] && kill -0 "$(cat "$STATE/up.pid")" 2>/dev/null; }

cleanup() {
  [ -d "$STATE" ] || return 0
  trap '' INT
  log "stopping"
  bash "$ROOT/e2e/control-plane.sh" stop "$PLANE" || true
  rm -rf "$STATE"
  log "stopped and cleaned up"
}

status() {
  [ -f "$KUBECONFIG_FILE" ] || die "no playground is running (start one with: $SCRIPT up)"
  k get clusterring "$RING"
  echo
  k -n checksum-controller get pods -o wide
  echo
  echo "Secrets per shard in namespace $NAMESPACE:"
  k -n "$NAMESPACE" get secrets -o "jsonpath={range .items[*]}{.metadata.labels.${SHARD_LABEL//./\\.}}{\"\\n\"}{end}" |
    sort | uniq -c
}

up() {
  if [ -d "$STATE" ]; then
    up_running && die "a playground is already running (state in $STATE)"
    cleanup
  fi
  local reason
  if ! reason=$(bash "$ROOT/e2e/control-plane.sh" node-support); then
    die "$reason"
  fi
  mkdir -p "$STATE"
  echo $$ >"$STATE/up.pid"
  trap 'cleanup; exit 130' INT TERM
  trap cleanup EXIT
  local started=$SECONDS
  bash "$ROOT/e2e/control-plane.sh" provision
  bash "$ROOT/e2e/images.sh" build "$STATE/images"
  bash "$ROOT/e2e/control-plane.sh" start "$PLANE" $$ --node
  bash "$ROOT/e2e/control-plane.sh" load-images "$PLANE" "$STATE/images/sharder.tar" \
    "$STATE/images/checksum-controller.tar"

  # The "Without cert-manager" install (docs/install-kustomize.md), run as written, in a scratch directory beside
  # the checkout; then the example.
  local work=$STATE/install
  mkdir -p "$work"
  ln -s "$ROOT/config" "$work/config"
  ln -s "$ROOT/deploy" "$work/deploy"
  (
    cd "$work"
    export KUBECONFIG=$KUBECONFIG_FILE PATH="$(dirname "$KUBECTL"):$PATH"
    local script
    script=$(doc_block docs/install-kustomize.md '## Without cert-manager')
    [ -n "$script" ] || die "no \"Without cert-manager\" block in docs/install-kustomize.md"
    if ! bash -euo pipefail -c "$script" >install.log 2>&1; then
      cat install.log >&2
      die "the install steps of docs/install-kustomize.md failed"
    fi
    kubectl -n sharding-system rollout status deployment sharder --timeout=180s
    kubectl apply -k deploy >/dev/null
    kubectl -n checksum-controller rollout status deployment checksum-controller --timeout=180s
  )
  k wait clusterring "$RING" --for=condition=Ready --timeout=120s >/dev/null
  k wait clusterring "$RING" --for=jsonpath='{.status.availableShards}'=3 --timeout=120s >/dev/null
  k create namespace "$NAMESPACE" >/dev/null
  k label namespace "$NAMESPACE" checksum-controller=enabled >/dev/null
  local i
  for i in $(seq 0 $((SECRETS - 1))); do
    k -n "$NAMESPACE" create secret generic "secret-$i" --from-literal=value="$i" >/dev/null
  done
  log "up in $((SECONDS - started))s"
  status
  cat <<EOF

The playground runs in a real cluster. In another terminal:

  export KUBECONFIG=$KUBECONFIG_FILE PATH=$(dirname "$KUBECTL"):\$PATH
  kubectl -n checksum-controller scale deployment checksum-controller --replicas=5
  $SCRIPT status                                      # objects per shard
  kubectl -n $NAMESPACE get secrets -L $SHARD_LABEL -w
  kubectl -n sharding-system logs -l app.kubernetes.io/component=sharder -f
  kubectl -n sharding-system get pods -o wide         # metrics: HTTPS with a token, see the
                                                      # "Who may scrape" in docs/monitoring.md

Ctrl-C stops everything and removes $STATE.
EOF
  while true; do sleep 1; done
}

case "${1:-up}" in
  up) up ;;
  status) status ;;
  down)
    up_running || die "no playground is running"
    kill -TERM "$(cat "$STATE/up.pid")"
    while [ -d "$STATE" ]; do sleep 0.2; done
    log "stopped"
    ;;
  -h | --help | help) usage ;;
  *) usage ;;
esac
