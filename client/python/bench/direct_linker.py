"""From Python, in the shape of SGLang's direct linker: a request of PAGES
page objects, each LAYERS slices of LAYER bytes one after the other, loaded
into a layer-first pool a layer at a time (`batch_get_session_start`, one
`batch_get_into_multi_buffer_ranges` per layer, `batch_get_session_end`),
beside reading the same objects whole in one `batch_get_into`. Prints, for
each, GB/s of the request's bytes and when its first layer is in place;
add --json for a script. Host memory stands in for SGLang's GPU pool."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from mooncake.store import MooncakeDistributedStore


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--meta", default="127.0.0.1:7070")
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--layer-bytes", type=int, default=64 << 10, help="one layer of one page")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()

    store = MooncakeDistributedStore()
    assert store.setup("localhost", "", 0, 0, "tcp", "", a.meta) == 0, "setup failed"
    obj = a.layers * a.layer_bytes
    rng = np.random.default_rng(0)
    objects = rng.integers(0, 255, (a.pages, obj), dtype=np.uint8)
    whole = np.zeros_like(objects)
    pool = np.zeros((a.layers, a.pages, a.layer_bytes), dtype=np.uint8)
    for buf in (objects, whole, pool):
        assert store.register_buffer(buf.ctypes.data, buf.nbytes) == 0
    keys = [f"linker-{i:040x}_cp0_pp0" for i in range(a.pages)]
    codes = store.batch_put_from(keys, [objects[i].ctypes.data for i in range(a.pages)], [obj] * a.pages)
    assert codes == [0] * a.pages, codes
    total = a.pages * obj

    rows = {"whole objects (batch_get_into)": [], "layer by layer (read session)": []}
    firsts = {name: [] for name in rows}
    for _ in range(a.rounds):
        began = time.perf_counter()
        got = store.batch_get_into(keys, [whole[i].ctypes.data for i in range(a.pages)], [obj] * a.pages)
        done = time.perf_counter() - began
        assert got == [obj] * a.pages, got
        rows["whole objects (batch_get_into)"].append(done)
        firsts["whole objects (batch_get_into)"].append(done)

        began = time.perf_counter()
        assert store.batch_get_session_start(keys) == [0] * a.pages
        for layer in range(a.layers):
            got = store.batch_get_into_multi_buffer_ranges(
                keys, [[pool[layer, i].ctypes.data] for i in range(a.pages)],
                [[a.layer_bytes]] * a.pages, [[layer * a.layer_bytes]] * a.pages)
            assert got == [a.layer_bytes] * a.pages, got
            if layer == 0:
                firsts["layer by layer (read session)"].append(time.perf_counter() - began)
        store.batch_get_session_end(keys)
        rows["layer by layer (read session)"].append(time.perf_counter() - began)
    assert np.array_equal(pool.transpose(1, 0, 2).reshape(a.pages, obj), objects)
    assert np.array_equal(whole, objects)

    out = []
    for name, times in rows.items():
        out.append({
            "op": name, "pages": a.pages, "layers": a.layers, "bytes": total, "rounds": a.rounds,
            "gb_per_s": total / statistics.median(times) / 1e9,
            "first_layer_ms": statistics.median(firsts[name]) * 1e3,
            "all_ms": statistics.median(times) * 1e3,
        })
    if a.json:
        for row in out:
            print(json.dumps(row))
        return
    print(f"{a.pages} pages x {a.layers} layers x {a.layer_bytes} B = {total / 2**20:.0f} MiB a request, "
          f"median of {a.rounds}")
    for row in out:
        print(f"{row['op']:<32} {row['gb_per_s']:6.2f} GB/s  first layer {row['first_layer_ms']:7.2f} ms"
              f"  all {row['all_ms']:7.2f} ms")
    store.remove_all()
    store.close()


if __name__ == "__main__":
    main()
