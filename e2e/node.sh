# A node for the test control plane: containerd, kubelet, kube-proxy and kube-scheduler on this
# machine, pods on a bridge of the node's own. Sourced by control-plane.sh (`start DIR --node`);
# not a command of its own.
#
# What a node needs here, and why each setting:
# - Root: network namespaces, a bridge, iptables, mounts and cgroups.
# - A bridge NODE_BRIDGE with NODE_IP, made before kube-apiserver starts: the API server listens
#   and advertises itself there (pods reach it through the `kubernetes` Service), and kubelet
#   refuses a loopback node address. Pods get addresses in POD_SUBNET from the CNI bridge plugin
#   with host-local IPAM.
# - Nothing leaves the machine: no masquerading, and the first rules of the mangle table's FORWARD
#   chain drop every forwarded packet that does not both arrive on and leave through the node's
#   bridge (the bridge plugin turns IP forwarding on; `stop` restores the value it found).
# - containerd of its own (socket, root and state under the node's directory), with
#   `restrict_oom_score_adj` (lowering oom_score_adj is not permitted on these machines; without it
#   every sandbox fails with runc's "can't get final child's PID from pipe") and a pause image built
#   here (nothing can be pulled).
# - kubelet with cgroupfs, cgroup v1 allowed, swap allowed, image garbage collection off (the
#   images cannot be pulled again) and eviction thresholds low enough for a small disk.
#
# `node_stop` removes every process, mount, network namespace, interface, iptables rule, cgroup
# and file the node made.

NODE_NAME=controller-sharding-node
NODE_BRIDGE=${CONTROLLER_SHARDING_NODE_BRIDGE:-cshard0}
POD_SUBNET=${CONTROLLER_SHARDING_POD_SUBNET:-10.213.0.0/24}
# The bridge's address: the pods' gateway, the node's InternalIP and the API server's address.
NODE_IP=${POD_SUBNET%.*}.1
# Every rule this node adds to a built-in chain carries this comment, so `stop` finds them.
NODE_RULE_COMMENT=controller-sharding-node
# Debian packages the node needs.
NODE_PACKAGES=(containerd runc containernetworking-plugins iptables conntrack podman gcc libc6-dev)
CNI_BIN_DIR=/usr/lib/cni

# Why a node cannot start here, or nothing when it can.
node_unsupported_reason() {
  if [ "$(id -u)" != 0 ]; then
    echo "the node needs root (network namespaces, a bridge, iptables, mounts, cgroups); run as root"
    return
  fi
  if [ ! -d /sys/fs/cgroup ]; then
    echo "no cgroup file system at /sys/fs/cgroup"
    return
  fi
}

node_packages() { ensure_packages "${NODE_PACKAGES[@]}"; }

# The pause image, built once from e2e/node/pause.c into the image cache.
pause_image_archive() {
  local src
  src=$(dirname "${BASH_SOURCE[0]}")/node
  local sum
  sum=$(cat "$src/pause.c" "$src/pause.Containerfile" | sha256sum | cut -c1-12)
  local out=$CACHE_DIR/images/pause-$sum.tar
  if [ ! -s "$out" ]; then
    local work
    work=$(mktemp -d)
    cc -static -Os -o "$work/pause" "$src/pause.c" || die "failed to build the pause program"
    podman_local build --pull=never -f "$src/pause.Containerfile" -t "$PAUSE_IMAGE" "$work" >&2 ||
      die "failed to build the pause image"
    mkdir -p "$(dirname "$out")"
    podman_local save --format oci-archive -o "$out.tmp" "$PAUSE_IMAGE" >&2
    mv "$out.tmp" "$out"
    rm -rf "$work"
  fi
  echo "$out"
}

PAUSE_IMAGE=localhost/controller-sharding/pause:1

# podman with storage in the cache, apart from the machine's own images (vfs: no overlay mounts to
# leave behind). `podman run` is never used: it cannot raise RLIMIT_NOFILE on these machines.
podman_local() {
  podman --root "$CACHE_DIR/podman/root" --runroot "$CACHE_DIR/podman/run" \
    --storage-driver vfs "$@"
}

