#!/usr/bin/env bash
# A real, throwaway Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager) on
# loopback, for tests and the local playground.
#
#   control-plane.sh provision            build and cache etcd, kube-apiserver,
#                                         kube-controller-manager and kubectl (idempotent)
#   control-plane.sh start DIR [OWNER] [--node]
#                                         start the control plane with state in DIR, write
#                                         DIR/kubeconfig and DIR/etcd-endpoint (etcd's client
#                                         URL), wait until ready; with OWNER (a PID), stop
#                                         everything by itself once that process is gone; with
#                                         --node (root only), also a node: containerd, kubelet,
#                                         kube-proxy and kube-scheduler, pods on a bridge of its
#                                         own (e2e/node.sh)
#   control-plane.sh load-images DIR ARCHIVE...
#                                         import OCI image archives into the node's containerd
#   control-plane.sh node-support         print why a node cannot run here and exit 1, or exit 0
#   control-plane.sh stop DIR             stop every process of it and remove everything it made
#                                         (with a node: mounts, the bridge, iptables rules,
#                                         cgroups) and DIR
#   control-plane.sh bin-dir              print the directory holding the cached binaries
#
# One node per machine: its bridge, addresses and containerd are the machine's. `start --node`
# takes a lock (CONTROLLER_SHARDING_NODE_LOCK, default node.lock in the cache) that the watchdog
# holds until the node is stopped, so a second test run on the machine waits for the first.
#
# KUBE_APISERVER_EXTRA_ARGS adds flags to kube-apiserver (split on whitespace), for a test that
# needs a feature gate set otherwise. They come after the script's own flags, and a later
# --feature-gates flag adds to the earlier ones (a gate named twice takes the later value): a test
# turns the gate below off with --feature-gates=ShardedListAndWatch=false.
#
# ShardedListAndWatch (server-side sharded list and watch, alpha and off by default where it
# exists) is turned on whenever the kube-apiserver binary knows it: an unknown gate makes
# kube-apiserver refuse to start, and the tests also run releases from before the gate.
#
# Versions: KUBE_VERSION (default below) and ETCD_VERSION override the pinned releases. Everything
# is built from Go modules with `go build`, fetched through the Go module proxy the machine's Go is
# configured with; nothing else is downloaded. Binaries and Go's module and build caches live
# under CONTROLLER_SHARDING_CACHE (default ~/.cache/controller-sharding), outside the checkout.
#
# Why wrapper modules: k8s.io/kubernetes requires each of its staging modules (k8s.io/api, ...) at
# v0.0.0 and points them at ./staging with replace directives, which only apply inside its own
# repository; `go install ...@version` refuses such a module. A generated module that requires
# k8s.io/kubernetes and replaces every one of those v0.0.0 requirements with the matching published
# v0.<minor>.<patch> builds the same code. etcd's server module has relative replace directives
# too, and gets a wrapper of the same kind.
set -euo pipefail

KUBE_VERSION=${KUBE_VERSION:-1.37.2}
ETCD_VERSION=${ETCD_VERSION:-3.6.16}
# The Go release fetched (as the golang.org/toolchain module) when the machine's Go is older than
# what KUBE_VERSION's go.mod asks for.
GO_TOOLCHAIN_VERSION=${GO_TOOLCHAIN_VERSION:-1.26.8}
# Bump BUILD_REVISION whenever the build recipe changes, so cached binaries are rebuilt.
BUILD_REVISION=2

CACHE_DIR=${CONTROLLER_SHARDING_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/controller-sharding}
BIN_DIR=$CACHE_DIR/bin/kubernetes-v$KUBE_VERSION-etcd-v$ETCD_VERSION-r$BUILD_REVISION
GO_DIR=$CACHE_DIR/go
SERVICE_RANGE=10.0.0.0/24
BINARIES=(etcd kube-apiserver kube-controller-manager kubectl kube-scheduler kubelet kube-proxy)

# shellcheck source=e2e/node.sh
. "$(dirname "${BASH_SOURCE[0]}")/node.sh"

log() { echo "control-plane: $*" >&2; }
die() { log "error: $*"; exit 1; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    die "need root to run: $*"
  fi
}

ensure_packages() {
  local missing=()
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]}"
    as_root apt-get update -qq >&2
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >&2
  fi
}

