"""Same-host loads into GPU memory, the way a KV connector fills a
request's prefix: blocks read from the local daemon's shared pool into a
pinned staging buffer (`get_into_ptrs`), then copied to the GPU, two
staging buffers in turn so that the next read overlaps the copy. Every
eighth batch is compared on the GPU with the bytes that were put.

Prints one JSON line: GB/s of the reads into pinned memory alone, of the
pinned-to-GPU copy alone (the ceiling of this staging), and of the two
together. Needs PyTorch with CUDA and a daemon started with --shm-socket:

    mooncake-store up --dram 24GiB --shm-socket /tmp/mooncake.sock
    python3 gpu_load.py --meta 127.0.0.1:7070 --shm /tmp/mooncake.sock
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mooncake_store import Client


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--meta", default="127.0.0.1:7070")
    p.add_argument("--shm", required=True, help="the daemon's --shm-socket")
    p.add_argument("--size", type=int, default=256 << 10, help="block bytes")
    p.add_argument("--batch", type=int, default=128, help="blocks per call")
    p.add_argument("--blocks", type=int, default=8192, help="distinct blocks stored (a multiple of --batch)")
    p.add_argument("--rounds", type=int, default=60, help="timed calls per measurement")
    a = p.parse_args()
    if a.blocks % a.batch:
        p.error("--blocks must be a multiple of --batch")

    gpu = torch.device("cuda")
    client = Client(a.meta, shm_socket=a.shm, namespace="bench-gpu")
    size, batch, n = a.size, a.batch, a.blocks
    # The blocks are made on the GPU and kept there, to check loads against.
    source = torch.randint(0, 256, (n, size), dtype=torch.uint8, device=gpu)
    keys = [f"gpu-load/{size}/{i}" for i in range(n)]
    stage = [torch.empty((batch, size), dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    for s in stage:
        client.register_buffer(s.data_ptr(), s.numel())
    ptrs = [[s.data_ptr() + i * size for i in range(batch)] for s in stage]

    began = time.perf_counter()
    for first in range(0, n, batch):
        stage[0].copy_(source[first : first + batch])
        codes = client.put_from_ptrs(keys[first : first + batch], ptrs[0], [size] * batch)
        assert all(c == 0 for c in codes), codes[:4]
    put_gbs = n * size / (time.perf_counter() - began) / 1e9
    time.sleep(1.0)  # the client's view of the pool is set up in the background

    def load(call: int, into: int) -> int:
        first = (call * batch) % n
        got = client.get_into_ptrs(keys[first : first + batch], ptrs[into], [size] * batch)
        assert got == [size] * batch, got[:4]
        return first

    moved = a.rounds * batch * size
    for call in range(3):
        load(call, 0)
    began = time.perf_counter()
    for call in range(a.rounds):
        load(call, 0)
    pinned_gbs = moved / (time.perf_counter() - began) / 1e9

    dest = torch.empty((batch, size), dtype=torch.uint8, device=gpu)
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(a.rounds):
        dest.copy_(stage[0], non_blocking=True)
    torch.cuda.synchronize()
    h2d_gbs = moved / (time.perf_counter() - began) / 1e9

    stream = torch.cuda.Stream()
    copied: list[torch.cuda.Event | None] = [None, None]
    wrong = 0
    torch.cuda.synchronize()
    began = time.perf_counter()
    for call in range(a.rounds):
        k = call % 2
        if copied[k] is not None:
            copied[k].synchronize()  # the staging buffer is free again
        first = load(call, k)
        with torch.cuda.stream(stream):
            dest.copy_(stage[k], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
            copied[k] = event
        if call % 8 == 0:
            stream.synchronize()
            wrong += int(not torch.equal(dest, source[first : first + batch]))
    torch.cuda.synchronize()
    e2e_gbs = moved / (time.perf_counter() - began) / 1e9

    print(json.dumps({
        "block_bytes": size, "blocks_per_call": batch, "blocks": n,
        "put_gb_per_sec": round(put_gbs, 2),
        "load_into_pinned_gb_per_sec": round(pinned_gbs, 2),
        "pinned_to_gpu_gb_per_sec": round(h2d_gbs, 2),
        "store_to_gpu_gb_per_sec": round(e2e_gbs, 2),
        "checked_batches_wrong": wrong,
    }))


if __name__ == "__main__":
    main()
