# The `mooncake-store` image: one binary for every role (up, meta, daemon,
# and the operator commands), on Debian 12 slim, as a non-root user.
#
#   docker build -t mooncake-store:0.1.0 .        # or: podman build
#   docker run --rm -p 7070:7070 mooncake-store:0.1.0 up --meta-listen 0.0.0.0:7070 --listen 0.0.0.0:7071
#
# deploy/k8s/ and deploy/compose/ run it. Where no registry can be reached,
# tools/image.sh makes the two base images locally and builds this file
# unchanged.
ARG RUST_VERSION=1.85

FROM docker.io/library/rust:${RUST_VERSION}-bookworm AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        build-essential pkg-config librocksdb-dev protobuf-compiler libprotobuf-dev libclang-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin mooncake-store \
    && cp target/release/mooncake-store /usr/local/bin/mooncake-store \
    && strip --strip-debug /usr/local/bin/mooncake-store

FROM docker.io/library/debian:bookworm-slim
# (Its symbols stay, for profiles; its debug information does not.)
# What the binary links at run time: RocksDB (and its compression
# libraries) from Debian; nothing else.
RUN apt-get update \
    && apt-get install -y --no-install-recommends librocksdb7.8 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home-dir /var/lib/mooncake --create-home mooncake
COPY --from=build /usr/local/bin/mooncake-store /usr/local/bin/mooncake-store
USER mooncake
WORKDIR /var/lib/mooncake
# Data (daemon), control (meta), admin (/metrics, /health: 9070 meta, 9071
# daemon).
EXPOSE 7070 7071 9070 9071
# /health on whichever admin port this container's role serves.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["mooncake-store", "health"]
ENTRYPOINT ["mooncake-store"]
CMD ["up", "--meta-listen", "0.0.0.0:7070", "--listen", "0.0.0.0:7071", "--admin", "0.0.0.0:9070"]