# A certificate for $2 (CN) in group $3 with extensions $4, signed by the CA in $1.
signed_cert() {
  local d=$1 name=$2 cn=$3 group=$4 ext=$5
  local subj="/CN=$cn"
  [ -z "$group" ] || subj="/O=$group/CN=$cn"
  openssl req -newkey rsa:2048 -nodes -subj "$subj" \
    -keyout "$d/$name.key" -out "$d/$name.csr" 2>/dev/null
  printf '%b' "$ext" >"$d/$name.ext"
  openssl x509 -req -in "$d/$name.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial \
    -days 3650 -extfile "$d/$name.ext" -out "$d/$name.crt" 2>/dev/null
}

# Before the API server starts: the bridge with the node's address, and the forwarding guard.
node_network_up() {
  local dir=$1
  local reason
  reason=$(node_unsupported_reason)
  [ -z "$reason" ] || die "$reason"
  # A node whose test run just ended may still be stopping (its watchdog notices within a second).
  local deadline=$((SECONDS + 30))
  while ip link show "$NODE_BRIDGE" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] ||
      die "the bridge $NODE_BRIDGE exists: another node is running ($(cat /run/controller-sharding-node 2>/dev/null || echo 'owner unknown')); stop it first, or remove the bridge"
    sleep 0.5
  done
  node_clean_iptables
  mkdir -p "$dir/node"
  echo "$dir" >/run/controller-sharding-node
  cat /proc/sys/net/ipv4/ip_forward >"$dir/node/ip_forward"
  ip link add "$NODE_BRIDGE" type bridge
  ip addr add "$NODE_IP/${POD_SUBNET#*/}" dev "$NODE_BRIDGE"
  ip link set "$NODE_BRIDGE" up
  # Forwarded packets stay on the bridge: pod to pod, and pod to a Service backed by a pod. In
  # the mangle table, which packets pass before the filter table, where kube-proxy and kubelet
  # put their own rules first.
  iptables -t mangle -I FORWARD 1 ! -o "$NODE_BRIDGE" -m comment --comment "$NODE_RULE_COMMENT" -j DROP
  iptables -t mangle -I FORWARD 1 ! -i "$NODE_BRIDGE" -m comment --comment "$NODE_RULE_COMMENT" -j DROP
  ip6tables -t mangle -I FORWARD 1 -m comment --comment "$NODE_RULE_COMMENT" -j DROP
}

# Certificates and kubeconfigs of the node's components; $2 is the API server's URL.
node_certs() {
  local dir=$1 server=$2
  signed_cert "$dir" kubelet "system:node:$NODE_NAME" system:nodes 'extendedKeyUsage=clientAuth\n'
  signed_cert "$dir" kubelet-serving "$NODE_NAME" "" \
    "subjectAltName=IP:$NODE_IP,DNS:$NODE_NAME\nextendedKeyUsage=serverAuth\n"
  signed_cert "$dir" kube-proxy system:kube-proxy "" 'extendedKeyUsage=clientAuth\n'
  signed_cert "$dir" kube-scheduler system:kube-scheduler "" 'extendedKeyUsage=clientAuth\n'
  write_kubeconfig "$dir/kubelet.kubeconfig" "$server" kubelet
  write_kubeconfig "$dir/kube-proxy.kubeconfig" "$server" kube-proxy
  write_kubeconfig "$dir/kube-scheduler.kubeconfig" "$server" kube-scheduler
}

# After the API server is ready: containerd, kubelet, kube-proxy, kube-scheduler; waits until the
# node is Ready.
node_start() {
  local dir=$1 server=$2 n=$1/node
  node_certs "$dir" "$server"
  local pause
  pause=$(pause_image_archive)
  mkdir -p "$n/cni/net.d" "$n/cni/ipam" "$n/containerd" "$n/kubelet" "$n/pod-logs" \
    "$n/volume-plugins"
  cat >"$n/cni/net.d/10-controller-sharding.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "controller-sharding",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$NODE_BRIDGE",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "$POD_SUBNET", "gateway": "$NODE_IP"}]],
        "routes": [{"dst": "0.0.0.0/0"}],
        "dataDir": "$n/cni/ipam"
      }
    }
  ]
}
EOF
  local sock=$n/containerd/containerd.sock
  cat >"$n/containerd/config.toml" <<EOF
