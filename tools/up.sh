#!/usr/bin/env bash
# The README's run command: installs what building needs (tools/setup.sh
# --build: a C toolchain, protoc, RocksDB, libclang; quick when they are
# there), builds the release binary and runs `mooncake-store up`: a meta
# service and a daemon in one process, on one host, no etcd. Arguments go to
# `up` (`tools/up.sh --help` lists them); Ctrl-C or SIGTERM stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh --build
exec cargo run --release --quiet --bin mooncake-store -- up "$@"
