#!/usr/bin/env bash
# Starts a real Kubernetes control plane on loopback, with fake GPU nodes:
# etcd 3.6, kube-apiserver, kube-controller-manager, kube-scheduler and kwok
# (which plays the kubelets of the fake nodes: their pods go Running/Ready,
# nothing runs in them).
#
#   e2e/kube/up.sh [DIR]        # default DIR: <repo>/target/kube
#   e2e/kube/down.sh [DIR]      # stops it
#
# Builds the tools first if they are not cached (e2e/kube/install.sh; a cold
# build takes 10+ minutes). Every port is a free loopback port picked at start,
# so several clusters (several DIRs) can run side by side.
#
# Writes, in DIR:
#   kubeconfig   contexts kvfabric-e2e (bearer token, the default) and
#                kvfabric-e2e-cert (client certificate); both system:masters;
#                the server cert is signed by pki/ca.crt (SAN 127.0.0.1,
#                localhost), so clients verify TLS normally.
#   env          KEY=value lines (no quoting; DIR must have no spaces):
#                KUBECONFIG, KVFABRIC_KUBE_SERVER, KVFABRIC_KUBE_TOKEN,
#                KVFABRIC_KUBE_CA, KVFABRIC_KUBE_ETCD, KVFABRIC_KUBE_NODES,
#                KVFABRIC_KUBE_PATH (bin dirs of kubectl, helm, kwok, etcd),
#                KVFABRIC_KUBECTL, KVFABRIC_HELM, <COMPONENT>_PID,
#                KVFABRIC_KUBE_PIDS. Use: set -a; . DIR/env; set +a
#   logs/*.log   one per component;  *.pid  one per component
# On success the last line on stdout is KUBECONFIG=DIR/kubeconfig.
#
# Knobs: KVFABRIC_KUBE_NODES (2) fake nodes, KVFABRIC_KUBE_GPUS (8)
# nvidia.com/gpu per node, KVFABRIC_KUBE_TIMEOUT (90) seconds for each wait.
# A DIR whose cluster is already up and healthy is reused as it is.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
DIR="${1:-$repo/target/kube}"
NODES="${KVFABRIC_KUBE_NODES:-2}"
GPUS="${KVFABRIC_KUBE_GPUS:-8}"
TIMEOUT="${KVFABRIC_KUBE_TIMEOUT:-90}"
ETCD_VERSION="${KVFABRIC_ETCD_VERSION:-3.6.16}"
COMPONENTS=(etcd apiserver controller-manager scheduler kwok)

say() { echo "up.sh: $*" >&2; }
die() { echo "up.sh: error: $*" >&2; exit 1; }

case "$DIR" in *[[:space:]]*) die "DIR must not contain whitespace: '$DIR'" ;; esac
for c in curl openssl; do
  command -v "$c" >/dev/null 2>&1 || die "'$c' is needed (Debian package $c)"
done
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
t_start="$(date +%s.%N)"

# --- tools ---------------------------------------------------------------------
"$here/install.sh" --quiet || die "install.sh failed"
KPATH="$("$here/install.sh" --path)"
IFS=: read -r K8S_BIN ETCD_BIN_DIR KWOK_BIN HELM_BIN <<<"$KPATH"
KWOK_STAGE="$(dirname "$KWOK_BIN")/stage"
KUBECTL="$K8S_BIN/kubectl"
ETCD="$ETCD_BIN_DIR/etcd-$ETCD_VERSION"
[ -x "$ETCD" ] || die "$ETCD missing (KVFABRIC_ETCD_VERSION mismatch?)"

kc() { "$KUBECTL" --kubeconfig "$DIR/kubeconfig" --request-timeout=10s "$@"; }

