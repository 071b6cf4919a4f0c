#!/usr/bin/env bash
# The Python environment of the real-model hand-off (e2e/model/handoff.py)
# for CI's CPU variant: torch + transformers (pinned) and the kvfabric
# client's dependencies, in a venv cached outside the repository, keyed by
# the versions: built once (PyPI's torch brings its CUDA wheels: about
# 5.6 GiB and 4 minutes here), then reused. Prints the venv's python.
#
#   e2e/model/install-venv.sh [--quiet]
#
# KVFABRIC_MODEL_VENV overrides the location.
set -euo pipefail
TORCH=2.15.0
TRANSFORMERS=5.24.0
quiet=0
[ "${1:-}" = "--quiet" ] && quiet=1
cache="${XDG_CACHE_HOME:-$HOME/.cache}/kvfabric"
venv="${KVFABRIC_MODEL_VENV:-$cache/model-venv-torch$TORCH-transformers$TRANSFORMERS}"
if [ -f "$venv/.complete" ]; then
  [ "$quiet" = 1 ] || echo "model venv: cached at $venv" >&2
  echo "$venv/bin/python"
  exit 0
fi
command -v python3 >/dev/null || { echo "install-venv: python3 not found (run e2e/setup.sh)" >&2; exit 1; }
echo "model venv: building $venv (torch $TORCH, transformers $TRANSFORMERS; ~5.6 GiB, once)" >&2
rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
python3 -m venv "$venv" >&2
export PIP_DISABLE_PIP_VERSION_CHECK=1
# --no-cache-dir: the wheels would double the disk taken.
"$venv/bin/python" -m pip install --quiet --no-cache-dir \
  "torch==$TORCH" "transformers==$TRANSFORMERS" \
  "grpcio>=1.76.0" "protobuf>=6.31.1,<8" "numpy>=1.21" >&2
"$venv/bin/python" -c 'import torch, transformers, grpc; print("model venv: torch", torch.__version__, "transformers", transformers.__version__)' >&2
touch "$venv/.complete"
echo "$venv/bin/python"
