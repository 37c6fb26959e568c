#!/usr/bin/env bash
# A real, throwaway Kubernetes control plane (etcd + kube-apiserver) on loopback, for tests and the
# local playground.
#
#   control-plane.sh provision            install packages, build and cache kube-apiserver (idempotent)
#   control-plane.sh start DIR [OWNER]    start etcd + kube-apiserver with state in DIR, write
#                                         DIR/kubeconfig, wait until ready; with OWNER (a PID), stop
#                                         everything by itself once that process is gone
#   control-plane.sh stop DIR             stop both and remove DIR
#   control-plane.sh apiserver-path       print the cached kube-apiserver binary's path
#
# Only Debian's package registry is used. kube-apiserver 1.20.2 is built from Debian's `kubernetes`
# source package, whose vendored modern-go/reflect2 1.0.1 crashes under Go >= 1.18 (SIGSEGV in
# mapiterinit while encoding JSON, e.g. when calling an admission webhook); it is swapped for
# Debian's reflect2 1.0.2 before building.
#
# A second Go-version trap: the vendored OpenAPI type validators treat a value as null when
# `reflect.DeepEqual(reflect.Zero(t), reflect.ValueOf(v))`. That compares reflect.Value structs; under
# the Go 1.15 that 1.20 shipped with they never matched, but current Go backs both a zero Value and
# an interface holding "" with the same static buffer, so every "" in a custom resource (the core
# group of a ClusterRing, say) fails with 'must be of type string: "null"'. The check is patched to
# `data == nil`, which is what it did in practice under the original Go.
set -euo pipefail

KUBE_VERSION=1.20.2
CACHE_DIR=${CONTROLLER_SHARDING_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/controller-sharding}
# Bump BUILD_REVISION whenever the build recipe changes, so cached binaries are rebuilt.
BUILD_REVISION=3
APISERVER_BIN=$CACHE_DIR/bin/kube-apiserver-v$KUBE_VERSION-r$BUILD_REVISION
GOCODE=/usr/share/gocode/src/github.com

log() { echo "control-plane: $*" >&2; }
die() { log "error: $*"; exit 1; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    die "need root to run: $*"
  fi
}

apt_updated=
apt_update_once() {
  if [ -z "$apt_updated" ]; then
    as_root apt-get update -qq >&2
    apt_updated=1
  fi
}

ensure_packages() {
  local missing=()
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]}"
    apt_update_once
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >&2
  fi
}

# Adds deb-src entries that mirror the machine's existing Debian entries (same URIs), so no
# repository address is hard-coded here.
ensure_deb_src() {
  local list=/etc/apt/sources.list.d/controller-sharding-src.sources
  if grep -rqs '^Types:.*deb-src' /etc/apt/sources.list.d/ || grep -qs '^deb-src' /etc/apt/sources.list; then
    return
  fi
  local uri
  uri=$( (grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -n1) || true)
  if [ -z "$uri" ]; then
    uri=$( (grep -hs '^deb ' /etc/apt/sources.list | awk '{print $2}' | grep -v security | head -n1) || true)
  fi
  [ -n "$uri" ] || die "no Debian package source configured; cannot add a deb-src entry"
  log "adding deb-src entry for bookworm"
  as_root tee "$list" >/dev/null <<EOF
Types: deb-src
URIs: $uri
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  apt_updated=
  apt_update_once
}

apiserver_works() {
  [ -x "$APISERVER_BIN" ] && "$APISERVER_BIN" --version 2>/dev/null | grep -q "v$KUBE_VERSION"
}

