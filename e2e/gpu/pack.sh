#!/usr/bin/env bash
# Packs what the GPU machine needs into .gpu/ and .whl/ (both ignored by git,
# carried by the device tool): the kvfabric and kvfabric-gpu binaries built
# with the cuda feature (stripped), etcd, the nixl-cu13 runtime, and the Python wheels the
# engine client needs there (python 3.12).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
target="${CARGO_TARGET_DIR:-target-gpu}"
cargo build --release -p kvfabric-agent --features cuda --bin kvfabric --bin kvfabric-gpu
mkdir -p .gpu/stage .whl
for b in kvfabric kvfabric-gpu; do cp "$target/release/$b" .gpu/stage/$b && strip .gpu/stage/$b; done
cp "$(command -v etcd)" .gpu/stage/etcd
[ -e .gpu/nixl/libnixl_capi.so ] || NIXL_WHEEL_PKG=nixl-cu13 e2e/install-nixl.sh "$PWD/.gpu/nixl"
rm -rf .gpu/stage/nixl && cp -r .gpu/nixl .gpu/stage/nixl
tar cf - -C .gpu/stage . | xz -T2 -6 > .gpu/bundle.tar.xz
for p in grpcio==1.76.0 protobuf==6.33.1; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$p"
done
ls -la .gpu/bundle.tar.xz .whl
