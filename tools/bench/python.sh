#!/usr/bin/env bash
# The Python binding against the Rust client, in one run on this machine:
# batch_get_into of 128 blocks of 256 KiB into a registered buffer from
# Python, then the Rust `bench` with the same batch, block size and
# concurrency, against the same store. The goal: Python at 90% or more.
# Usage: tools/bench/python.sh [THREADS]
set -euo pipefail
cd "$(dirname "$0")/../.."
THREADS="${1:-1}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/mooncake-target}"
VENV="${MOONCAKE_VENV:-$HOME/.cache/mooncake-venv}"
. tools/store-for-script.sh

release_and_python

start_store 2GiB

for round in 1 2; do
    echo "== round $round"
    "$VENV/bin/python" client/python/bench/batch_get_into.py --meta "$META" --threads "$THREADS"
    "$BIN" bench --meta "$META" --sizes 256KiB --batch 128 --concurrency "$THREADS" --ops 25600 \
        --working-set 512MiB 2>/dev/null | grep -E "^(op|get)"
done
