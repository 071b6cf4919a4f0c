#!/usr/bin/env bash
# One-time set-up of a fresh machine for building and testing kvfabric.
# Idempotent: re-running only installs what is missing.
#   - Debian packages: libclang-dev (bindgen for nixl-sys), protobuf-compiler
#     and libprotobuf-dev (etcd-client: protoc plus the well-known .proto
#     files), etcd-server/etcd-client (discovery tests), cmake/g++
#     (vendored libzmq), python3-pip (the NIXL wheel download), python3-venv
#     (agent/python/run-tests.sh's venv), prometheus (promtool: `promtool
#     check metrics` on a live /metrics), openssl/curl/iproute2
#     (e2e/kube/up.sh; ip for the chaos suite's network namespaces), and
#     with --tests nftables (the chaos suite's network faults). Go (for e2e/kube/install.sh)
#     comes with the machine.
#   - the NIXL runtime libraries (e2e/install-nixl.sh) into .nixl/lib.
#   - with --tests (README's test command): also the Kubernetes control
#     plane the operator, chart and chaos suites start (kube-apiserver,
#     controller-manager, scheduler, kubectl, etcd 3.6, kwok, helm), built
#     from the Go module proxy by e2e/kube/install.sh and cached in
#     ~/.cache/kvfabric/tools by version: 11-26 min once, then a no-op;
#     and the real-model hand-off's Python environment (torch +
#     transformers, e2e/model/install-venv.sh) in ~/.cache/kvfabric by
#     version: ~5.6 GiB and ~4 min once.
#
#   e2e/setup.sh [--tests]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tests=0
for arg in "$@"; do
  case "$arg" in
    --tests) tests=1 ;;
    *) echo "setup: unknown argument '$arg' (expected --tests)" >&2; exit 2 ;;
  esac
done

need=()
[ -e /usr/lib/llvm-14/lib/libclang.so ] || ls /usr/lib/llvm-*/lib/libclang.so >/dev/null 2>&1 || need+=(libclang-dev)
command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
# protoc alone cannot build etcd-client: its protos import the well-known
# types (google/protobuf/*.proto), which only libprotobuf-dev ships; with
# --no-install-recommends protobuf-compiler leaves it out.
[ -e /usr/include/google/protobuf/descriptor.proto ] || need+=(libprotobuf-dev)
command -v etcd >/dev/null 2>&1 || need+=(etcd-server etcd-client)
command -v cmake >/dev/null 2>&1 || need+=(cmake)
# promtool (Debian prometheus): the metrics test checks a live /metrics.
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v g++ >/dev/null 2>&1 || need+=(g++)
# e2e/kube/up.sh (the operator tests' control plane): certificates,
# health probes, port checks.
command -v openssl >/dev/null 2>&1 || need+=(openssl)
command -v curl >/dev/null 2>&1 || need+=(curl)
# ss and ip (iproute2): e2e/kube/up.sh, and the chaos suite's network
# namespaces (ip netns, veth, bridge).
{ command -v ss && command -v ip; } >/dev/null 2>&1 || need+=(iproute2)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
# install-nixl.sh downloads the NIXL wheel with pip.
command -v python3 >/dev/null 2>&1 || need+=(python3)
python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
# agent/python/run-tests.sh makes a venv; Debian ships ensurepip (which
# `python3 -m venv` needs) in python3-venv.
python3 -c 'import ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
# --tests: the chaos suite's network faults (partition-agent, control-loss)
# put nftables rules in (nft; the kernel's nf_tables).
if [ "$tests" = 1 ]; then
  command -v nft >/dev/null 2>&1 || need+=(nftables)
fi
if [ "${#need[@]}" -gt 0 ]; then
  echo "setup: installing Debian packages: ${need[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

"$repo/e2e/install-nixl.sh"
if [ "$tests" = 1 ]; then
  echo "setup: the control-plane tools (e2e/kube/install.sh; cached after the first build)"
  "$repo/e2e/kube/install.sh" --quiet
  echo "setup: the model hand-off's torch + transformers venv (e2e/model/install-venv.sh; cached after the first build)"
  "$repo/e2e/model/install-venv.sh" --quiet >/dev/null
fi
echo "setup: done"
