"""From Python: what Mooncake's lease costs a lookup. `batch_is_exist`
leases every key it finds (each daemon holding one keeps it from eviction
for its `kv_lease_ttl`: a round trip to the daemons after the index's
answer); `batch_probe_key` only asks the index. Both on the same stored
keys, alternating call by call, for each batch size: latency per call
(p50, p99) and the lease's cost. Add --json for a script."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from mooncake.store import MooncakeDistributedStore


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--meta", default="127.0.0.1:7070")
    p.add_argument("--blocks", type=int, default=4096, help="keys stored (4 KiB each)")
    p.add_argument("--batches", default="1,32,256", help="keys per call")
    p.add_argument("--calls", type=int, default=2000, help="calls of each kind per batch size")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()

    store = MooncakeDistributedStore()
    assert store.setup("localhost", "", 0, 0, "tcp", "", a.meta) == 0, "setup failed"
    keys = [f"bench/lease/{i}" for i in range(a.blocks)]
    for start in range(0, a.blocks, 256):
        chunk = keys[start : start + 256]
        assert store.put_batch(chunk, [b"k" * 4096] * len(chunk)) == 0

    rows = []
    for batch in (int(b) for b in a.batches.split(",")):
        times: dict[str, list[float]] = {"batch_is_exist": [], "batch_probe_key": []}
        calls = {"batch_is_exist": store.batch_is_exist, "batch_probe_key": store.batch_probe_key}
        for i in range(a.calls):
            start = (i * batch) % a.blocks
            chunk = (keys + keys)[start : start + batch]
            for name, call in calls.items():
                began = time.perf_counter()
                found = call(chunk)
                times[name].append(time.perf_counter() - began)
                assert found == [1] * batch, (name, found)
        row = {"batch": batch}
        for name, t in times.items():
            t.sort()
            row[name] = {"p50_us": 1e6 * statistics.median(t), "p99_us": 1e6 * t[int(0.99 * len(t))]}
        row["lease_cost_us_p50"] = row["batch_is_exist"]["p50_us"] - row["batch_probe_key"]["p50_us"]
        rows.append(row)
    store.remove_all()
    store.close()

    if a.json:
        print(json.dumps(rows))
        return
    print(f"{'keys/call':>9}  {'batch_is_exist p50/p99 us':>26}  {'batch_probe_key p50/p99 us':>27}  {'lease p50 us':>12}")
    for r in rows:
        e, q = r["batch_is_exist"], r["batch_probe_key"]
        print(f"{r['batch']:>9}  {e['p50_us']:>12.0f} / {e['p99_us']:<11.0f}  {q['p50_us']:>13.0f} / {q['p99_us']:<11.0f}"
              f"  {r['lease_cost_us_p50']:>12.0f}")


if __name__ == "__main__":
    main()
