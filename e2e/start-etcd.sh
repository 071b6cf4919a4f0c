#!/usr/bin/env bash
# Starts a single-member etcd for kvfabric's distributed mode (agents
# discover each other under /kvfabric/<fabric>/agents/) and waits until it is
# healthy. Usage:
#   e2e/start-etcd.sh [start] [CLIENT_PORT] [DATA_DIR]   # default 2379, .etcd
#   e2e/start-etcd.sh stop [CLIENT_PORT] [DATA_DIR]
# Prints the client endpoint (e.g. http://127.0.0.1:2379) on success. The
# pid is kept in DATA_DIR/etcd.pid, the log in DATA_DIR/etcd.log.
# Install etcd with e2e/setup.sh (Debian etcd-server).
set -euo pipefail
cmd="start"
case "${1:-}" in start|stop) cmd="$1"; shift ;; esac
port="${1:-2379}"
dir="${2:-.etcd}"
peer_port=$((port + 1))
pidfile="$dir/etcd.pid"

if [ "$cmd" = "stop" ]; then
  if [ -f "$pidfile" ]; then
    pid="$(cat "$pidfile")"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    rm -f "$pidfile"
  fi
  exit 0
fi

etcd_bin="${KVFABRIC_ETCD_BIN:-$(command -v etcd || echo /usr/bin/etcd)}"
[ -x "$etcd_bin" ] || { echo "start-etcd: etcd not installed (run e2e/setup.sh)" >&2; exit 1; }
mkdir -p "$dir"
if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
  echo "http://127.0.0.1:$port"
  exit 0
fi
client="http://127.0.0.1:$port"
peer="http://127.0.0.1:$peer_port"
nohup "$etcd_bin" --name kvfabric --data-dir "$dir/data" \
  --listen-client-urls "$client" --advertise-client-urls "$client" \
  --listen-peer-urls "$peer" --initial-advertise-peer-urls "$peer" \
  --initial-cluster "kvfabric=$peer" --logger zap --log-level warn \
  >"$dir/etcd.log" 2>&1 </dev/null &
echo $! >"$pidfile"
healthy() {
  if command -v curl >/dev/null 2>&1; then
    curl -fsS "$client/health" 2>/dev/null | grep -q '"health":"true"'
  else
    ETCDCTL_API=3 etcdctl --endpoints "$client" endpoint health >/dev/null 2>&1
  fi
}
for _ in $(seq 100); do
  if healthy; then
    echo "$client"
    exit 0
  fi
  kill -0 "$(cat "$pidfile")" 2>/dev/null || break
  sleep 0.1
done
echo "start-etcd: etcd did not become healthy; see $dir/etcd.log" >&2
exit 1
