"""The engines' zero-copy calls, timed, through whichever `mooncake.store`
this Python imports: this repository's, or Mooncake's own
(`mooncake-transfer-engine`), so that the two stores are measured by the
same client loop. `tools/bench/vs-mooncake.sh` runs it against both.

For each block size: BLOCKS blocks put with `batch_put_from` in calls of
BATCH keys from a registered buffer (as SGLang HiCache and vLLM put pages),
then read back ROUNDS times with `batch_get_into` into another registered
buffer, every byte compared with what was put. Prints one JSON object a
size: GB/s of puts and gets, p50 and p99 of a call, wrong bytes.

Usage: python vs_mooncake.py --setup JSON [--sizes 256KiB,4MiB] [--bytes 256MiB]
       [--batch 16] [--rounds 4] [--host-allocator] [--label NAME]
  --setup: `setup`'s arguments as a JSON list (local_hostname,
  metadata_server, global_segment_size, local_buffer_size, protocol,
  device_name, master_server_addr), or {"dummy": [mem_pool_size,
  local_buffer_size, server_address]} for `setup_dummy`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from mooncake.store import MooncakeDistributedStore, MooncakeHostMemAllocator

UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def size(text: str) -> int:
    for unit, factor in UNITS.items():
        if text.endswith(unit):
            return int(text[: -len(unit)]) * factor
    return int(text)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", required=True)
    p.add_argument("--sizes", default="256KiB,4MiB")
    p.add_argument("--bytes", default="256MiB", help="bytes of distinct blocks per size")
    p.add_argument("--batch", type=int, default=16, help="keys per call")
    p.add_argument("--rounds", type=int, default=4, help="times each block is read back")
    p.add_argument("--label", default="")
    p.add_argument(
        "--host-allocator", action="store_true",
        help="buffers from MooncakeHostMemAllocator (Mooncake's setup_dummy needs its shared memory)",
    )
    a = p.parse_args()

    store = MooncakeDistributedStore()
    setup = json.loads(a.setup)
    rc = store.setup_dummy(*setup["dummy"]) if isinstance(setup, dict) else store.setup(*setup)
    assert rc == 0, f"setup answered {rc}"
    store.remove_all(True)  # each run starts empty
    total = size(a.bytes)
    if a.host_allocator:
        allocator = MooncakeHostMemAllocator()
        src, dst = (
            np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * total).from_address(allocator.alloc(total)))
            for _ in range(2)
        )
    else:
        src, dst = np.empty(total, dtype=np.uint8), np.zeros(total, dtype=np.uint8)
    src[:] = np.random.default_rng(1).integers(0, 255, total, dtype=np.uint8)
    for buf in (src, dst):
        assert store.register_buffer(buf.ctypes.data, buf.nbytes) == 0, "register_buffer failed"
    dst[:] = 0  # mapped before any get, as an engine's KV pool is
    differs = np.ones(total, dtype=bool)
    for block in map(size, a.sizes.split(",")):
        n = total // block
        keys = [f"vs-{a.label}-{block}-{i:08d}" for i in range(n)]
        calls = [list(range(i, min(n, i + a.batch))) for i in range(0, n, a.batch)]
        put_t: list[float] = []
        put_failed = 0
        started = time.perf_counter()
        for call in calls:
            t = time.perf_counter()
            codes = store.batch_put_from(
                [keys[i] for i in call], [src.ctypes.data + i * block for i in call], [block] * len(call)
            )
            put_t.append(time.perf_counter() - t)
            put_failed += sum(1 for c in codes if c != 0)
        put_s = time.perf_counter() - started
        get_t: list[float] = []
        wrong = missed = 0
        started = time.perf_counter()
        for _ in range(a.rounds):
            dst[: n * block] = 0
            read = np.zeros(n, dtype=bool)  # the blocks a get said it read whole
            for call in calls:
                t = time.perf_counter()
                got = store.batch_get_into(
                    [keys[i] for i in call], [dst.ctypes.data + i * block for i in call], [block] * len(call)
                )
                get_t.append(time.perf_counter() - t)
                for i, g in zip(call, got):
                    read[i] = g == block
            missed += int(n - read.sum())
            # Wrong bytes: in blocks a get said it read, bytes not the ones put.
            np.not_equal(dst[: n * block], src[: n * block], out=differs[: n * block])
            wrong += int(differs[: n * block].reshape(n, block)[read].sum())
        get_s = time.perf_counter() - started
        # The zeroing of dst between rounds is not a get: take it out.
        get_busy = sum(get_t)
        print(json.dumps({
            "store": a.label, "size": block, "blocks": n, "batch": a.batch,
            "put_gb_per_s": round(n * block / put_s / 1e9, 3),
            "put_p50_ms": round(statistics.median(put_t) * 1e3, 2),
            "put_p99_ms": round(percentile(put_t, 0.99) * 1e3, 2),
            "put_failed": put_failed,
            "get_gb_per_s": round(a.rounds * n * block / get_busy / 1e9, 3),
            "get_p50_ms": round(statistics.median(get_t) * 1e3, 2),
            "get_p99_ms": round(percentile(get_t, 0.99) * 1e3, 2),
            "get_missed": missed,
            "wrong_bytes": wrong,
            "get_wall_s": round(get_s, 2),
        }), flush=True)
        store.batch_remove(keys, True)  # force: past Mooncake's read leases
    store.close()


if __name__ == "__main__":
    main()
