"""LMCache's remote tier on this store, timed: LMCache's own `RemoteBackend`
with its `mooncakestore` connector (zero copy mode) and with the native
connector `mooncake_store.engines.lmcache`, each storing REQUESTS requests
of CHUNKS chunks (256 tokens, 4 layers of K and V, 8 heads of 128, bf16:
4 MiB a chunk), then LMCache's prefix lookup of a request
(`batched_contains`) and its batched read (`batched_get_blocking`); GB/s
and per-call latency. Run by `tools/bench/engines.sh` when the engines'
environment is there (`tools/test-engines.sh` makes it).

Usage: python lmcache_bench.py META_ADDR [--requests N] [--chunks N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import threading
import time

import torch

from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

from lmcache_remote import DTYPE, TOKENS, Done, config, key, metadata

LAYERS, HEADS, DIM = 4, 8, 128


def bench(meta: str, mode: str, loop, requests: int, chunks: int) -> list[str]:
    cfg, md = config(meta, mode), metadata(LAYERS, HEADS, DIM)
    cfg.max_local_cpu_size = 2.0
    cpu = LocalCPUBackend(config=cfg, metadata=md, dst_device="cpu")
    backend = RemoteBackend(config=cfg, metadata=md, loop=loop, local_cpu_backend=cpu, dst_device="cpu")
    shape = torch.Size([2, LAYERS, TOKENS, HEADS * DIM])
    objs = [cpu.allocate(shape, DTYPE, MemoryFormat.KV_2LTD) for _ in range(chunks)]
    for obj in objs:
        obj.tensor.copy_(torch.randn(shape).to(DTYPE))
    chunk_bytes = objs[0].get_size()
    run_id = os.urandom(4).hex()
    puts, lookups, gets = [], [], []
    for r in range(requests):
        keys = [key(f"bench/{mode}/{run_id}/{r}/{i}") for i in range(chunks)]
        written = Done(chunks)
        t = time.perf_counter()
        backend.batched_submit_put_task(keys, objs, on_complete_callback=written.one)
        written.wait(timeout=60)
        puts.append(time.perf_counter() - t)
        t = time.perf_counter()
        found = backend.batched_contains(keys)
        lookups.append(time.perf_counter() - t)
        assert found == chunks, found
        t = time.perf_counter()
        got = backend.batched_get_blocking(keys)
        gets.append(time.perf_counter() - t)
        assert all(g is not None for g in got)
        for g in got:
            g.ref_count_down()
    for obj in objs:
        obj.ref_count_down()
    backend.close()
    name = "native" if mode == "native" else "mooncakestore"
    total = chunks * chunk_bytes
    row = lambda op, times, moved: (
        f"{name:<15}{op:<22}"
        + (f"{moved * len(times) / sum(times) / 1e9:>8.2f}" if moved else f"{'-':>8}")
        + f"{statistics.median(times) * 1e3:>10.2f}{max(times) * 1e3:>10.2f}"
    )
    return [
        row("batched put", puts, total),
        row(f"batched_contains x{chunks}", lookups, 0),
        row("batched_get_blocking", gets, total),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("meta")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=32)
    args = parser.parse_args()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    print(f"{args.requests} requests of {args.chunks} chunks, 4 MiB a chunk (256 tokens, 4 layers, 8 heads of 128)")
    print(f"{'connector':<15}{'op':<22}{'GB/s':>8}{'p50 ms':>10}{'max ms':>10}")
    try:
        for mode in ("zero copy", "native"):
            for line in bench(args.meta, mode, loop, args.requests, args.chunks):
                print(line)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)


if __name__ == "__main__":
    main()
