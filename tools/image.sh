#!/usr/bin/env bash
# The container image, built and proved.
#
#   tools/image.sh build   # mooncake-store:0.1.0 from ./Dockerfile
#   tools/image.sh test    # build, then run deploy/compose/compose.yaml (etcd,
#                          # two meta replicas, two daemons, one container
#                          # each), put and get from this host, stop a daemon
#                          # and see its blocks leave the index
#
# Uses podman (installed by package name if neither it nor docker is
# there; as root, with runc). Where no registry can be reached, the base
# images the Dockerfile names are made here first, so that the Dockerfile
# stays the standard one: debian:bookworm-slim from debootstrap, rust from
# this machine's toolchain and the certificate authorities it trusts
# (tagged with the toolchain's version, passed as RUST_VERSION), and etcd from Debian's etcd-server package (as
# ETCD_IMAGE; the compose file's default is quay.io's).
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/clean-root.sh
IMAGE="${MOONCAKE_IMAGE:-mooncake-store:0.1.0}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/mooncake-target}"

need() {
    local missing=()
    for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "installing: ${missing[*]}"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
}
need podman runc
# crun refuses this machine's cgroups (hybrid mode); runc runs. Podman's
# default open-file limit (1048576) is refused where this process's own
# hard limit is lower: containers get at most that.
PODMAN=(podman --runtime runc)
NOFILE=$(( $(ulimit -Hn) < 65536 ? $(ulimit -Hn) : 65536 ))
LIMITS=(--ulimit "nofile=$NOFILE:$NOFILE" --ulimit nproc=4096:4096)

# `image NAME`: whether it is here, or can be pulled.
image() {
    "${PODMAN[@]}" image exists "$1" && return 0
    timeout 60 "${PODMAN[@]}" pull -q "$1" >/dev/null 2>&1
}

