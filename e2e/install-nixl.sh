#!/usr/bin/env bash
# Installs the NIXL runtime libraries kvfabric loads at run time (nixl-sys is
# built with `stub-api`, which dlopen()s libnixl_capi.so).
#
# Source: the PyPI wheel nixl-cu12 (pinned below). Only the minimal set that
# loads is kept (see ../shared/DESIGN.md "NIXL from Rust"): the NIXL core
# libraries, the UCX backend plugin, UCX itself with its cma (and, for GPUs,
# cuda) transport modules, and the etcd/grpc/absl chain libnixl links against.
#
# Usage: e2e/install-nixl.sh [DEST]
#   DEST defaults to $KVFABRIC_NIXL_DIR or <repo>/.nixl/lib.
# The wheel is cached in ${XDG_CACHE_HOME:-~/.cache}/kvfabric/wheels; the
# extracted set is reused when its stamp matches the pinned version.
set -euo pipefail

NIXL_WHEEL_PKG="${NIXL_WHEEL_PKG:-nixl-cu12}"
NIXL_VERSION="${NIXL_VERSION:-1.5.1}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="${1:-${KVFABRIC_NIXL_DIR:-$repo/.nixl/lib}}"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/kvfabric/wheels"
stamp="$dest/.installed-$NIXL_WHEEL_PKG-$NIXL_VERSION"

if [ -f "$stamp" ] && [ -e "$dest/libnixl_capi.so" ]; then
  echo "install-nixl: $NIXL_WHEEL_PKG $NIXL_VERSION already in $dest"
  exit 0
fi

mkdir -p "$cache"
wheel="$(ls "$cache"/"${NIXL_WHEEL_PKG//-/_}"-"$NIXL_VERSION"-*.whl 2>/dev/null | head -n1 || true)"
if [ -z "$wheel" ]; then
  echo "install-nixl: downloading $NIXL_WHEEL_PKG==$NIXL_VERSION from PyPI"
  python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version 3.11 --platform manylinux_2_28_x86_64 \
    "$NIXL_WHEEL_PKG==$NIXL_VERSION" -d "$cache"
  wheel="$(ls "$cache"/"${NIXL_WHEEL_PKG//-/_}"-"$NIXL_VERSION"-*.whl | head -n1)"
fi

rm -rf "$dest"
mkdir -p "$dest/plugins" "$dest/ucx"
python3 - "$wheel" "$dest" <<'PY'
import re, sys, zipfile, os
wheel, dest = sys.argv[1], sys.argv[2]
core = re.compile(r"^\.nixl_cu\d+\.mesonpy\.libs/(libnixl_capi|libnixl|libnixl_build|libnixl_common|libserdes|libstream)\.so$")
plugin = re.compile(r"^\.nixl_cu\d+\.mesonpy\.libs/plugins/libplugin_UCX\.so$")
deps = re.compile(r"^nixl_cu\d+\.libs/(libabsl_|libaddress_sorting-|libetcd-cpp-api-core-|libgpr-|libgrpc\+\+-|libgrpc-|libprotobuf-|libre2-|libucm-|libucp-|libucs-|libuct-|libupb_|libutf8_)[^/]*\.so[.0-9]*$")
ucx = re.compile(r"^nixl_cu\d+\.libs/ucx/(libuct_cma|libuct_cuda|libucm_cuda)\.so[.0-9]*$")
n = 0
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        name = info.filename
        if core.match(name) or deps.match(name):
            out = os.path.join(dest, os.path.basename(name))
        elif plugin.match(name):
            out = os.path.join(dest, "plugins", os.path.basename(name))
        elif ucx.match(name):
            out = os.path.join(dest, "ucx", os.path.basename(name))
        else:
            continue
        with z.open(info) as src, open(out, "wb") as dst:
            dst.write(src.read())
        os.chmod(out, 0o755)
        n += 1
        # UCX loads its modules as lib<name>.so.0 from <dir of libucs>/ucx/.
        m = re.match(r"^(.*\.so)\.0\.0\.0$", out)
        if "/ucx/" in out and m:
            for link in (m.group(1) + ".0", m.group(1)):
                if not os.path.exists(link):
                    os.symlink(os.path.basename(out), link)
print(f"install-nixl: extracted {n} libraries")
PY
if command -v strip >/dev/null 2>&1; then
  find "$dest" -type f -name '*.so*' -exec strip --strip-unneeded {} + 2>/dev/null || true
fi
touch "$stamp"
echo "install-nixl: $NIXL_WHEEL_PKG $NIXL_VERSION installed in $dest ($(du -sh "$dest" | cut -f1))"
