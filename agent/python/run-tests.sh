#!/usr/bin/env bash
# Runs the Python client's tests: creates the venv .venv at the repository
# root if missing, installs the package with its test and dev extras (pytest,
# numpy, grpcio-tools; no torch), checks the generated stubs are not stale
# (regen.sh --check), and runs pytest. Extra arguments go to pytest.
#
# The tests against real agents use target/debug/kvfabric (or $KVFABRIC_BIN;
# build it first: cargo build -p kvfabric-agent --bin kvfabric) and etcd
# (e2e/setup.sh installs it); they skip with the reason printed when one is
# missing, and fail instead under KVFABRIC_REQUIRE_SERVICES=1.
# Wheels come from pip's cache (~/.cache/pip) once downloaded.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="$repo/.venv"
cd "$repo"

if [ ! -x "$venv/bin/python" ]; then
  echo "run-tests: creating $venv"
  python3 -m venv "$venv" || {
    echo "run-tests: python3 -m venv failed (Debian: apt-get install python3-venv, or run e2e/setup.sh)" >&2
    exit 1
  }
fi
# Keep the venv out of git without touching the repository's .gitignore.
[ -e "$venv/.gitignore" ] || printf '*\n' >"$venv/.gitignore"

py="$venv/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$py" -m pip install --quiet "$here[test,dev]"
# A local directory of an unchanged version may be kept as it was: install
# this tree's code for sure.
"$py" -m pip install --quiet --no-deps --force-reinstall "$here"

PYTHON="$py" "$here/regen.sh" --check

echo "run-tests: agent binary: ${KVFABRIC_BIN:-$repo/target/debug/kvfabric}; etcd: ${KVFABRIC_ETCD_BIN:-$(command -v etcd || echo none)}"
# Run from the repository root with the venv's pytest, so `import kvfabric`
# is the installed package, not the source tree.
exec "$venv/bin/pytest" "$here/tests" "$@"