bases() {
    local debian=docker.io/library/debian:bookworm-slim
    if ! image "$debian"; then
        echo "== $debian: no registry; made from a clean Debian 12 root"
        "${PODMAN[@]}" import -q "$(clean_root_tarball)" "$debian" >/dev/null
    fi
    RUST_VERSION=$(rustc --version | awk '{print $2}' | cut -d. -f1,2)
    local rust=docker.io/library/rust:$RUST_VERSION-bookworm
    if ! image "$rust"; then
        echo "== $rust: no registry; made from this machine's toolchain"
        local ctx
        ctx=$(mktemp -d /var/tmp/mooncake-rust-image.XXXXXX)
        cp -a "$(rustc --print sysroot)" "$ctx/rust"
        # This network's own certificate authorities (a proxy between it and
        # crates.io), as this machine trusts them.
        mkdir -p "$ctx/ca"
        cp /usr/local/share/ca-certificates/*.crt "$ctx/ca/" 2>/dev/null || true
        cat >"$ctx/Containerfile" <<EOF
FROM $debian
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates build-essential pkg-config && rm -rf /var/lib/apt/lists/*
COPY ca /usr/local/share/ca-certificates
RUN update-ca-certificates >/dev/null
COPY rust /usr/local/rust
RUN mkdir -p /usr/local/cargo/bin && for b in cargo rustc rustdoc; do ln -s /usr/local/rust/bin/\$b /usr/local/cargo/bin/\$b; done
ENV CARGO_HOME=/usr/local/cargo PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
EOF
        "${PODMAN[@]}" build -q "${LIMITS[@]}" --pull=never -t "$rust" "$ctx" >/dev/null
        rm -rf "$ctx"
    fi
}

build() {
    bases
    echo "== building $IMAGE (Dockerfile, Rust $RUST_VERSION)"
    "${PODMAN[@]}" build "${LIMITS[@]}" --pull=never --format docker \
        --build-arg "RUST_VERSION=$RUST_VERSION" -t "$IMAGE" .
    # The build stage's layers (gigabytes); cargo's cache mount stays.
    "${PODMAN[@]}" image prune -f >/dev/null
    "${PODMAN[@]}" image inspect "$IMAGE" --format 'image {{.Id}}: {{.Size}} bytes, user {{.Config.User}}'
}

# The compose file through podman-compose (from PyPI, in a venv of its own).
compose() {
    local venv="$HOME/.cache/mooncake-compose-venv"
    if [ ! -x "$venv/bin/podman-compose" ]; then
        need python3-venv
        python3 -m venv "$venv"
        "$venv/bin/pip" install -q podman-compose
    fi
    "$venv/bin/podman-compose" --podman-args="--runtime runc" \
        --podman-run-args="${LIMITS[*]}" -f deploy/compose/compose.yaml "$@"
}

test_cluster() {
    build
    if [ -z "${ETCD_IMAGE:-}" ] && ! image quay.io/coreos/etcd:v3.5.17; then
        export ETCD_IMAGE=localhost/mooncake-etcd:debian
        if ! "${PODMAN[@]}" image exists "$ETCD_IMAGE"; then
            echo "== $ETCD_IMAGE: no registry; Debian's etcd-server"
            printf 'FROM docker.io/library/debian:bookworm-slim\nRUN apt-get update && apt-get install -y --no-install-recommends etcd-server && rm -rf /var/lib/apt/lists/*\n' |
                "${PODMAN[@]}" build -q "${LIMITS[@]}" --pull=never -t "$ETCD_IMAGE" -f - . >/dev/null
        fi
    fi
    export MOONCAKE_IMAGE="$IMAGE"
    cargo build -q --bin mooncake-store
    local bin="$CARGO_TARGET_DIR/debug/mooncake-store"
    # A client on this host, following the meta leader through etcd.
    mc() { "$bin" "$@" --etcd http://127.0.0.1:2379 --timeout 3s; }
    trap 'compose down -t 5 >/dev/null 2>&1 || true' EXIT
    compose down -t 5 >/dev/null 2>&1 || true
    compose up -d
    echo "== waiting for a leader and two daemons"
    local st=""
    for _ in $(seq 120); do
        st=$(mc stat --json 2>/dev/null || true)
        [ "$(grep -o '"alive":true' <<<"$st" | wc -l)" = 2 ] && break
        sleep 0.5
    done
    [ "$(grep -o '"alive":true' <<<"$st" | wc -l)" = 2 ] || { echo "the cluster did not come up: $st"; compose logs | tail -40; exit 1; }
    echo "== put and get from this host"
    local tmp
    tmp=$(mktemp -d)
    head -c 300000 /dev/urandom >"$tmp/value"
    for i in $(seq 0 19); do mc put "block-$i" "$tmp/value" >/dev/null; done
    mc get block-7 >"$tmp/got"
    cmp "$tmp/value" "$tmp/got"
    echo "== each container's health check (mooncake-store health)"
    for c in mooncake_meta-0_1 mooncake_meta-1_1 mooncake_daemon-0_1 mooncake_daemon-1_1; do
        "${PODMAN[@]}" healthcheck run "$c" 2>/dev/null && echo "$c: healthy" || { echo "$c: unhealthy"; exit 1; }
    done
    # Blocks per daemon, by node name, as the daemons report them (each
    # heartbeat): wait until the reports add up to the 20 blocks.
    per_node() { mc stat --json | python3 -c 'import json,sys; s=json.load(sys.stdin); print(json.dumps({"index": s["blocks"], **{d["node"]: d["blocks"] for d in s["daemons"] if d["alive"]}}))'; }
    local before after
    for _ in $(seq 20); do
        before=$(per_node)
        python3 -c 'import json,sys; b=json.loads(sys.argv[1]); sys.exit(0 if b.get("daemon-0",0)+b.get("daemon-1",0)==20 else 1)' "$before" && break
        sleep 0.5
    done
    echo "blocks (the index, and each daemon's): $before"
    echo "== stopping daemon-1"
    "${PODMAN[@]}" stop -t 20 mooncake_daemon-1_1 >/dev/null
    after=$(per_node)
    echo "right after: $after"
    python3 - "$before" "$after" <<'PY'
import json, sys
before, after = json.loads(sys.argv[1]), json.loads(sys.argv[2])
assert before["index"] == 20 and before["daemon-0"] + before["daemon-1"] == 20, before
# The stopped daemon left the meta service as it stopped: its blocks left
# the index at once (not after a lease), and only daemon-0's are listed.
assert "daemon-1" not in after, after
assert after["index"] == before["daemon-0"], (before, after)
print("ok: the stopped daemon's blocks left the index")
PY
    for i in $(seq 0 19); do
        if mc get "block-$i" >"$tmp/got" 2>/dev/null; then cmp -s "$tmp/value" "$tmp/got" || { echo "block-$i: wrong bytes"; exit 1; }; fi
    done
    echo "== every block still listed reads back right"
    rm -rf "$tmp"
}

case "${1:-}" in
    build) build ;;
    test) test_cluster ;;
    *) echo "usage: tools/image.sh build|test" >&2; exit 2 ;;
esac
