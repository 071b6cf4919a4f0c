#!/usr/bin/env bash
# Regenerates the Python stubs of the engine API (kvfabric/_proto/) from
# agent/proto/kvfabric/v1/engine.proto with grpcio-tools (pinned in
# pyproject.toml's `dev` extra: the generated code checks grpcio and
# protobuf versions at import, so the generator version is part of the
# contract).
#   agent/python/regen.sh           # rewrite kvfabric/_proto/engine_pb2*.py*
#   agent/python/regen.sh --check   # regenerate into a temp dir, diff, exit 1 if stale
# PYTHON picks the interpreter (default: python3), e.g. PYTHON=.venv/bin/python.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
py="${PYTHON:-python3}"
check=0
case "${1:-}" in
  --check) check=1 ;;
  "") ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac
want="$(sed -n 's/.*"grpcio-tools==\([0-9.]*\)".*/\1/p' "$here/pyproject.toml")"
have="$("$py" -c 'import importlib.metadata as m; print(m.version("grpcio-tools"))' 2>/dev/null || true)"
if [ -z "$have" ]; then
  echo "regen: grpcio-tools is not installed for $py (pip install '$here[dev]')" >&2
  exit 1
fi
if [ "$have" != "$want" ]; then
  echo "regen: grpcio-tools $have installed for $py, pyproject.toml pins $want" >&2
  exit 1
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$py" -m grpc_tools.protoc -I "$repo/agent/proto" \
  --python_out="$tmp" --grpc_python_out="$tmp" --pyi_out="$tmp" \
  "$repo/agent/proto/kvfabric/v1/engine.proto"
gen="$tmp/kvfabric/v1"
# The stubs live in the package kvfabric._proto, not in a top-level
# `kvfabric.v1` package: import the messages relatively.
sed -i 's/^from kvfabric\.v1 import engine_pb2 as /from . import engine_pb2 as /' "$gen/engine_pb2_grpc.py"
grep -q '^from \. import engine_pb2 as ' "$gen/engine_pb2_grpc.py" || {
  echo "regen: the generated engine_pb2_grpc.py no longer imports kvfabric.v1.engine_pb2; fix regen.sh" >&2
  exit 1
}
files=(engine_pb2.py engine_pb2.pyi engine_pb2_grpc.py)
out="$here/kvfabric/_proto"
if [ "$check" = 1 ]; then
  stale=0
  for f in "${files[@]}"; do
    diff -u "$out/$f" "$gen/$f" || stale=1
  done
  if [ "$stale" = 1 ]; then
    echo "regen: agent/python/kvfabric/_proto is stale: run agent/python/regen.sh" >&2
    exit 1
  fi
  echo "regen: stubs up to date (grpcio-tools $have)"
else
  mkdir -p "$out"
  for f in "${files[@]}"; do cp "$gen/$f" "$out/$f"; done
  echo "regen: wrote ${files[*]} to $out"
fi
