"""From Python: what Mooncake's lease costs a lookup. `batch_is_exist`
leases every key it finds (each daemon holding one keeps it from eviction
for its `kv_lease_ttl`); `batch_probe_key` only asks the index. The
client asks the daemons where it saw a key before while it asks the
index, and the others after the index's answer. Two cases per batch size:
keys this client put ("seen": both calls alternating on the same keys),
and keys a fresh client never saw ("unseen": each key looked up once,
`batch_is_exist` first). Latency per call (p50, p99) and the lease's
cost. Add --json for a script."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from mooncake.store import MooncakeDistributedStore


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--meta", default="127.0.0.1:7070")
    p.add_argument("--blocks", type=int, default=16384, help="keys stored (4 KiB each)")
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

    def measure(client, batch: int, chunks) -> dict:
        times: dict[str, list[float]] = {"batch_is_exist": [], "batch_probe_key": []}
        calls = {"batch_is_exist": client.batch_is_exist, "batch_probe_key": client.batch_probe_key}
        for chunk in chunks:
            for name, call in calls.items():
                began = time.perf_counter()
                found = call(chunk)
                times[name].append(time.perf_counter() - began)
                assert found == [1] * len(chunk), (name, found)
        row = {"batch": batch, "calls": len(times["batch_is_exist"])}
        for name, t in times.items():
            t.sort()
            row[name] = {"p50_us": 1e6 * statistics.median(t), "p99_us": 1e6 * t[int(0.99 * len(t))]}
        row["lease_cost_us_p50"] = row["batch_is_exist"]["p50_us"] - row["batch_probe_key"]["p50_us"]
        return row

    rows = []
    for batch in (int(b) for b in a.batches.split(",")):
        seen = [(keys + keys)[(i * batch) % a.blocks :][:batch] for i in range(a.calls)]
        rows.append({"keys": "seen"} | measure(store, batch, seen))
        reader = MooncakeDistributedStore()
        assert reader.setup("localhost", "", 0, 0, "tcp", "", a.meta) == 0, "setup failed"
        unseen = [keys[i * batch : (i + 1) * batch] for i in range(min(a.calls, a.blocks // batch))]
        rows.append({"keys": "unseen"} | measure(reader, batch, unseen))
        reader.close()
    store.remove_all()
    store.close()

    if a.json:
        print(json.dumps(rows))
        return
    print(f"{'keys':>6} {'keys/call':>9} {'calls':>6}  {'batch_is_exist p50/p99 us':>26}"
          f"  {'batch_probe_key p50/p99 us':>27}  {'lease p50 us':>12}")
    for r in rows:
        e, q = r["batch_is_exist"], r["batch_probe_key"]
        print(f"{r['keys']:>6} {r['batch']:>9} {r['calls']:>6}  {e['p50_us']:>12.0f} / {e['p99_us']:<11.0f}"
              f"  {q['p50_us']:>13.0f} / {q['p99_us']:<11.0f}  {r['lease_cost_us_p50']:>12.0f}")

if __name__ == "__main__":
    main()
