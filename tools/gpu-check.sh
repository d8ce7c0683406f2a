#!/usr/bin/env bash
# The GPU checks, on a host with an NVIDIA GPU and its driver (no CUDA
# toolkit needed): builds the release binary (or takes $MOONCAKE_BIN),
# starts a single-host store of its own on loopback, and runs `bench-gpu`
# through the same-host shared pool, then over TCP. Each run first checks
# that device pointers are told from host ones and that blocks of odd
# sizes and splits go from GPU memory to the store and back byte for byte,
# then measures puts from and gets into GPU memory (64 MiB and 1 GiB of
# 256 KiB and 2 MiB blocks) beside the GPU's own pinned copies of the same
# bytes, every get checked byte for byte. Then, where $PYTHON (default
# python3) has PyTorch on CUDA, pytest and this repository's Python
# package, it runs client/python/tests/test_gpu.py: both Python APIs with
# CUDA tensors, as vLLM's connector calls them. Each step is bounded
# (STEP_LIMIT seconds); the others run after one fails. Exits non-zero on
# any failure.
#
#   tools/gpu-check.sh            # 3 rounds each, text
#   ROUNDS=5 JSON=1 tools/gpu-check.sh
#   COPY_THREADS=8 SIZES=2MiB TOTALS=1GiB tools/gpu-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/store-for-script.sh

ROUNDS=${ROUNDS:-3}
SIZES=${SIZES:-256KiB,2MiB}
TOTALS=${TOTALS:-64MiB,1GiB}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
if [ -n "${MOONCAKE_BIN:-}" ]; then
    BIN=$MOONCAKE_BIN
else
    cargo build --release -q --bin mooncake-store
    BIN="$CARGO_TARGET_DIR/release/mooncake-store"
fi

echo "== host"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null ||
    echo "(no nvidia-smi)"
echo "cores: $(nproc); shmem huge pages: $(cat /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>/dev/null || echo '?')"

start_store 4GiB --shm-socket "$SCRATCH/daemon.sock"

json=()
[ -n "${JSON:-}" ] && json=(--json)
common=(--meta "$META" --sizes "$SIZES" --totals "$TOTALS" --rounds "$ROUNDS" "${json[@]}")
# COPY_THREADS: the client's threads checking blocks (default a quarter
# of the cores).
[ -n "${COPY_THREADS:-}" ] && common+=(--copy-threads "$COPY_THREADS")

# Each step is bounded (STEP_LIMIT seconds, default 300): one that hangs
# or fails is reported, the others still run, and the exit status says so.
failed=()
step() {
    local name=$1
    shift
    echo "== $name"
    local rc=0
    timeout "${STEP_LIMIT:-300}" "$@" || rc=$?
    [ $rc -eq 124 ] && echo "$name: no result in ${STEP_LIMIT:-300} s"
    [ $rc -ne 0 ] && failed+=("$name")
    return 0
}
step "same host: the daemon's shared pool" \
    "$BIN" bench-gpu --shm-socket "$SCRATCH/daemon.sock" "${common[@]}"
step "over TCP (loopback)" "$BIN" bench-gpu "${common[@]}"
PY=${PYTHON:-python3}
if "$PY" -c 'import torch, pytest, mooncake_store; assert torch.cuda.is_available()' 2>/dev/null; then
    step "Python: both APIs on CUDA tensors" env MOONCAKE_BIN="$BIN" \
        "$PY" -m pytest -q -p no:cacheprovider client/python/tests/test_gpu.py
else
    echo "== Python: not run ($PY lacks PyTorch on CUDA, pytest or mooncake_store; install client/python)"
fi
if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu-check: failed: ${failed[*]}"
    exit 1
fi
echo "gpu-check: ok"
