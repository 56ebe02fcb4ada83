# For people with Docker (or any BuildKit): the same image `make image` builds without one,
# from a Rust builder stage onto a distroless base with glibc. `make image` is the reference
# build (reproducible, tested in e2e/tests/image.rs); keep the two in step.
#   docker build -t ghcr.io/gpuledger/gpuledger:0.1.0 .
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p gpuledger-operator -p gpuledger-device-plugin --bins

FROM gcr.io/distroless/cc-debian12:nonroot
LABEL org.opencontainers.image.title="gpuledger" \
      org.opencontainers.image.description="gpuledger operator and device plugin: a GPU-sharing ledger for Kubernetes" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/gpuledger/gpuledger"
COPY --from=build /src/target/release/gpuledger-operator /src/target/release/gpuledger-device-plugin /usr/local/bin/
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/gpuledger-operator"]
