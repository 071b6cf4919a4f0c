#!/usr/bin/env bash
# Installs PyPI kubernetes-validate (pinned) into its own venv under the
# tools cache, once; prints the path of its `kubernetes-validate` script.
# Idempotent: a cached venv is reused (≈ 10 ms). Used by
# operator/tests/chart_template.rs.
#   charts/kvfabric/tests/kubernetes-validate.sh [--quiet]
set -euo pipefail
VERSION="${KVFABRIC_K8S_VALIDATE_VERSION:-1.37.0}"
cache="${KVFABRIC_TOOLS_CACHE:-$HOME/.cache/kvfabric/tools}"
venv="$cache/kubernetes-validate-$VERSION"
bin="$venv/bin/kubernetes-validate"
if [ ! -x "$bin" ] || ! "$bin" --version >/dev/null 2>&1; then
  echo "kubernetes-validate.sh: installing kubernetes-validate==$VERSION into $venv" >&2
  rm -rf "$venv"
  mkdir -p "$cache"
  python3 -m venv "$venv" >&2 || {
    echo "kubernetes-validate.sh: python3 -m venv failed (Debian: python3-venv; e2e/setup.sh installs it)" >&2
    exit 1
  }
  PIP_DISABLE_PIP_VERSION_CHECK=1 "$venv/bin/python" -m pip install --quiet "kubernetes-validate==$VERSION" >&2
fi
echo "$bin"