version = 2
root = "$n/containerd/root"
state = "$n/containerd/state"
[grpc]
  address = "$sock"
[ttrpc]
  address = "$n/containerd/containerd-ttrpc.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$CNI_BIN_DIR"
    conf_dir = "$n/cni/net.d"
    max_conf_num = 1
EOF
  containerd --config "$n/containerd/config.toml" >"$dir/containerd.log" 2>&1 &
  echo $! >"$n/containerd.pid"
  local deadline=$((SECONDS + 30))
  until ctr --address "$sock" version >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || { tail -n 30 "$dir/containerd.log" >&2; die "containerd did not start"; }
    sleep 0.2
  done
  ctr --address "$sock" -n k8s.io images import "$pause" >/dev/null ||
    die "failed to import the pause image"

  local kubelet_port kubelet_healthz proxy_healthz proxy_metrics scheduler_port
  kubelet_port=$(free_port)
  kubelet_healthz=$(free_port)
  proxy_healthz=$(free_port)
  proxy_metrics=$(free_port)
  scheduler_port=$(free_port)
  cat >"$n/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# These machines mount cgroup v1 and no systemd manages the cgroups.
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://$sock
address: $NODE_IP
port: $kubelet_port
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $kubelet_healthz
tlsCertFile: $dir/kubelet-serving.crt
tlsPrivateKeyFile: $dir/kubelet-serving.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $dir/ca.crt}
authorization:
  mode: Webhook
podLogsDir: $n/pod-logs
volumePluginDir: $n/volume-plugins
# The images were imported, not pulled: never collect them.
imageGCHighThresholdPercent: 100
evictionHard:
  memory.available: 100Mi
  nodefs.available: 1%
  imagefs.available: 1%
# Quick pod status for the tests; the defaults are for large clusters.
nodeStatusUpdateFrequency: 4s
syncFrequency: 10s
EOF
  "$BIN_DIR/kubelet" --config "$n/kubelet.yaml" --kubeconfig "$dir/kubelet.kubeconfig" \
    --root-dir "$n/kubelet" --hostname-override "$NODE_NAME" --node-ip "$NODE_IP" \
    >"$dir/kubelet.log" 2>&1 &
  echo $! >"$n/kubelet.pid"

  cat >"$n/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clientConnection:
  kubeconfig: $dir/kube-proxy.kubeconfig
hostnameOverride: $NODE_NAME
clusterCIDR: $POD_SUBNET
healthzBindAddress: 127.0.0.1:$proxy_healthz
metricsBindAddress: 127.0.0.1:$proxy_metrics
nodePortAddresses: ["$NODE_IP/32"]
iptables:
  localhostNodePorts: false
# Leave the machine's conntrack settings alone.
conntrack:
  maxPerCore: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
EOF
  "$BIN_DIR/kube-proxy" --config "$n/kube-proxy.yaml" >"$dir/kube-proxy.log" 2>&1 &
  echo $! >"$n/kube-proxy.pid"

  "$BIN_DIR/kube-scheduler" --kubeconfig "$dir/kube-scheduler.kubeconfig" --leader-elect=false \
    --bind-address 127.0.0.1 --secure-port "$scheduler_port" \
    >"$dir/kube-scheduler.log" 2>&1 &
  echo $! >"$n/kube-scheduler.pid"

  deadline=$((SECONDS + 120))
  until "$BIN_DIR/kubectl" --kubeconfig "$dir/kubeconfig" get node "$NODE_NAME" \
    -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null | grep -qx True; do
    if [ $SECONDS -ge $deadline ]; then
      log "the node is not Ready after 120s; last log lines:"
      tail -n 20 "$dir/kubelet.log" "$dir/containerd.log" >&2 || true
      return 1
    fi
    local c
    for c in containerd kubelet kube-proxy kube-scheduler; do
      kill -0 "$(cat "$n/$c.pid")" 2>/dev/null || {
        log "$c exited; last log lines:"
        tail -n 30 "$dir/$c.log" >&2
        return 1
      }
    done
    sleep 0.5
  done
  log "node $NODE_NAME Ready at $NODE_IP (pods in $POD_SUBNET)"
}

