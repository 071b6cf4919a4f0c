#!/usr/bin/env bash
# End-to-end check of the e2e Kubernetes: brings a cluster up in DIR (or
# reuses one), checks the fake GPU nodes, that a 2-replica Deployment and a
# DaemonSet get their pods Running on them, that `helm install --wait`
# of a fresh chart succeeds, then stops the cluster unless --keep.
#
#   e2e/kube/smoke.sh [DIR] [--keep]     # default DIR: <repo>/target/kube-smoke
#
# Ends with 'N passed, N failed'; exits non-zero on any failure.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
keep=0
DIR=""
for a in "$@"; do
  case "$a" in
    --keep) keep=1 ;;
    *) DIR="$a" ;;
  esac
done
DIR="${DIR:-$repo/target/kube-smoke}"
POD_TIMEOUT="${KVFABRIC_KUBE_POD_TIMEOUT:-30}"

passed=0
failed=0
check() { # check NAME CMD...
  local name="$1"; shift
  local t0 out; t0="$(date +%s.%N)"
  if out="$("$@" 2>&1)"; then
    passed=$((passed + 1))
    printf 'ok   %-52s %6.2f s\n' "$name" "$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{print b-a}')"
  else
    failed=$((failed + 1))
    printf 'FAIL %s\n' "$name"
    printf '%s\n' "$out" | sed 's/^/     /'
  fi
}
finish() {
  if [ "$keep" = 0 ]; then "$here/down.sh" "$DIR" 2>/dev/null; fi
  echo "$passed passed, $failed failed"
  [ "$failed" = 0 ]
}

if ! "$here/up.sh" "$DIR" >/dev/null; then
  failed=1
  echo "FAIL e2e/kube/up.sh $DIR"
  finish
  exit 1
fi
passed=1
echo "ok   e2e/kube/up.sh"
set -a
# shellcheck disable=SC1091
. "$DIR/env"
set +a
export PATH="$KVFABRIC_KUBE_PATH:$PATH"
k() { kubectl --request-timeout=10s "$@"; }

gpu_nodes() {
  local out
  out="$(k get nodes -l nvidia.com/gpu.present=true -o jsonpath='{range .items[*]}{.metadata.name}={.status.allocatable.nvidia\.com/gpu}/{.status.conditions[?(@.type=="Ready")].status}{" "}{end}')"
  echo "$out"
  [ "$(grep -o '=8/True' <<<"$out" | wc -l)" -ge 2 ]
}
check "fake GPU nodes Ready with nvidia.com/gpu=8" gpu_nodes
versions() {
  local v; v="$(k version -o json)" || return 1
  grep '"gitVersion"' <<<"$v"
  [ "$(grep -c '"gitVersion": "v1\.37\.' <<<"$v")" = 2 ]
}
check "kubectl and kube-apiserver are v1.37" versions

pods_running() { # pods_running SELECTOR COUNT
  local deadline=$(( $(date +%s) + POD_TIMEOUT )) out n
  while :; do
    out="$(k get pods -l "$1" -o jsonpath='{range .items[*]}{.metadata.name} {.spec.nodeName} {.status.phase}{"\n"}{end}')"
    n="$(grep -c ' Running$' <<<"$out")"
    [ "$n" -ge "$2" ] && { echo "$out"; return 0; }
    [ "$(date +%s)" -ge "$deadline" ] && { echo "only $n of $2 Running after ${POD_TIMEOUT}s:"; echo "$out"; k get events --sort-by=.lastTimestamp | tail -n 15; return 1; }
    sleep 0.2
  done
}
deploy() {
  k create deployment smoke-deploy --image=registry.invalid/none:0 --replicas=2 >/dev/null &&
    pods_running app=smoke-deploy 2
}
daemonset() {
  k apply -f - >/dev/null <<'EOF' &&
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: smoke-ds}
spec:
  selector: {matchLabels: {app: smoke-ds}}
  template:
    metadata: {labels: {app: smoke-ds}}
    spec:
      nodeSelector: {nvidia.com/gpu.present: "true"}
      containers:
      - name: c
        image: registry.invalid/none:0
        resources: {limits: {nvidia.com/gpu: 1}}
EOF
    pods_running app=smoke-ds "$(k get nodes -l nvidia.com/gpu.present=true -o name | wc -l)"
}
check "Deployment (2 replicas) pods Running" deploy
check "DaemonSet pods Running on every GPU node (1 GPU each)" daemonset
check "helm version" sh -c 'helm version --short | grep -q "^v3\."'
helm_install() {
  local d; d="$(mktemp -d)"
  helm create "$d/smoke" >/dev/null &&
    helm lint "$d/smoke" >/dev/null &&
    helm install smoke "$d/smoke" --set image.repository=registry.invalid/none --wait --timeout 60s >/dev/null &&
    helm status smoke | grep -q '^STATUS: deployed'
  local rc=$?
  rm -rf "$d"
  return "$rc"
}
check "helm install --wait of a fresh chart" helm_install
finish