pid_of() { cat "$DIR/$1.pid" 2>/dev/null || true; }
# For a pid file left by an EARLIER run (the reuse check): alive and ours,
# i.e. the process's command line names DIR (every component is started
# with a path under DIR), so a recycled pid is never taken for it. That
# process has long exec'd, so its command line is its final one.
ours() {
  local pid; pid="$(pid_of "$1")"
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "$DIR/"
}
# For a component THIS run started: `start` kept the pid of its own child
# ($!) in STARTED, so that pid is ours by construction and alive (kill -0)
# is enough. No command-line check here: right after `start` the child may
# not have exec'd yet (its /proc/PID/cmdline then reads empty or names
# setsid), which once made a live controller-manager look exited. The pid
# cannot be recycled under us either: the child is ours, and bash reaps it
# (on SIGCHLD) only after it exited, when kill -0 already fails.
declare -A STARTED=()
running() {
  local pid="${STARTED[$1]:-}"
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

# --- reuse a healthy cluster -------------------------------------------------------
if [ -f "$DIR/env" ]; then
  all=1
  for c in "${COMPONENTS[@]}"; do ours "$c" || all=0; done
  if [ "$all" = 1 ] && kc get --raw /readyz >/dev/null 2>&1; then
    say "cluster in $DIR is already up; reusing it"
    echo "KUBECONFIG=$DIR/kubeconfig"
    exit 0
  fi
  say "stale cluster state in $DIR; stopping what is left of it"
  "$here/down.sh" "$DIR" >&2 || true
fi

# --- free loopback ports --------------------------------------------------------------
# Below the ephemeral range (32768+), so no outgoing connection holds them.
picked=" "
free_port() {
  local p _
  for _ in $(seq 500); do
    p=$(( 20000 + RANDOM % 12000 ))
    case "$picked" in *" $p "*) continue ;; esac
    if command -v ss >/dev/null 2>&1; then
      ss -Htan "( sport = :$p )" 2>/dev/null | grep -q . && continue
    fi
    (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null && continue
    picked="$picked$p "
    PORT="$p"
    return 0
  done
  die "no free loopback port found"
}

# --- waiting -------------------------------------------------------------------------------
# wait_for WHAT COMPONENT CMD...: polls CMD every 0.2 s for TIMEOUT s; fails
# early if COMPONENT's process died, showing its log.
wait_for() {
  local what="$1" comp="$2"; shift 2
  local deadline=$(( $(date +%s) + TIMEOUT ))
  while :; do
    "$@" >/dev/null 2>&1 && return 0
    if [ -n "$comp" ] && ! running "$comp"; then
      fail "$comp exited while waiting for $what" "$comp"
      return 1
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
      fail "timed out after ${TIMEOUT}s waiting for $what" "$comp"
      return 1
    fi
    sleep 0.2
  done
}
fail() {
  say "$1"
  if [ -n "${2:-}" ] && [ -f "$DIR/logs/$2.log" ]; then
    say "last lines of $DIR/logs/$2.log:"
    tail -n 25 "$DIR/logs/$2.log" | sed 's/^/    /' >&2
  fi
  if [ "${2:-}" = apiserver ] && running apiserver; then
    say "failing /readyz checks:"
    curl -sS --max-time 3 --cacert "$DIR/pki/ca.crt" -H "Authorization: Bearer $TOKEN" \
      "$SERVER/readyz?verbose" 2>&1 | grep -v '\] ok$' | sed 's/^/    /' >&2 || true
  fi
}

start() { # start NAME BIN ARGS...: detached (own session), logs to DIR/logs/NAME.log
  local name="$1"; shift
  setsid "$@" >"$DIR/logs/$name.log" 2>&1 </dev/null &
  STARTED[$name]=$!
  echo $! >"$DIR/$name.pid"
}

# --- PKI: CA, apiserver serving cert, admin client cert, service-account keys ---------
make_pki() {
  local p="$DIR/pki"
  rm -rf "$p"; mkdir -p "$p"
  local ec=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
  openssl req -x509 "${ec[@]}" -keyout "$p/ca.key" -out "$p/ca.crt" -days 3650 \
    -subj "/CN=kvfabric-e2e-ca" -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" 2>>"$DIR/logs/pki.log"
  sign() { # sign NAME SUBJECT EXTENSIONS
    openssl req "${ec[@]}" -keyout "$p/$1.key" -out "$p/$1.csr" -subj "$2" 2>>"$DIR/logs/pki.log"
    printf '%b' "$3" >"$p/$1.ext"
    openssl x509 -req -in "$p/$1.csr" -CA "$p/ca.crt" -CAkey "$p/ca.key" -CAcreateserial \
      -days 3650 -out "$p/$1.crt" -extfile "$p/$1.ext" 2>>"$DIR/logs/pki.log"
    rm -f "$p/$1.csr" "$p/$1.ext"
  }
  sign apiserver "/CN=kube-apiserver" \
    "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:10.96.0.1\n"
  sign admin "/O=system:masters/CN=kvfabric-admin" \
    "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n"
  openssl genrsa -out "$p/sa.key" 2048 2>>"$DIR/logs/pki.log"
  openssl rsa -in "$p/sa.key" -pubout -out "$p/sa.pub" 2>>"$DIR/logs/pki.log"
  TOKEN="$(openssl rand -hex 24)"
  echo "$TOKEN,kvfabric-admin,kvfabric-admin,\"system:masters\"" >"$p/tokens.csv"
  chmod 600 "$p"/*.key "$p/tokens.csv"
}

write_kubeconfig() {
  b64() { base64 -w0 <"$1"; }
  cat >"$DIR/kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: kvfabric-e2e
  cluster:
    server: $SERVER
    certificate-authority-data: $(b64 "$DIR/pki/ca.crt")
users:
- name: kvfabric-admin
  user:
    token: $TOKEN
- name: kvfabric-admin-cert
  user:
    client-certificate-data: $(b64 "$DIR/pki/admin.crt")
    client-key-data: $(b64 "$DIR/pki/admin.key")
contexts:
- name: kvfabric-e2e
  context:
    cluster: kvfabric-e2e
    user: kvfabric-admin
    namespace: default
- name: kvfabric-e2e-cert
  context:
    cluster: kvfabric-e2e
    user: kvfabric-admin-cert
    namespace: default
current-context: kvfabric-e2e
EOF
  chmod 600 "$DIR/kubeconfig"
}

node_manifests() {
  local i
  for i in $(seq 0 $(( NODES - 1 ))); do
    cat <<EOF
---
apiVersion: v1
kind: Node
metadata:
  name: kwok-gpu-$i
  annotations:
    node.alpha.kubernetes.io/ttl: "0"
    kwok.x-k8s.io/node: fake
  labels:
    type: kwok
    kubernetes.io/hostname: kwok-gpu-$i
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64
    node-role.kubernetes.io/agent: ""
    nvidia.com/gpu.present: "true"
    nvidia.com/gpu.count: "$GPUS"
    nvidia.com/gpu.product: NVIDIA-H200
spec: {}
status:
  addresses: [{type: InternalIP, address: 10.0.0.$(( i + 1 ))}, {type: Hostname, address: kwok-gpu-$i}]
  allocatable: {cpu: "64", memory: 512Gi, pods: "110", nvidia.com/gpu: "$GPUS", ephemeral-storage: 1Ti}
  capacity: {cpu: "64", memory: 512Gi, pods: "110", nvidia.com/gpu: "$GPUS", ephemeral-storage: 1Ti}
EOF
  done
}

nodes_ready() {
  local out
  out="$(kc get nodes -l type=kwok -o jsonpath='{range .items[*]}{.metadata.name}{" "}{.status.conditions[?(@.type=="Ready")].status}{" "}{.spec.taints}{"\n"}{end}')" || return 1
  [ "$(grep -c ' True $' <<<"$out")" -eq "$NODES" ]
}

bring_up() {
  rm -rf "$DIR/etcd" "$DIR/logs" "$DIR"/*.pid "$DIR/env" "$DIR/kubeconfig"
  mkdir -p "$DIR/logs"
  picked=" "
  free_port; local etcd_port=$PORT
  free_port; local peer_port=$PORT
  free_port; local api_port=$PORT
  free_port; local cm_port=$PORT
  free_port; local sched_port=$PORT
  ETCD_URL="http://127.0.0.1:$etcd_port"
  SERVER="https://127.0.0.1:$api_port"
  make_pki
  write_kubeconfig
  local t0; t0="$(date +%s.%N)"

  start etcd "$ETCD" --name e2e --data-dir "$DIR/etcd" \
    --listen-client-urls "$ETCD_URL" --advertise-client-urls "$ETCD_URL" \
    --listen-peer-urls "http://127.0.0.1:$peer_port" \
    --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
    --initial-cluster "e2e=http://127.0.0.1:$peer_port" \
    --unsafe-no-fsync --logger zap --log-level warn
  wait_for "etcd $ETCD_URL/health" etcd sh -c "curl -fsS --max-time 2 '$ETCD_URL/health' | grep -q '\"health\":\"true\"'" || return 1

  start apiserver "$K8S_BIN/kube-apiserver" \
    --etcd-servers "$ETCD_URL" \
    --bind-address 127.0.0.1 --secure-port "$api_port" \
    --advertise-address 127.0.0.1 --endpoint-reconciler-type none \
    --tls-cert-file "$DIR/pki/apiserver.crt" --tls-private-key-file "$DIR/pki/apiserver.key" \
    --client-ca-file "$DIR/pki/ca.crt" \
    --token-auth-file "$DIR/pki/tokens.csv" \
    --authorization-mode RBAC \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-key-file "$DIR/pki/sa.pub" \
    --service-account-signing-key-file "$DIR/pki/sa.key" \
    --service-cluster-ip-range 10.96.0.0/16 \
    --allow-privileged=true --profiling=false
  wait_for "kube-apiserver $SERVER/readyz" apiserver \
    curl -fsS --max-time 3 --cacert "$DIR/pki/ca.crt" -H "Authorization: Bearer $TOKEN" "$SERVER/readyz" || return 1
  local t_api; t_api="$(date +%s.%N)"

  node_manifests | kc apply -f - >/dev/null || { fail "creating the fake nodes failed"; return 1; }

  start controller-manager "$K8S_BIN/kube-controller-manager" \
    --kubeconfig "$DIR/kubeconfig" \
    --authentication-kubeconfig "$DIR/kubeconfig" --authorization-kubeconfig "$DIR/kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$cm_port" --cert-dir "$DIR/pki/controller-manager" \
    --leader-elect=false \
    --service-account-private-key-file "$DIR/pki/sa.key" --root-ca-file "$DIR/pki/ca.crt" \
    --use-service-account-credentials=false --profiling=false
  start scheduler "$K8S_BIN/kube-scheduler" \
    --kubeconfig "$DIR/kubeconfig" \
    --authentication-kubeconfig "$DIR/kubeconfig" --authorization-kubeconfig "$DIR/kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$sched_port" --cert-dir "$DIR/pki/scheduler" \
    --leader-elect=false --profiling=false
  # kwok: the kubelet of every node labelled type=kwok; the stages are
  # kwokctl's defaults (node fast + lease heartbeat, pod fast).
  # (No KwokConfiguration document: given one, kwok 0.8.0 skips its
  # defaults and fails on "playStageParallelism must be greater than 0".)
  # Node leases of 40 s must be asked for (--node-lease-duration-seconds):
  # without them the heartbeat stage (every 600 s) relies on leases kwok
  # never renews, and the node lifecycle controller marks every node
  # NotReady 50 s after start (found by the chaos suite: the operator then
  # tombstoned every pod of the node).
  {
    for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
             pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
      [ -f "$KWOK_STAGE/$f" ] || { fail "kwok stage $KWOK_STAGE/$f missing"; return 1; }
      echo "---"; cat "$KWOK_STAGE/$f"
    done
  } >"$DIR/kwok.yaml"
  start kwok "$KWOK_BIN/kwok" --kubeconfig "$DIR/kubeconfig" --config "$DIR/kwok.yaml" \
    --manage-all-nodes=false --manage-nodes-with-label-selector type=kwok --node-lease-duration-seconds 40 \
    --cidr 10.244.0.1/16 --node-ip 10.0.0.1

  wait_for "kube-controller-manager /healthz" controller-manager \
    curl -fsSk --max-time 3 "https://127.0.0.1:$cm_port/healthz" || return 1
  wait_for "kube-scheduler /healthz" scheduler \
    curl -fsSk --max-time 3 "https://127.0.0.1:$sched_port/healthz" || return 1
  wait_for "$NODES fake node(s) Ready and untainted" kwok nodes_ready || return 1
  # Pods are refused until the serviceaccount controller made "default".
  wait_for "service account default/default" controller-manager kc get serviceaccount default -n default || return 1
  local t_end; t_end="$(date +%s.%N)"

  local pids="" c v
  {
    echo "KUBECONFIG=$DIR/kubeconfig"
    echo "KVFABRIC_KUBE_DIR=$DIR"
    echo "KVFABRIC_KUBE_SERVER=$SERVER"
    echo "KVFABRIC_KUBE_TOKEN=$TOKEN"
    echo "KVFABRIC_KUBE_CA=$DIR/pki/ca.crt"
    echo "KVFABRIC_KUBE_ETCD=$ETCD_URL"
    echo "KVFABRIC_KUBE_NODES=$(seq -s, -f 'kwok-gpu-%g' 0 $(( NODES - 1 )))"
    echo "KVFABRIC_KUBE_PATH=$KPATH"
    echo "KVFABRIC_KUBECTL=$KUBECTL"
    echo "KVFABRIC_HELM=$HELM_BIN/helm"
    for c in "${COMPONENTS[@]}"; do
      v="$(tr 'a-z-' 'A-Z_' <<<"$c")_PID"
      echo "$v=$(pid_of "$c")"
      pids="${pids:+$pids,}$(pid_of "$c")"
    done
    echo "KVFABRIC_KUBE_PIDS=$pids"
  } >"$DIR/env.tmp"
  mv "$DIR/env.tmp" "$DIR/env"
  say "$(awk -v a="$t_start" -v b="$t0" -v c="$t_api" -v d="$t_end" -v n="$NODES" -v g="$GPUS" 'BEGIN {
    printf "up in %.1f s (apiserver ready %.1f s after etcd start; %d node(s) with %d nvidia.com/gpu each)", d - a, c - b, n, g }')"
  say "server $SERVER, etcd $ETCD_URL, logs in $DIR/logs; stop with e2e/kube/down.sh $DIR"
}

attempt=1
while :; do
  # In a subshell with errexit live (it is not inside `if`/`||`), so any
  # failing step stops the attempt, and says where.
  set +e
  (
    set -eE
    trap '[ "$BASH_COMMAND" = "return 1" ] || say "failed: $BASH_COMMAND (line $LINENO)"' ERR
    bring_up
  )
  rc=$?
  set -e
  if [ "$rc" = 0 ]; then
    echo "KUBECONFIG=$DIR/kubeconfig"
    exit 0
  fi
  # A port taken between picking and binding: pick again (at most 3 tries).
  if [ "$attempt" -lt 3 ] && grep -qs "address already in use" "$DIR"/logs/*.log; then
    say "a port was taken meanwhile; retrying with new ports"
    "$here/down.sh" "$DIR" >&2 || true
    attempt=$((attempt + 1))
    continue
  fi
  "$here/down.sh" "$DIR" >&2 || true
  die "the control plane did not come up (logs kept in $DIR/logs)"
done