# Imports OCI archives into the node's containerd, where kubelet finds them
# (`imagePullPolicy: IfNotPresent`).
node_load_images() {
  local dir=${1:?usage: load-images DIR ARCHIVE...}
  shift
  local sock=$dir/node/containerd/containerd.sock
  [ -S "$sock" ] || die "$dir has no node (start it with --node)"
  local archive
  for archive in "$@"; do
    ctr --address "$sock" -n k8s.io images import "$archive" >/dev/null ||
      die "failed to import $archive"
  done
}

# Stops a process by the PID in file $1: TERM, then KILL after 5 s.
stop_pid_file() {
  local f=$1 pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
}

# Removes the KUBE-* and CNI-* chains kubelet, kube-proxy and CNI plugins leave in every table,
# and this node's own rules.
node_clean_iptables() {
  local cmd table
  for cmd in iptables ip6tables; do
    command -v "$cmd" >/dev/null || continue
    for table in filter nat mangle raw; do
      "$cmd" -t "$table" -S >/dev/null 2>&1 || continue
      # Rules that jump to such chains, or carry our comment, in any chain: delete them.
      "$cmd" -t "$table" -S | awk -v c="$NODE_RULE_COMMENT" \
        '$1 == "-A" && ($0 ~ / -j (KUBE-|CNI-)/ || index($0, c) > 0) {sub(/^-A /, "-D "); print}' |
        while read -r rule; do
          eval "$cmd -t $table $rule" 2>/dev/null || true
        done
      local chains
      chains=$("$cmd" -t "$table" -S | awk '$1 == "-N" && $2 ~ /^(KUBE-|CNI-)/ {print $2}')
      for c in $chains; do "$cmd" -t "$table" -F "$c" 2>/dev/null || true; done
      for c in $chains; do "$cmd" -t "$table" -X "$c" 2>/dev/null || true; done
    done
  done
}

node_stop() {
  local dir=$1 n=$1/node
  [ -d "$n" ] || return 0
  local c
  for c in kube-scheduler kube-proxy kubelet; do stop_pid_file "$n/$c.pid"; done
  local sock=$n/containerd/containerd.sock
  if [ -S "$sock" ]; then
    # Every container of every pod, sandboxes included, then their shims.
    local ids
    ids=$(ctr --address "$sock" -n k8s.io tasks ls -q 2>/dev/null || true)
    for c in $ids; do ctr --address "$sock" -n k8s.io tasks kill -s SIGKILL "$c" >/dev/null 2>&1 || true; done
  fi
  stop_pid_file "$n/containerd.pid"
  # Shims outlive containerd by design; theirs are the ones with this node's socket.
  pkill -9 -f "containerd-shim-runc-v2 .*-address $sock" 2>/dev/null || true
  pkill -9 -f "$n/" 2>/dev/null || true
  sleep 0.2
  # Mounts under the node's directory (pod volumes, sandbox /dev/shm, rootfs overlays, network
  # namespaces), deepest first.
  local m
  for m in $(awk -v p="$n/" 'index($2, p) == 1 {print $2}' /proc/self/mounts | sort -r); do
    umount -l "$m" 2>/dev/null || true
  done
  ip link del "$NODE_BRIDGE" 2>/dev/null || true
  node_clean_iptables
  if [ -f "$n/ip_forward" ]; then cat "$n/ip_forward" >/proc/sys/net/ipv4/ip_forward; fi
  # Pod cgroups kubelet made, deepest first (a cgroup directory is removed with rmdir).
  local root
  for root in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/*/kubepods.slice /sys/fs/cgroup/kubepods; do
    [ -d "$root" ] || continue
    find "$root" -depth -type d -exec rmdir {} \; 2>/dev/null || true
  done
  # kubelet links every container's log into /var/log/containers.
  find /var/log/containers -maxdepth 1 -type l -lname "$n/*" -delete 2>/dev/null || true
  if [ "$(cat /run/controller-sharding-node 2>/dev/null)" = "$dir" ]; then
    rm -f /run/controller-sharding-node
  fi
}
