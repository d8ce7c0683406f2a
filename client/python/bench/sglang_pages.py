"""From Python, in SGLang HiCache's shape: a request of PAGES pages whose K
and V live in two separate host buffers, written and read through the
compatible API two ways, as SGLang does for MHA pools (`batch_put_from` /
`batch_get_into`, two objects a page) and for MLA and hybrid pools
(`batch_put_from_multi_buffers` / `batch_get_into_multi_buffers`, one
object a page from two pieces). Then the prefix check of a request: one
`is_exist` per page, one `batch_is_exist`, and `match_prefix` from
`mooncake_store` (one round trip). Prints GB/s and per-call latency; add
--json for a script."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import mooncake_store
from mooncake.store import MooncakeDistributedStore


def timed(calls: int, f) -> list[float]:
    out = []
    for i in range(calls):
        began = time.perf_counter()
        f(i)
        out.append(time.perf_counter() - began)
    return out


def summary(name: str, lat: list[float], nbytes: int) -> dict:
    lat = sorted(lat)
    return {
        "op": name,
        "calls": len(lat),
        "gb_per_s": nbytes * len(lat) / sum(lat) / 1e9 if nbytes else 0.0,
        "p50_ms": statistics.median(lat) * 1e3,
        "p99_ms": lat[max(0, int(len(lat) * 0.99) - 1)] * 1e3,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--meta", default="127.0.0.1:7070")
    p.add_argument("--pages", type=int, default=64, help="pages per request")
    p.add_argument("--piece", type=int, default=256 << 10, help="bytes of K (and of V) per page")
    p.add_argument("--requests", type=int, default=30, help="distinct requests stored")
    p.add_argument("--rounds", type=int, default=3, help="reads of every request")
    p.add_argument("--prefix-pages", type=int, default=128, help="pages of the prefix check")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()

    store = MooncakeDistributedStore()
    assert store.setup("localhost", "", 0, 0, "tcp", "", a.meta) == 0, "setup failed"
    rng = np.random.default_rng(0)
    # A host pool: K pages, then V pages (SGLang's page_first layout).
    pool = rng.integers(0, 255, (2, a.pages, a.piece), dtype=np.uint8)
    k0, v0 = pool[0].ctypes.data, pool[1].ctypes.data
    assert store.register_buffer(pool.ctypes.data, pool.nbytes) == 0
    dest = np.zeros_like(pool)
    d0, dv0 = dest[0].ctypes.data, dest[1].ctypes.data
    assert store.register_buffer(dest.ctypes.data, dest.nbytes) == 0
    request_bytes = 2 * a.pages * a.piece

    def two_objects(r: int, base_k: int, base_v: int):
        keys = [f"bench/sg/{r}/{i}_0_{kv}" for i in range(a.pages) for kv in "kv"]
        ptrs = [b + i * a.piece for i in range(a.pages) for b in (base_k, base_v)]
        return keys, ptrs, [a.piece] * len(keys)

    def one_object(r: int, base_k: int, base_v: int):
        keys = [f"bench/sgm/{r}/{i}__k" for i in range(a.pages)]
        ptrs = [[base_k + i * a.piece, base_v + i * a.piece] for i in range(a.pages)]
        return keys, ptrs, [[a.piece, a.piece]] * a.pages

    results = []
    for name, layout, put, get in (
        ("batch_put_from", two_objects, store.batch_put_from, store.batch_get_into),
        ("multi_buffers", one_object, store.batch_put_from_multi_buffers,
         store.batch_get_into_multi_buffers),
    ):
        def put_one(r: int) -> None:
            codes = put(*layout(r, k0, v0))
            assert all(c == 0 for c in codes), codes

        def get_one(i: int) -> None:
            keys, ptrs, sizes = layout(i % a.requests, d0, dv0)
            got = get(keys, ptrs, sizes)
            assert all(g > 0 for g in got), got

        results.append(summary(f"put {name}", timed(a.requests, put_one), request_bytes))
        results.append(summary(f"get {name}", timed(a.requests * a.rounds, get_one), request_bytes))
        assert np.array_equal(dest, pool), f"{name}: bytes differ"
        dest[:] = 0

    # The prefix check of a request of --prefix-pages pages, all stored.
    client = mooncake_store.Client(a.meta)
    keys = [f"bench/prefix/{i}" for i in range(a.prefix_pages)]
    client.put_batch(keys, [b"x" * 64] * len(keys))
    compat = MooncakeDistributedStore()
    assert compat.setup("localhost", "", 0, 0, "tcp", "", a.meta) == 0
    checks = (
        ("is_exist x pages", lambda _: [compat.is_exist(k) for k in keys]),
        ("batch_is_exist", lambda _: compat.batch_is_exist(keys)),
        ("match_prefix", lambda _: client.match_prefix(keys)),
    )
    for name, f in checks:
        results.append(summary(f"prefix {name}", timed(50, f), 0))
    client.remove(keys)
    store.remove_all()

    if a.json:
        print(json.dumps(results))
        return
    print(f"{a.pages} pages of K and V, {a.piece} B each ({request_bytes / 2**20:.0f} MiB a request); "
          f"prefix check of {a.prefix_pages} pages")
    print(f"{'op':<28}{'GB/s':>8}{'p50 ms':>10}{'p99 ms':>10}")
    for r in results:
        gbs = f"{r['gb_per_s']:.2f}" if r["gb_per_s"] else "-"
        print(f"{r['op']:<28}{gbs:>8}{r['p50_ms']:>10.2f}{r['p99_ms']:>10.2f}")


if __name__ == "__main__":
    main()