# Go's environment for every build: caches in CACHE_DIR (so a second provision, or a version bump,
# reuses what was downloaded and compiled), no automatic toolchain switch, and a writable module
# cache so the cache can be deleted with rm -rf.
go_env() {
  export GOMODCACHE=$GO_DIR/mod GOCACHE=$GO_DIR/build GOPATH=$GO_DIR/path
  export GOTOOLCHAIN=local GOFLAGS="-mod=mod -modcacherw" CGO_ENABLED=0 GOWORK=off
}

# "1.26.8" from "go version go1.26.8 linux/amd64".
go_version_of() { "$1" version | awk '{print $3}' | sed 's/^go//'; }

# Whether version $1 >= version $2.
version_at_least() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]; }

# A `go` that can run module downloads: the machine's, else Debian's.
any_go() {
  if command -v go >/dev/null; then command -v go; return; fi
  if [ -x /usr/local/go/bin/go ]; then echo /usr/local/go/bin/go; return; fi
  ensure_packages golang-go ca-certificates
  command -v go || die "no go after installing golang-go"
}

# Prints a Go of at least version $1: the machine's when new enough, else the pinned toolchain,
# downloaded as a module through the proxy (works with any Go that has modules, Debian's too).
go_at_least() {
  local need=$1 go
  go=$(any_go)
  if version_at_least "$(go_version_of "$go")" "$need"; then echo "$go"; return; fi
  local root=$GO_DIR/toolchain/go$GO_TOOLCHAIN_VERSION
  if [ ! -x "$root/bin/go" ]; then
    local arch mod dir
    arch=$("$go" env GOARCH)
    mod="golang.org/toolchain@v0.0.1-go$GO_TOOLCHAIN_VERSION.linux-$arch"
    log "$go is $(go_version_of "$go"), older than the $need that Kubernetes $KUBE_VERSION needs; fetching $mod"
    dir=$("$go" mod download -json "$mod" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
    [ -n "$dir" ] && [ -d "$dir" ] || die "failed to download $mod"
    rm -rf "$root.tmp" && mkdir -p "$(dirname "$root")"
    cp -r "$dir" "$root.tmp"
    # Module zips carry no file modes.
    chmod -R u+w "$root.tmp"
    chmod +x "$root.tmp"/bin/* "$root.tmp"/pkg/tool/*/*
    rm -rf "$root" && mv "$root.tmp" "$root"
  fi
  version_at_least "$(go_version_of "$root/bin/go")" "$need" ||
    die "Go $GO_TOOLCHAIN_VERSION is older than $need; set GO_TOOLCHAIN_VERSION"
  echo "$root/bin/go"
}

# The go.mod of module $2@$3, downloaded with $1.
module_go_mod() {
  local go=$1 path=$2 version=$3 file
  file=$("$go" mod download -json "$path@$version" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')
  [ -n "$file" ] && [ -f "$file" ] || die "failed to download $path@$version"
  echo "$file"
}

build_kubernetes() {
  local out=$1 minor patch go kube_mod need work
  minor=$(echo "$KUBE_VERSION" | cut -d. -f2)
  patch=$(echo "$KUBE_VERSION" | cut -d. -f3)
  kube_mod=$(module_go_mod "$(any_go)" k8s.io/kubernetes "v$KUBE_VERSION")
  need=$(awk '$1 == "go" {print $2; exit}' "$kube_mod")
  go=$(go_at_least "$need")
  work=$GO_DIR/work/kubernetes-v$KUBE_VERSION
  rm -rf "$work" && mkdir -p "$work"
  {
    echo "// Generated by e2e/control-plane.sh: builds Kubernetes v$KUBE_VERSION from published modules."
    echo "module controller-sharding.invalid/kubernetes-build"
    echo
    echo "go $need"
    grep -E '^godebug ' "$kube_mod" || true
    echo
    echo "require k8s.io/kubernetes v$KUBE_VERSION"
    echo
    echo "replace ("
    # Every k8s.io module that k8s.io/kubernetes itself requires at v0.0.0 (its staging modules).
    awk -v v="v0.$minor.$patch" '$1 ~ /^k8s\.io\// && $2 == "v0.0.0" {print "\t" $1 " => " $1 " " v}' "$kube_mod"
    echo ")"
  } >"$work/go.mod"
  local count
  count=$(grep -c ' => ' "$work/go.mod")
  [ "$count" -gt 10 ] || die "found only $count staging modules in k8s.io/kubernetes's go.mod"
  local pkg=k8s.io/component-base/version client=k8s.io/client-go/pkg/version ldflags=""
  for p in $pkg $client; do
    ldflags+=" -X $p.gitVersion=v$KUBE_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
    ldflags+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
  done
  log "building kube-apiserver, kube-controller-manager, kubectl and the node's kube-scheduler, kubelet and kube-proxy v$KUBE_VERSION with $("$go" version | awk '{print $3}') (first time: 10-20 minutes)"
  (cd "$work" && "$go" build -trimpath -ldflags "-s -w$ldflags" -o "$out/" \
    k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kubectl \
    k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kubelet \
    k8s.io/kubernetes/cmd/kube-proxy >&2)
}

build_etcd() {
  local out=$1 etcd_mod need go work
  etcd_mod=$(module_go_mod "$(any_go)" go.etcd.io/etcd/server/v3 "v$ETCD_VERSION")
  need=$(awk '$1 == "go" {print $2; exit}' "$etcd_mod")
  go=$(go_at_least "$need")
  work=$GO_DIR/work/etcd-v$ETCD_VERSION
  rm -rf "$work" && mkdir -p "$work"
  {
    echo "// Generated by e2e/control-plane.sh: builds etcd v$ETCD_VERSION from published modules."
    echo "module controller-sharding.invalid/etcd-build"
    echo
    echo "go $need"
    echo
    echo "require ("
    echo "	go.etcd.io/etcd/server/v3 v$ETCD_VERSION"
    # The sibling modules the server module points at with relative replace directives.
    awk -v v="v$ETCD_VERSION" '$1 ~ /^go\.etcd\.io\/etcd\// && $2 == "=>" && $3 ~ /^\.\.\// {print "\t" $1 " " v}' "$etcd_mod"
    echo ")"
  } >"$work/go.mod"
  log "building etcd v$ETCD_VERSION"
  (cd "$work" && "$go" build -trimpath -ldflags "-s -w" -o "$out/etcd" go.etcd.io/etcd/server/v3 >&2)
}

binaries_work() {
  local b
  for b in "${BINARIES[@]}"; do [ -x "$BIN_DIR/$b" ] || return 1; done
  # Whole outputs first: `grep -q` stops reading early, and with pipefail the writer's SIGPIPE
  # would fail the check now and then.
  local apiserver etcd
  apiserver=$("$BIN_DIR/kube-apiserver" --version 2>/dev/null) || return 1
  etcd=$("$BIN_DIR/etcd" --version 2>/dev/null) || return 1
  grep -qx "Kubernetes v$KUBE_VERSION" <<<"$apiserver" && grep -qx "etcd Version: $ETCD_VERSION" <<<"$etcd"
}

provision() {
  ensure_packages openssl curl ca-certificates
  # The node's packages when we may install them; without root there is no node to run.
  if [ "$(id -u)" = 0 ]; then node_packages; fi
  if binaries_work; then
    log "using cached binaries in $BIN_DIR"
    return
  fi
  go_env
  local tmp=$BIN_DIR.tmp
  rm -rf "$tmp" && mkdir -p "$tmp"
  local started=$SECONDS
  build_etcd "$tmp"
  build_kubernetes "$tmp"
  rm -rf "$BIN_DIR" && mv "$tmp" "$BIN_DIR"
  binaries_work || die "the binaries built in $BIN_DIR do not report v$KUBE_VERSION / $ETCD_VERSION"
  log "built and cached $BIN_DIR in $((SECONDS - started))s"
}

# A port nothing listens on right now. Ports are drawn at random below the kernel's ephemeral
# range: a port that an outgoing connection holds (the API server's to etcd, say) accepts no
# connection, so the check below would call it free, yet binding it fails. Random draws keep
# parallel control planes apart; the check closes most of the remaining race window.
free_port() {
  local p low=20000 high
  high=$(awk '{print $1 - 1}' /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32767)
  [ "${high:-0}" -gt $((low + 1000)) ] || high=32767
  for _ in $(seq 100); do
    p=$((low + RANDOM % (high - low + 1)))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
      echo "$p"
      return
    fi
  done
  die "no free port found"
}

# Client certificate $2 (CN) in group $3, signed by the CA in $1.
client_cert() {
  local d=$1 name=$2 cn=$3 group=$4
  openssl req -newkey rsa:2048 -nodes -subj "/O=$group/CN=$cn" \
    -keyout "$d/$name.key" -out "$d/$name.csr" 2>/dev/null
  printf 'extendedKeyUsage=clientAuth\n' >"$d/client.ext"
  openssl x509 -req -in "$d/$name.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial \
    -days 3650 -extfile "$d/client.ext" -out "$d/$name.crt" 2>/dev/null
}

# The CA, the API server's serving certificate (valid for 127.0.0.1 and the SANs in $2, comma
# separated) and the clients' certificates.
gen_certs() {
  local d=$1 extra_sans=${2:-}
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=controller-sharding-test-ca" \
    -keyout "$d/ca.key" -out "$d/ca.crt" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj "/CN=kube-apiserver" \
    -keyout "$d/serving.key" -out "$d/serving.csr" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost%s\nextendedKeyUsage=serverAuth\n' \
    "${extra_sans:+,$extra_sans}" >"$d/serving.ext"
  openssl x509 -req -in "$d/serving.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial \
    -days 3650 -extfile "$d/serving.ext" -out "$d/serving.crt" 2>/dev/null
  client_cert "$d" admin admin system:masters
  # kube-controller-manager runs every controller under its own identity; system:masters spares a
  # test cluster the per-controller service accounts a production install sets up.
  client_cert "$d" controller-manager system:kube-controller-manager system:masters
  # kube-apiserver's identity towards kubelets (logs, exec).
  client_cert "$d" apiserver-kubelet-client kube-apiserver-kubelet-client system:masters
  openssl genrsa -out "$d/sa.key" 2048 2>/dev/null
  openssl rsa -in "$d/sa.key" -pubout -out "$d/sa.pub" 2>/dev/null
  # The aggregation layer: a CA of its own for the front proxy (as kubeadm sets it up), and the
  # API server's client certificate towards aggregated APIs (the sharder's external metrics).
  # P-256 keys: made in milliseconds, where an RSA key takes a fifth of a second.
  local ec=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1)
  openssl req -x509 "${ec[@]}" -nodes -days 3650 -subj "/CN=front-proxy-ca" \
    -keyout "$d/front-proxy-ca.key" -out "$d/front-proxy-ca.crt" 2>/dev/null
  openssl req "${ec[@]}" -nodes -subj "/CN=front-proxy-client" \
    -keyout "$d/front-proxy-client.key" -out "$d/front-proxy-client.csr" 2>/dev/null
  openssl x509 -req -in "$d/front-proxy-client.csr" -CA "$d/front-proxy-ca.crt" \
    -CAkey "$d/front-proxy-ca.key" -CAcreateserial -days 3650 -extfile "$d/client.ext" \
    -out "$d/front-proxy-client.crt" 2>/dev/null
}

# kubeconfig for user $3 at server $2, written to $1.
write_kubeconfig() {
  local file=$1 server=$2 user=$3 dir
  dir=$(dirname "$file")
  cat >"$file" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    server: $server
    certificate-authority: $dir/ca.crt
users:
- name: $user
  user:
    client-certificate: $dir/$user.crt
    client-key: $dir/$user.key
contexts:
- name: local
  context: {cluster: local, user: $user}
current-context: local
EOF
}

# Fails (after stopping everything) when a process of the control plane in $1 has exited.
check_alive() {
  local dir=$1 pid
  while read -r pid; do
    if ! kill -0 "$pid" 2>/dev/null; then
      log "a control-plane process exited early; last log lines:"
      tail -n 30 "$dir"/*.log >&2 || true
      stop "$dir"
      exit 1
    fi
  done <"$dir/pids"
}

start() {
  local args=() node=false a
  for a in "$@"; do
    if [ "$a" = --node ]; then node=true; else args+=("$a"); fi
  done
  local dir=${args[0]:?usage: start DIR [OWNER_PID] [--node]} owner=${args[1]:-}
  binaries_work || die "no cached binaries in $BIN_DIR; run '$0 provision' first"
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  [ ! -e "$dir/pids" ] || die "$dir already holds a control plane; stop it first"
  # e2e/test.sh waits for every control plane its test processes started to be stopped.
  if [ -n "${CONTROLLER_SHARDING_STARTED:-}" ]; then echo "$dir" >>"$CONTROLLER_SHARDING_STARTED"; fi
  local address=127.0.0.1 sans="" node_lock=
  if $node; then
    local reason
    reason=$(node_unsupported_reason)
    [ -z "$reason" ] || die "$reason"
    local lock_file=${CONTROLLER_SHARDING_NODE_LOCK:-$CACHE_DIR/node.lock}
    mkdir -p "$(dirname "$lock_file")"
    exec {node_lock}>"$lock_file"
    if ! flock -n "$node_lock"; then
      log "another test run's node is up; waiting until it is stopped (lock $lock_file)"
      flock -w 3600 "$node_lock" || die "the node lock $lock_file stayed taken for an hour"
    fi
    address=$NODE_IP
    # The `kubernetes` Service's ClusterIP and names, for pods' in-cluster clients.
    sans="IP:$NODE_IP,IP:${SERVICE_RANGE%.*}.1,DNS:kubernetes,DNS:kubernetes.default"
    sans+=",DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  fi
  gen_certs "$dir" "$sans"
  : >"$dir/pids"

  if [ -n "$owner" ]; then
    # A watchdog in its own session, so that the control plane never outlives the test run that
    # started it, even when that run is killed.
    setsid bash -c 'while kill -0 "$1" 2>/dev/null && [ -e "$2/pids" ]; do sleep 1; done; "$3" stop "$2"' \
      watchdog "$owner" "$dir" "$(cd "$(dirname "$0")" && pwd)/$(basename "$0")" \
      >/dev/null 2>&1 </dev/null &
    # The watchdog holds the node lock (it inherited it) until the node is stopped; the node's
    # own processes must not, or one that outlived its stop would keep the next run waiting.
    if [ -n "$node_lock" ]; then exec {node_lock}>&-; fi
  fi

  local etcd_port etcd_peer_port api_port
  etcd_port=$(free_port)
  etcd_peer_port=$(free_port)
  api_port=$(free_port)

  # etcd's data lives in memory when possible, without fsync: the control plane is thrown away
  # after the run.
  local data="$dir/etcd"
  if [ -d /dev/shm ] && [ -w /dev/shm ]; then
    data=$(mktemp -d /dev/shm/controller-sharding-etcd.XXXXXX)
    ln -s "$data" "$dir/etcd"
  fi
  "$BIN_DIR/etcd" --name default --data-dir "$data" --unsafe-no-fsync \
    --listen-client-urls "http://127.0.0.1:$etcd_port" \
    --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$etcd_peer_port" \
    --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer_port" \
    --initial-cluster "default=http://127.0.0.1:$etcd_peer_port" \
    --listen-metrics-urls "" >"$dir/etcd.log" 2>&1 &
  echo $! >>"$dir/pids"
  # Plain HTTP on loopback: tests reach etcd's JSON gateway (/v3/kv/...) with curl.
  echo "http://127.0.0.1:$etcd_port" >"$dir/etcd-endpoint"

  local gates=() extra_args=() help
  # The whole help first: with pipefail, `grep -q` closing the pipe early could fail the check.
  help=$("$BIN_DIR/kube-apiserver" --help 2>&1 || true)
  if grep -q 'ShardedListAndWatch=' <<<"$help"; then
    gates+=(--feature-gates=ShardedListAndWatch=true)
  fi
  read -r -a extra_args <<<"${KUBE_APISERVER_EXTRA_ARGS:-}"
  if $node; then
    # Before the API server: it listens on the node's bridge address.
    node_network_up "$dir"
    # As in a real cluster: kubelets authorized by the Node authorizer and NodeRestriction,
    # ServiceAccount tokens mounted into pods, the `kubernetes` Service's endpoints kept by the
    # API server, and kube-apiserver calling kubelets with a client certificate.
    extra_args+=(
      --authorization-mode Node,RBAC
      --enable-admission-plugins NodeRestriction
      --endpoint-reconciler-type lease
      --kubelet-client-certificate "$dir/apiserver-kubelet-client.crt"
      --kubelet-client-key "$dir/apiserver-kubelet-client.key"
      --kubelet-certificate-authority "$dir/ca.crt"
      --kubelet-preferred-address-types InternalIP
    )
  else
    # The ServiceAccount admission plugin is off: no controller here creates the default service
    # accounts it insists on, and nothing runs pods.
    extra_args+=(
      --authorization-mode RBAC
      --endpoint-reconciler-type none
      --disable-admission-plugins ServiceAccount
    )
  fi

  "$BIN_DIR/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$etcd_port" \
    --bind-address "$address" --advertise-address "$address" --secure-port "$api_port" \
    --tls-cert-file "$dir/serving.crt" --tls-private-key-file "$dir/serving.key" \
    --client-ca-file "$dir/ca.crt" \
    --service-account-key-file "$dir/sa.pub" \
    --service-account-signing-key-file "$dir/sa.key" \
    --service-account-issuer https://kubernetes.default.svc \
    --service-cluster-ip-range "$SERVICE_RANGE" \
    --requestheader-client-ca-file "$dir/front-proxy-ca.crt" \
    --requestheader-allowed-names front-proxy-client \
    --requestheader-username-headers X-Remote-User \
    --requestheader-group-headers X-Remote-Group \
    --requestheader-extra-headers-prefix X-Remote-Extra- \
    --proxy-client-cert-file "$dir/front-proxy-client.crt" \
    --proxy-client-key-file "$dir/front-proxy-client.key" \
    "${gates[@]}" "${extra_args[@]}" \
    >"$dir/kube-apiserver.log" 2>&1 &
  echo $! >>"$dir/pids"

  local server="https://$address:$api_port"
  write_kubeconfig "$dir/kubeconfig" "$server" admin
  write_kubeconfig "$dir/controller-manager.kubeconfig" "$server" controller-manager

  local deadline=$((SECONDS + 120))
  until curl -sf --cacert "$dir/ca.crt" --cert "$dir/admin.crt" --key "$dir/admin.key" \
    "$server/readyz" >/dev/null 2>&1; do
    if [ $SECONDS -ge $deadline ]; then
      log "kube-apiserver not ready after 120s; last log lines:"
      tail -n 30 "$dir/kube-apiserver.log" "$dir/etcd.log" >&2 || true
      stop "$dir"
      exit 1
    fi
    check_alive "$dir"
    sleep 0.3
  done

  # Only the controllers whose effects the tests rely on: the garbage collector (owner references)
  # and namespace lifecycle (deleting a namespace's content); with a node, also what Deployments,
  # StatefulSets (the example's StatefulSet variant), Services, ServiceAccount tokens and
  # PodDisruptionBudgets and HorizontalPodAutoscalers need. No serving port, no leader election.
  local controllers=garbage-collector-controller,namespace-controller cm_args=()
  if $node; then
    controllers+=,deployment-controller,replicaset-controller,statefulset-controller
    controllers+=,endpointslice-controller
    controllers+=,serviceaccount-controller,root-ca-certificate-publisher-controller
    controllers+=,disruption-controller,node-lifecycle-controller
    # The HPA scaling the example's shards on the sharder's external metrics, syncing every 5 s
    # rather than 15 s so a scale test waits less.
    controllers+=,horizontal-pod-autoscaler-controller
    cm_args+=(--horizontal-pod-autoscaler-sync-period 5s)
  fi
  "$BIN_DIR/kube-controller-manager" \
    --kubeconfig "$dir/controller-manager.kubeconfig" \
    --controllers "$controllers" --root-ca-file "$dir/ca.crt" "${cm_args[@]}" \
    --secure-port 0 --leader-elect=false \
    >"$dir/kube-controller-manager.log" 2>&1 &
  echo $! >>"$dir/pids"
  sleep 0.5
  check_alive "$dir"
  if $node && ! node_start "$dir" "$server"; then
    stop "$dir"
    exit 1
  fi
  log "ready at $server (kubeconfig: $dir/kubeconfig)"
}

stop() {
  local dir=${1:?usage: stop DIR}
  [ -d "$dir" ] || return 0
  # The node first: its pods and processes need the API server no longer, and containerd must
  # outlive kubelet to kill the containers.
  node_stop "$dir"
  if [ -f "$dir/pids" ]; then
    # Reverse order: controller manager, then kube-apiserver, then etcd.
    local pids
    pids=$(tac "$dir/pids")
    for pid in $pids; do kill "$pid" 2>/dev/null || true; done
    for pid in $pids; do
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
    done
  fi
  if [ -L "$dir/etcd" ]; then rm -rf "$(readlink "$dir/etcd")"; fi
  rm -rf "$dir"
}

case "${1:-}" in
  provision) provision ;;
  start) shift; start "$@" ;;
  stop) shift; stop "$@" ;;
  load-images) shift; node_load_images "$@" ;;
  node-support)
    reason=$(node_unsupported_reason)
    if [ -n "$reason" ]; then echo "$reason"; exit 1; fi
    ;;
  bin-dir) echo "$BIN_DIR" ;;
  *) echo "usage: $0 provision | start DIR [OWNER_PID] [--node] | load-images DIR ARCHIVE... | node-support | stop DIR | bin-dir" >&2; exit 2 ;;
esac
