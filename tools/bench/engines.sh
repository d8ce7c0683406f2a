#!/usr/bin/env bash
# Serving engines' shapes from Python against the Rust client, in one run on
# this machine: SGLang HiCache's request of 64 pages with K and V in
# separate buffers (two objects a page, and one object from two pieces),
# then the Rust `bench` with the same block size, batch and concurrency,
# against the same store; and a request's prefix check three ways. Where
# tools/test-engines.sh made the engines' environment, SGLang HiCache's own
# calls too, through its mooncake backend and the native one, vLLM's
# blocks (512 KiB: 8 layers of K and V) through the native vLLM connector's
# worker side, and LMCache's chunks (4 MiB) through LMCache's own remote
# backend with its mooncakestore connector and with the native one. The goal:
# Python at 90% or more of the Rust client.
# Usage: tools/bench/engines.sh [PIECE_BYTES]
set -euo pipefail
cd "$(dirname "$0")/../.."
PIECE="${1:-262144}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/mooncake-target}"
VENV="${MOONCAKE_VENV:-$HOME/.cache/mooncake-venv}"
. tools/store-for-script.sh

release_and_python

ENGINES="${MOONCAKE_ENGINES_VENV:-$HOME/.cache/mooncake-engines-venv}"
# Each phase on an empty store: a round writes more than the store holds,
# and blocks written once and not yet read stay only in the daemon's small
# probation queue (5% of it), so a full store would evict a phase's objects
# before the phase reads them back.
fresh_store() {
    if [ -n "${STORE_PID:-}" ]; then kill "$STORE_PID"; wait "$STORE_PID" 2>/dev/null || true; fi
    start_store 2GiB
}
for round in 1 2; do
    echo "== round $round"
    fresh_store
    "$VENV/bin/python" client/python/bench/sglang_pages.py --meta "$META" --piece "$PIECE"
    # The two-object layout moves blocks of PIECE bytes, the multi-buffer
    # one blocks of 2 x PIECE: the Rust client at both, a request's bytes
    # in one batch, its puts from as many bytes as the Python pool holds
    # (not one block rewritten from the CPU's cache).
    echo "-- Rust bench, ${PIECE} B blocks in batches of 128 and $((2 * PIECE)) B in batches of 64, one worker"
    "$BIN" bench --meta "$META" --sizes "$PIECE" --batch 128 --concurrency 1 --ops 12800 \
        --working-set 512MiB --put-from "$((128 * PIECE))" 2>/dev/null | grep -E "^(op|get|put)"
    "$BIN" bench --meta "$META" --sizes "$((2 * PIECE))" --batch 64 --concurrency 1 --ops 6400 \
        --working-set 512MiB --put-from "$((128 * PIECE))" 2>/dev/null | grep -E "^(get|put)"
    if [ -x "$ENGINES/bin/python" ]; then
        # The engines' own classes (tools/test-engines.sh installs them).
        "$ENGINES/bin/pip" install -q --disable-pip-version-check ./client/python
        fresh_store
        echo "-- SGLang HiCache's calls, its mooncake backend and the native one"
        "$ENGINES/bin/python" -W ignore client/python/engines/sglang_bench.py "$META"
        echo "-- vLLM's blocks through the native connector"
        "$ENGINES/bin/python" -W ignore client/python/engines/vllm_bench.py "$META" 2>/dev/null
        echo "-- Rust bench, 512 KiB and 1 MiB blocks, batches of 64, one worker"
        "$BIN" bench --meta "$META" --sizes 512KiB,1MiB --batch 64 --concurrency 1 --ops 3200 \
            --working-set 512MiB --put-from 256MiB 2>/dev/null | grep -E "^(op|get|put)"
        fresh_store
        echo "-- LMCache's remote tier: its mooncakestore connector and the native one"
        LMCACHE_LOG_LEVEL=ERROR "$ENGINES/bin/python" -W ignore client/python/engines/lmcache_bench.py \
            "$META" --requests 4 2>/dev/null
        echo "-- Rust bench, 4 MiB blocks, batches of 32, one worker"
        "$BIN" bench --meta "$META" --sizes 4MiB --batch 32 --concurrency 1 --ops 512 \
            --working-set 512MiB --put-from 256MiB 2>/dev/null | grep -E "^(op|get|put)"
    fi
done
