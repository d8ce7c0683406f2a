#!/usr/bin/env bash
# This store against Mooncake Store itself (`mooncake-transfer-engine` from
# PyPI: its mooncake_master, its mooncake_client holding the memory, and
# its `mooncake.store`), in one run on this machine, through the same
# Python client loop (client/python/bench/vs_mooncake.py) calling each
# one's `mooncake.store` as the engines do: `batch_put_from` and
# `batch_get_into` of registered memory, every byte read back compared.
# Two paths, each store's own:
#   tcp:  a storage process reached over loopback TCP. Mooncake: a
#         mooncake_client holding a 1 GB segment, the bench client holding
#         none (vLLM's standalone-store mode). Ours: `up`, whose daemon is
#         reached as a remote one is.
#   host: the same host's fast path. Mooncake: `setup_dummy` to its
#         mooncake_client (its shared memory; buffers from its
#         MooncakeHostMemAllocator). Ours: the daemon's shared pool
#         (`--shm-socket`), same buffers.
# Servers run on CPU 0 and the client on the others (`taskset`), so that
# where the scheduler puts them does not decide a run; rounds alternate
# the two stores after an unmeasured warm-up round, and the medians are
# printed.
#
# Mooncake's wheel links the CUDA driver (libcuda.so.1) and runtime. On a
# host without a GPU the script builds a stand-in libcuda whose every call
# answers CUDA_ERROR_NO_DEVICE (one C function per name the wheel imports)
# and installs NVIDIA's CUDA runtime wheel: nothing of Mooncake's runs on a
# GPU here, and its TCP transport and shared memory are what is measured.
# Its environment is its own (~/.cache/mooncake-vs-venv).
#
# Usage: tools/bench/vs-mooncake.sh [SIZES] [BATCH] [BYTES] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
SIZES="${1:-256KiB,4MiB}"
BATCH="${2:-16}"
BYTES="${3:-256MiB}"
ROUNDS="${4:-5}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/mooncake-target}"
VENV="${MOONCAKE_VENV:-$HOME/.cache/mooncake-venv}"
MC_VENV="${MOONCAKE_VS_VENV:-$HOME/.cache/mooncake-vs-venv}"
MOONCAKE_VERSION=0.3.13.post1
tools/setup.sh
. tools/store-for-script.sh
release_and_python

[ -x "$MC_VENV/bin/python" ] || python3 -m venv "$MC_VENV"
"$MC_VENV/bin/pip" install -q --disable-pip-version-check \
    "mooncake-transfer-engine==$MOONCAKE_VERSION" nvidia-cuda-runtime-cu12==12.9.79 numpy==2.4.6
MC_PKG="$("$MC_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
tmp=$SCRATCH
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    stop_store
}
trap cleanup EXIT
mc_libs="$MC_PKG/nvidia/cuda_runtime/lib"
if ! ldconfig -p | grep -q 'libcuda\.so\.1 '; then
    nm -D --undefined-only "$MC_PKG/mooncake/store.so" | awk '$2 ~ /^cu[A-Z]/ && $2 !~ /@/ {print $2}' | sort -u |
        awk 'BEGIN {print "/* libcuda.so.1 stand-in: no GPU here (CUDA_ERROR_NO_DEVICE). */"}
             {print "int " $1 "(void) { return 100; }"}' >"$tmp/libcuda.c"
    cc -shared -fPIC -o "$tmp/libcuda.so.1" "$tmp/libcuda.c"
    mc_libs="$tmp:$mc_libs"
fi

cpus=$(nproc)
server=(taskset -c 0)
client=(taskset -c "$((cpus > 1 ? 1 : 0))-$((cpus - 1))")

# Mooncake: master and a storage client on CPU 0.
mc_master=$(free_port)
mc_port=$(free_port)
LD_LIBRARY_PATH="$mc_libs" "${server[@]}" "$MC_VENV/bin/mooncake_master" --port "$mc_master" \
    --enable_http_metadata_server=false >"$tmp/master.log" 2>&1 &
pids+=($!)
sleep 1
LD_LIBRARY_PATH="$mc_libs" "${server[@]}" "$MC_VENV/bin/mooncake_client" --global_segment_size "1 GB" \
    --host 127.0.0.1 --metadata_server P2PHANDSHAKE --master_server_address "127.0.0.1:$mc_master" \
    --protocol tcp --port "$mc_port" >"$tmp/mc_client.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do grep -q "Starting real client service" "$tmp/mc_client.log" && break; sleep 0.1; done
grep -q "Starting real client service" "$tmp/mc_client.log" || { echo "mooncake_client did not start: $tmp/mc_client.log" >&2; tail -5 "$tmp/mc_client.log" >&2; exit 1; }

