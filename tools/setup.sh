#!/usr/bin/env bash
# Installs what building and testing Mooncake Store need, from Debian's
# packages, when missing: a C toolchain, cmake and libibverbs (the `rdma`
# feature), protoc (etcd's client is generated
# from protobuf at build time), RocksDB and libclang (the NVMe tier's index
# links Debian's librocksdb), etcd (the cluster tests start a real one),
# Prometheus (a test scrapes the store with it) and Python (the block-key
# spec's snippet is run by a test; the Python SDK is tested in a virtual
# environment). Idempotent and quick when everything is there.
set -euo pipefail

need=()
command -v cc >/dev/null || need+=(build-essential)
command -v python3 >/dev/null || need+=(python3)
# The Python SDK is built and tested in a virtual environment.
python3 -m venv --help >/dev/null 2>&1 || need+=(python3-venv)
# The disk-full tests mount a small tmpfs in a private namespace.
command -v unshare >/dev/null || need+=(util-linux)
command -v protoc >/dev/null || need+=(protobuf-compiler)
[[ -e /usr/include/google/protobuf/descriptor.proto ]] || need+=(libprotobuf-dev)
command -v etcd >/dev/null || need+=(etcd-server)
command -v prometheus >/dev/null || need+=(prometheus)    # scrapes the store in a test
# The NVMe tier's index links Debian's RocksDB; its bindings need libclang.
[[ -e /usr/lib/x86_64-linux-gnu/librocksdb.so ]] || need+=(librocksdb-dev)
compgen -G "/usr/lib/llvm-*/lib/libclang*.so*" >/dev/null || need+=(libclang-dev)
# The `rdma` feature: sideway builds rdma-core's loader with cmake (and
# bindgen, libclang above); libibverbs itself is loaded at run time.
command -v cmake >/dev/null || need+=(cmake)
[[ -e /usr/include/infiniband/verbs.h ]] || need+=(libibverbs-dev)

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

# Schemas of the Kubernetes API, offline, and PyYAML, for tools/check-deploy.sh.
if ! command -v kubernetes-validate >/dev/null || ! python3 -c 'import yaml' 2>/dev/null; then
    echo "installing: kubernetes-validate (PyPI)"
    pip_install() { python3 -m pip install -q --disable-pip-version-check "$@"; }
    pip_install kubernetes-validate || pip_install --break-system-packages kubernetes-validate
fi