build_apiserver() {
  ensure_packages golang-1.19-go rsync dpkg-dev golang-github-modern-go-reflect2-dev
  # The machine's own Go is far newer than this source tree supports; use Debian's 1.19 explicitly.
  local go119=/usr/lib/go-1.19/bin
  [ -x "$go119/go" ] || die "missing $go119/go"
  ensure_deb_src
  local build="$CACHE_DIR/build"
  rm -rf "$build"
  mkdir -p "$build"
  log "fetching Debian's kubernetes source package"
  (cd "$build" && apt-get source -qq --download-only kubernetes >/dev/null && dpkg-source -x --no-check ./*.dsc src >&2)
  local src="$build/src"
  local reflect2="$src/vendor/github.com/modern-go/reflect2"
  [ -d "$reflect2" ] || die "unexpected source layout in $src"
  [ -d "$GOCODE/modern-go/reflect2" ] || die "missing $GOCODE/modern-go/reflect2"
  log "replacing vendored modern-go/reflect2 with Debian's 1.0.2"
  rm -rf "$reflect2"
  cp -rL "$GOCODE/modern-go/reflect2" "$reflect2"
  rm -f "$reflect2/go.mod" "$reflect2/go.sum"
  find "$reflect2" -name '*_test.go' -delete
  local type_go zero_check='data == nil || reflect.DeepEqual(reflect.Zero(reflect.TypeOf(data)), reflect.ValueOf(data))'
  for type_go in "$src/vendor/github.com/go-openapi/validate/type.go" \
    "$src/vendor/k8s.io/kube-openapi/pkg/validation/validate/type.go"; do
    grep -qF "$zero_check" "$type_go" || die "unexpected content in $type_go"
    log "patching the zero-value check in ${type_go#"$src/"}"
    sed -i "s/$zero_check/data == nil/" "$type_go"
    grep -qF "$zero_check" "$type_go" && die "failed to patch $type_go"
  done
  log "building kube-apiserver (takes a few minutes)"
  # The tarball has no git metadata; pin the version the binary reports.
  (cd "$src" && PATH="$go119:$PATH" GOTOOLCHAIN=local GOFLAGS= KUBE_GIT_VERSION="v$KUBE_VERSION" \
    KUBE_GIT_TREE_STATE=clean make WHAT=cmd/kube-apiserver >&2)
  local out
  out=$(find "$src/_output" -type f -name kube-apiserver -perm -u+x | head -n1)
  [ -n "$out" ] || die "build produced no kube-apiserver binary"
  mkdir -p "$(dirname "$APISERVER_BIN")"
  cp "$out" "$APISERVER_BIN.tmp"
  mv "$APISERVER_BIN.tmp" "$APISERVER_BIN"
  rm -rf "$build"
  log "cached $APISERVER_BIN"
}

provision() {
  local pkgs=(etcd-server openssl curl)
  command -v kubectl >/dev/null || pkgs+=(kubernetes-client)
  ensure_packages "${pkgs[@]}"
  if apiserver_works; then
    log "using cached $APISERVER_BIN"
  else
    build_apiserver
    apiserver_works || die "built kube-apiserver does not run"
  fi
}

etcd_bin() {
  if command -v etcd >/dev/null; then command -v etcd; elif [ -x /usr/bin/etcd ]; then echo /usr/bin/etcd; else
    die "etcd not found; run '$0 provision'"
  fi
}

# A port nothing listens on right now. Ports are drawn at random from a high range so that parallel
# control planes rarely collide; the check closes the remaining race window mostly.
free_port() {
  local p
  for _ in $(seq 100); do
    p=$((20000 + RANDOM % 30000))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
      echo "$p"
      return
    fi
  done
  die "no free port found"
}

gen_certs() {
  local d=$1
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=controller-sharding-test-ca" \
    -keyout "$d/ca.key" -out "$d/ca.crt" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj "/CN=kube-apiserver" \
    -keyout "$d/serving.key" -out "$d/serving.csr" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n' >"$d/serving.ext"
  openssl x509 -req -in "$d/serving.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial \
    -days 3650 -extfile "$d/serving.ext" -out "$d/serving.crt" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj "/O=system:masters/CN=admin" \
    -keyout "$d/admin.key" -out "$d/admin.csr" 2>/dev/null
  printf 'extendedKeyUsage=clientAuth\n' >"$d/admin.ext"
  openssl x509 -req -in "$d/admin.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial \
    -days 3650 -extfile "$d/admin.ext" -out "$d/admin.crt" 2>/dev/null
  openssl genrsa -out "$d/sa.key" 2048 2>/dev/null
  openssl rsa -in "$d/sa.key" -pubout -out "$d/sa.pub" 2>/dev/null
}

start() {
  local dir=${1:?usage: start DIR [OWNER_PID]} owner=${2:-}
  apiserver_works || die "no cached kube-apiserver; run '$0 provision' first"
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  [ ! -e "$dir/pids" ] || die "$dir already holds a control plane; stop it first"
  gen_certs "$dir"

  local etcd_port etcd_peer_port api_port
  etcd_port=$(free_port)
  etcd_peer_port=$(free_port)
  api_port=$(free_port)

  # etcd's data lives in memory when possible: the control plane is thrown away after the run.
  local data="$dir/etcd"
  if [ -d /dev/shm ] && [ -w /dev/shm ]; then
    data=$(mktemp -d /dev/shm/controller-sharding-etcd.XXXXXX)
    ln -s "$data" "$dir/etcd"
  fi
  "$(etcd_bin)" --name default --data-dir "$data" \
    --listen-client-urls "http://127.0.0.1:$etcd_port" \
    --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$etcd_peer_port" \
    --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer_port" \
    --initial-cluster "default=http://127.0.0.1:$etcd_peer_port" \
    --listen-metrics-urls "" >"$dir/etcd.log" 2>&1 &
  echo $! >>"$dir/pids"

  "$APISERVER_BIN" \
    --etcd-servers "http://127.0.0.1:$etcd_port" \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$api_port" \
    --insecure-port 0 \
    --tls-cert-file "$dir/serving.crt" --tls-private-key-file "$dir/serving.key" \
    --client-ca-file "$dir/ca.crt" \
    --service-account-key-file "$dir/sa.pub" \
    --service-account-signing-key-file "$dir/sa.key" \
    --service-account-issuer https://kubernetes.default.svc \
    --authorization-mode RBAC \
    --endpoint-reconciler-type none \
    --service-cluster-ip-range 10.0.0.0/24 \
    --disable-admission-plugins ServiceAccount \
    >"$dir/kube-apiserver.log" 2>&1 &
  echo $! >>"$dir/pids"

  cat >"$dir/kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    server: https://127.0.0.1:$api_port
    certificate-authority: $dir/ca.crt
users:
- name: admin
  user:
    client-certificate: $dir/admin.crt
    client-key: $dir/admin.key
contexts:
- name: local
  context: {cluster: local, user: admin}
current-context: local
EOF

  if [ -n "$owner" ]; then
    # A watchdog in its own session, so that the control plane never outlives the test run that
    # started it, even when that run is killed.
    setsid bash -c 'while kill -0 "$1" 2>/dev/null && [ -e "$2/pids" ]; do sleep 1; done; "$3" stop "$2"' \
      watchdog "$owner" "$dir" "$(cd "$(dirname "$0")" && pwd)/$(basename "$0")" \
      >/dev/null 2>&1 </dev/null &
  fi

  local deadline=$((SECONDS + 90))
  until curl -sf --cacert "$dir/ca.crt" --cert "$dir/admin.crt" --key "$dir/admin.key" \
    "https://127.0.0.1:$api_port/readyz" >/dev/null 2>&1; do
    if [ $SECONDS -ge $deadline ]; then
      log "kube-apiserver not ready after 90s; last log lines:"
      tail -n 30 "$dir/kube-apiserver.log" >&2 || true
      tail -n 10 "$dir/etcd.log" >&2 || true
      stop "$dir"
      exit 1
    fi
    while read -r pid; do
      if ! kill -0 "$pid" 2>/dev/null; then
        log "a control-plane process exited early; last log lines:"
        tail -n 30 "$dir/kube-apiserver.log" "$dir/etcd.log" >&2 || true
        stop "$dir"
        exit 1
      fi
    done <"$dir/pids"
    sleep 0.3
  done
  log "ready at https://127.0.0.1:$api_port (kubeconfig: $dir/kubeconfig)"
}

stop() {
  local dir=${1:?usage: stop DIR}
  [ -d "$dir" ] || return 0
  if [ -f "$dir/pids" ]; then
    # Reverse order: kube-apiserver before etcd.
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
  apiserver-path) echo "$APISERVER_BIN" ;;
  *) echo "usage: $0 provision | start DIR [OWNER_PID] | stop DIR | apiserver-path" >&2; exit 2 ;;
esac
