#!/usr/bin/env bash
# Installs what building and testing Mooncake Store need, on Debian 12 (or
# Ubuntu), by package name, when missing. Idempotent and quick when
# everything is there.
#
#   tools/setup.sh           what the build and the tests need (tools/test.sh)
#   tools/setup.sh --build   only what building the binary needs (tools/up.sh)
#   tools/setup.sh --engines the build's, and what the serving engines'
#                            drivers need (tools/test-engines.sh)
#
# What is installed is decided by asking dpkg about package names, never by
# looking for files that another package may also provide (Debian's
# libclang-cpp14 ships a `libclang-cpp.so` that looks like libclang, which
# bindgen cannot load). Python tools go into a virtual environment under
# ~/.cache, never into the system's Python (Debian's has no pip).
set -euo pipefail

mode=all
case "${1:-}" in
    "") ;;
    --build) mode=build ;;
    --engines) mode=engines ;;
    *) echo "usage: tools/setup.sh [--build | --engines]" >&2; exit 2 ;;
esac

build=(
    build-essential      # cc and c++: RocksDB's bindings, ring, rdma-core's loader
    ca-certificates      # cargo fetches crates over HTTPS
    protobuf-compiler    # protoc: etcd's client is generated at build time
    libprotobuf-dev      # the well-known .proto files that etcd's protos import
    librocksdb-dev       # the NVMe tier's index links Debian's RocksDB (.cargo/config.toml)
    libclang-dev         # bindgen (RocksDB's and rdma-core's bindings) loads libclang.so
    cmake                # the `rdma` feature builds rdma-core's loader
    libibverbs-dev       # verbs.h for the `rdma` feature; libibverbs is loaded at run time
)
tests=(
    python3 python3-venv # the block-key spec's snippet; the Python SDK, tested in a venv
    etcd-server          # the cluster tests start a real etcd on loopback
    prometheus           # a test scrapes the store with a real Prometheus; promtool
    util-linux           # unshare: the disk-full tests mount a tmpfs in a private namespace
)
engines=(
    libssl-dev python3-dev # SGLang compiles its page-hash extension (OpenSSL's SHA-256, Python.h) at first use
)
wanted=("${build[@]}")
[[ $mode == all ]] && wanted+=("${tests[@]}")
[[ $mode == engines ]] && wanted+=("${engines[@]}")

if ! command -v dpkg-query >/dev/null; then
    echo "tools/setup.sh installs Debian packages; on this system install the equivalents of: ${wanted[*]}" >&2
    exit 1
fi
installed() { [[ $(dpkg-query -W -f='${db:Status-Abbrev}' "$1" 2>/dev/null) == ii* ]]; }
need=()
for pkg in "${wanted[@]}"; do installed "$pkg" || need+=("$pkg"); done

if ((${#need[@]})); then
    echo "installing: ${need[*]}"
    if [[ $(id -u) -ne 0 ]]; then SUDO=sudo; else SUDO=; fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    # Debian may start these as services; the tests start their own.
    if command -v systemctl >/dev/null; then
        for svc in etcd prometheus; do
            systemctl is-active --quiet "$svc" 2>/dev/null && { $SUDO systemctl stop "$svc" || true; }
        done
    fi
fi
[[ $mode != all ]] && exit 0

# Python tools for the tests, in one virtual environment outside the clone:
# the Kubernetes API's schemas (kubernetes-validate, with PyYAML) for
# tools/check-deploy.sh; maturin, pytest and numpy for the Python SDK;
# pyzmq and msgspec for the store events' subscriber test (as vLLM's own).
VENV="${MOONCAKE_VENV:-$HOME/.cache/mooncake-venv}"
[[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
if ! "$VENV/bin/python" -c 'import kubernetes_validate, yaml, maturin, pytest, numpy, zmq, msgspec' 2>/dev/null; then
    echo "installing into $VENV (PyPI): kubernetes-validate pyyaml maturin pytest numpy pyzmq msgspec"
    "$VENV/bin/pip" install -q --disable-pip-version-check kubernetes-validate pyyaml maturin pytest numpy pyzmq msgspec
fi