# Ours: `up` on CPU 0, with the shared pool for the same-host path.
start_store 1GiB --shm-socket "$tmp/daemon.sock"
ours_tcp=$(free_port)
# The TCP daemon is a separate store whose pool is anonymous memory, as a
# remote daemon's is (a shared pool is a memfd, mapped with 4 KiB pages
# unless huge pages are set up: docs/operations.md).
"${server[@]}" "$BIN" up --meta-listen "127.0.0.1:$ours_tcp" --listen "127.0.0.1:$(free_port)" --admin "" \
    --dram 1GiB >/dev/null 2>&1 &
pids+=($!)
for _ in $(seq 300); do
    "$BIN" stat --meta "127.0.0.1:$ours_tcp" 2>/dev/null | grep -qE '^daemons +[1-9][0-9]* alive' && break
    sleep 0.1
done
taskset -apc 0 "$STORE_PID" >/dev/null # every thread of it

bench() { # store path python setup [extra]
    local who=$1 path=$2 py=$3 setup=$4
    shift 4
    "${client[@]}" "$py" client/python/bench/vs_mooncake.py --label "$who/$path" --sizes "$SIZES" \
        --batch "$BATCH" --bytes "$BYTES" --setup "$setup" "$@" 2>/dev/null | grep '^{' >>"$tmp/rows.jsonl"
    # What a run removed is freed in the background (both stores): let it
    # settle before the next run shares the core with it.
    sleep 3
}
# Round 0 warms both stores up (first touches of their memory, first
# puts of a size) and is not counted: the rounds measure steady state.
for r in $(seq 0 "$ROUNDS"); do
    echo "round $r of $ROUNDS" >&2
    [ "$r" = 1 ] && : >"$tmp/rows.jsonl"
    LD_LIBRARY_PATH="$mc_libs" GLOG_minloglevel=2 bench mooncake tcp "$MC_VENV/bin/python" \
        "[\"127.0.0.1\", \"P2PHANDSHAKE\", 0, 67108864, \"tcp\", \"\", \"127.0.0.1:$mc_master\"]"
    bench ours tcp "$VENV/bin/python" "[\"127.0.0.1\", \"\", 0, 67108864, \"tcp\", \"\", \"127.0.0.1:$ours_tcp\"]"
    LD_LIBRARY_PATH="$mc_libs" GLOG_minloglevel=2 bench mooncake host "$MC_VENV/bin/python" \
        "{\"dummy\": [268435456, 67108864, \"127.0.0.1:$mc_port\"]}" --host-allocator
    MOONCAKE_SHM_SOCKET="$tmp/daemon.sock" bench ours host "$VENV/bin/python" \
        "[\"127.0.0.1\", \"\", 0, 67108864, \"tcp\", \"\", \"$META\"]" --host-allocator
done

echo "machine: $(nproc) cores, $(uname -r); Mooncake $MOONCAKE_VERSION (mooncake-transfer-engine); batches of $BATCH blocks, $BYTES of blocks per size, $ROUNDS rounds (medians)"
"$VENV/bin/python" - "$tmp/rows.jsonl" <<'PY'
import json, statistics, sys
from collections import defaultdict
rows = [json.loads(l) for l in open(sys.argv[1])]
runs = defaultdict(list)
for r in rows:
    runs[(r["store"], r["size"])].append(r)
med = lambda rs, k: statistics.median(r[k] for r in rs)
size_name = lambda b: f"{b >> 20}MiB" if b >= 1 << 20 else f"{b >> 10}KiB"
print(f"{'path':<6}{'size':<8}{'op':<5}{'Mooncake GB/s':>14}{'p99 ms':>9}{'ours GB/s':>11}{'p99 ms':>9}{'ours vs Mooncake':>18}{'wrong bytes (M, ours)':>23}")
for path in ("tcp", "host"):
    for size in sorted({s for (_, s) in runs}):
        mc, us = runs.get((f"mooncake/{path}", size), []), runs.get((f"ours/{path}", size), [])
        if not mc or not us:
            continue
        for op in ("put", "get"):
            m, o = med(mc, f"{op}_gb_per_s"), med(us, f"{op}_gb_per_s")
            wrong = f"{sum(r['wrong_bytes'] for r in mc)}, {sum(r['wrong_bytes'] for r in us)}" if op == "get" else ""
            print(f"{path:<6}{size_name(size):<8}{op:<5}{m:>14.2f}{med(mc, f'{op}_p99_ms'):>9.2f}{o:>11.2f}{med(us, f'{op}_p99_ms'):>9.2f}{o / m:>17.2f}x{wrong:>23}")
failed = [(r["store"], r["size"]) for r in rows if r["put_failed"] or r["get_missed"]]
if failed:
    print("puts failed or gets missed in:", sorted(set(failed)))
PY
