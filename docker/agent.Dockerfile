# kvfabric agent image: `kvfabric agent` (built with the `cuda` feature:
# the arena and the engines' pools in GPU memory; CUDA itself comes from
# the node through the NVIDIA container runtime, NVRTC from the image) and
# the NIXL + UCX runtime libraries it dlopen()s (e2e/install-nixl.sh:
# the nixl-cu12 wheel's minimal set; here also UCX's InfiniBand/RoCE
# transports for the host-network RDMA setup).
#
#   docker build -f docker/agent.Dockerfile -t <registry>/kvfabric-agent:<version> .
#
# NOT BUILT on the development machines of this repository (no container
# engine is available there); the chart's agent.image values refer to it.
# Layout: /opt/kvfabric/bin/kvfabric with the NIXL libraries in
# /opt/kvfabric/bin/nixl (the agent looks in <exe dir>/nixl; their RPATHs
# are $ORIGIN, so no LD_LIBRARY_PATH is needed).

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM rust:1.95-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends \
      libclang-dev protobuf-compiler libprotobuf-dev cmake g++ pkg-config \
      python3 python3-pip unzip \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p kvfabric-agent --features cuda --bin kvfabric
# NIXL runtime: the minimal set (cma + cuda UCX modules) ...
RUN KVFABRIC_NIXL_DIR=/out/nixl e2e/install-nixl.sh
# ... plus UCX's verbs transports for RDMA (rc/ud/dc on mlx5) and the
# libibverbs the wheel carries.
RUN python3 - <<'PY'
import glob, os, re, zipfile
wheel = glob.glob(os.path.expanduser("~/.cache/kvfabric/wheels/nixl_cu12-*.whl"))[0]
pat = re.compile(r"^nixl_cu\d+\.libs/(ucx/libuct_ib[^/]*\.so[.0-9]*|libibverbs[^/]*\.so[.0-9]*|libmlx5[^/]*\.so[.0-9]*|librdmacm[^/]*\.so[.0-9]*)$")
with zipfile.ZipFile(wheel) as z:
    for n in z.namelist():
        if pat.match(n):
            out = os.path.join("/out/nixl", "ucx" if "/ucx/" in n else "", os.path.basename(n))
            with z.open(n) as s, open(out, "wb") as d:
                d.write(s.read())
PY

FROM ${CUDA_IMAGE}
# NVRTC compiles kernels/*.cu at start-up; rdma-core supplies the verbs
# provider plugins (libmlx5) for the host's HCAs.
RUN apt-get update && apt-get install -y --no-install-recommends \
      cuda-nvrtc-12-8 rdma-core ibverbs-providers ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/kvfabric /opt/kvfabric/bin/kvfabric
COPY --from=build /out/nixl /opt/kvfabric/bin/nixl
ENV PATH=/opt/kvfabric/bin:$PATH
# The chart passes `agent --config /etc/kvfabric/config.yaml ...`.
ENTRYPOINT ["/opt/kvfabric/bin/kvfabric"]
CMD ["agent"]
