# kvfabric-operator image (the KvFabric controller; also `crdgen`).
#
#   docker build -f docker/operator.Dockerfile -t <registry>/kvfabric-operator:<version> .
#
# NOT BUILT on the development machines of this repository (no container
# engine is available there); the chart's operator.image values refer to it.

FROM rust:1.95-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends \
      protobuf-compiler libprotobuf-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p kvfabric-operator --bin kvfabric-operator --bin crdgen

# glibc, CA certificates, no shell; runs as 65532 (the chart's
# runAsUser) with a read-only root file system.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/kvfabric-operator /usr/local/bin/kvfabric-operator
COPY --from=build /src/target/release/crdgen /usr/local/bin/crdgen
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/kvfabric-operator"]
