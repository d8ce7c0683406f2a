"""From Python: batch_get_into of BATCH blocks into one registered buffer,
through the compatible API, the way a KV connector loads a request's
prefix. Prints GB/s and per-batch latency (add --json for a script)."""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import numpy as np

from mooncake.store import MooncakeDistributedStore


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--meta", default="127.0.0.1:7070")
    p.add_argument("--size", type=int, default=256 << 10, help="block bytes")
    p.add_argument("--batch", type=int, default=128, help="blocks per call")
    p.add_argument("--blocks", type=int, default=2048, help="distinct blocks stored")
    p.add_argument("--batches", type=int, default=200, help="calls per thread")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()

    store = MooncakeDistributedStore()
    assert store.setup("localhost", "", 0, 0, "tcp", "", a.meta) == 0, "setup failed"
    rng = np.random.default_rng(0)
    source = rng.integers(0, 255, a.batch * a.size, dtype=np.uint8)
    assert store.register_buffer(source.ctypes.data, source.nbytes) == 0
    keys = [f"bench/py/{i}" for i in range(a.blocks)]
    for start in range(0, a.blocks, a.batch):
        chunk = keys[start : start + a.batch]
        ptrs = [source.ctypes.data + i * a.size for i in range(len(chunk))]
        codes = store.batch_put_from(chunk, ptrs, [a.size] * len(chunk))
        assert all(c == 0 for c in codes), codes

    latencies: list[float] = []
    lock = threading.Lock()

    def worker(t: int) -> None:
        dest = np.zeros(a.batch * a.size, dtype=np.uint8)
        assert store.register_buffer(dest.ctypes.data, dest.nbytes) == 0
        ptrs = [dest.ctypes.data + i * a.size for i in range(a.batch)]
        sizes = [a.size] * a.batch
        mine = []
        for b in range(a.batches):
            start = ((b * a.threads + t) * a.batch) % a.blocks
            chunk = (keys + keys)[start : start + a.batch]
            began = time.perf_counter()
            got = store.batch_get_into(chunk, ptrs, sizes)
            mine.append(time.perf_counter() - began)
            if b == 0:
                assert got == sizes, got
                offset = start % a.batch
                assert np.array_equal(dest[: a.size], source[offset * a.size : (offset + 1) * a.size])
        store.unregister_buffer(dest.ctypes.data)
        with lock:
            latencies.extend(mine)

    began = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(a.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    total = a.threads * a.batches * a.batch * a.size
    lat = sorted(latencies)
    result = {
        "size": a.size,
        "batch": a.batch,
        "threads": a.threads,
        "calls": len(lat),
        "gb_per_s": total / elapsed / 1e9,
        "p50_ms": statistics.median(lat) * 1e3,
        "p99_ms": lat[int(len(lat) * 0.99) - 1] * 1e3,
    }
    store.remove_all()
    store.close()
    if a.json:
        print(json.dumps(result))
    else:
        print(
            f"python batch_get_into  {a.batch} x {a.size >> 10} KiB, {a.threads} thread(s): "
            f"{result['gb_per_s']:.2f} GB/s, p50 {result['p50_ms']:.2f} ms, p99 {result['p99_ms']:.2f} ms"
        )


if __name__ == "__main__":
    main()
