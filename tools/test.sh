#!/usr/bin/env bash
# The project's test command: what the README tells a newcomer to run, and
# what CI runs. It installs what the build and the tests need, runs every
# test of the workspace (unit, integration, the CLI through the built binary,
# a cluster of real processes around a real etcd, a real Prometheus scraping
# the store; each test starts and stops its own on free loopback ports),
# validates deploy/, and leaves nothing running.
set -euo pipefail
cd "$(dirname "$0")/.."

tools/setup.sh

# A build cache outside the clone survives fresh clones on the same machine.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/mooncake-target}"

# What the tests write to temporary files (logs, sockets, stores and
# daemons of their own) goes into one folder, removed when the run passes
# and kept for a look when it fails: runs leave nothing in /tmp.
scratch=$(mktemp -d)
tidy() {
    if [ $? -eq 0 ]; then rm -rf "$scratch"; else echo "the tests left their temporary files in $scratch" >&2; fi
}
trap tidy EXIT
export TMPDIR="$scratch"

tools/check-deploy.sh

if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --workspace --no-fail-fast --failure-output final
else
    cargo test --workspace --no-fail-fast
fi

# The `rdma` feature builds (libibverbs is loaded at run time) and passes
# its lints; its tests run: on a host without RDMA they check that a daemon
# asked for RDMA serves TCP only and that opening a NIC fails in one line;
# with MOONCAKE_EXPECT_RDMA=1 on a host with a NIC they move real blocks.
cargo clippy --workspace --all-targets --features mooncake-tools/rdma -- -D warnings
cargo test -q -p mooncake-net --features rdma --lib rdma::
cargo test -q -p mooncake-client --features rdma --lib transport::
cargo test -q -p mooncake-store-daemon --features rdma --lib -- rdma leases config

# The Python SDK, built and installed the way the README says (pip), in the
# virtual environment that tools/setup.sh made, tested against the CLI's store.
VENV="${MOONCAKE_VENV:-$HOME/.cache/mooncake-venv}"
"$VENV/bin/pip" install -q --disable-pip-version-check ./client/python
MOONCAKE_BIN="$CARGO_TARGET_DIR/debug/mooncake-store" "$VENV/bin/python" -m pytest -q client/python/tests

# Every parser that reads the network or the disk, fuzzed for a bounded time.
tools/fuzz.sh "${MOONCAKE_FUZZ_SECONDS:-20}"
