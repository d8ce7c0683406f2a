"""From Python: what a lease does for a load of blocks that lie on the
daemon's NVMe drives. vLLM's scheduler looks a request's blocks up
(`batch_is_exist`, which leases what it finds) and its worker loads them
a scheduler step later. A lease that finds a block only on a drive has the
daemon bring it back to DRAM in that gap, so the load reads DRAM.
`batch_probe_key` leases nothing: the load then reads the drive.

Needs a store with a small DRAM pool over a drive, for example
`mooncake-store up --dram 64MiB --nvme /tmp/mc-drive.bin:1GiB`. Puts
`--blocks` blocks (several times DRAM), then, in turns, looks up
`--batch` blocks found only on the drive with either call, waits
`--gap-ms`, and loads them (`get_batch`, every byte checked). Each batch
is used once. Add --json for a script."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from mooncake.store import MooncakeDistributedStore


def value(i: int, size: int) -> bytes:
    return i.to_bytes(8, "little") * (size // 8)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--meta", default="127.0.0.1:7070")
    p.add_argument("--blocks", type=int, default=1024, help="blocks put")
    p.add_argument("--size", type=int, default=256 << 10, help="bytes a block")
    p.add_argument("--batch", type=int, default=16, help="blocks a lookup and its load")
    p.add_argument("--gap-ms", type=float, default=20.0, help="from the lookup to the load")
    p.add_argument("--rounds", type=int, default=20, help="batches of each kind")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()

    store = MooncakeDistributedStore()
    assert store.setup("localhost", "", 0, 0, "tcp", "", a.meta) == 0, "setup failed"
    keys = [f"bench/nvme-lease/{i}" for i in range(a.blocks)]
    for start in range(0, a.blocks, 16):
        chunk = keys[start : start + 16]
        vals = [value(start + j, a.size) for j in range(len(chunk))]
        assert store.put_batch(chunk, vals) == 0
    # Demotions are written in the background: wait until they settle.
    on_drive: list[int] = []
    for _ in range(100):
        descs = store.batch_get_replica_desc(keys)
        on_drive = [i for i, k in enumerate(keys) if k in descs and descs[k][0].is_disk_replica()]
        if len(on_drive) >= 2 * a.rounds * a.batch:
            break
        time.sleep(0.1)
    need = 2 * a.rounds * a.batch
    assert len(on_drive) >= need, f"{len(on_drive)} blocks on the drive, {need} needed: more --blocks"

    times: dict[str, list[float]] = {"batch_is_exist": [], "batch_probe_key": []}
    calls = {"batch_is_exist": store.batch_is_exist, "batch_probe_key": store.batch_probe_key}
    wrong = 0
    for r in range(a.rounds):
        for j, (name, lookup) in enumerate(calls.items()):
            first = (2 * r + j) * a.batch
            picked = on_drive[first : first + a.batch]
            batch = [keys[i] for i in picked]
            assert lookup(batch) == [1] * len(batch), name
            time.sleep(a.gap_ms / 1000)
            began = time.perf_counter()
            got = store.get_batch(batch)
            times[name].append(time.perf_counter() - began)
            wrong += sum(g != value(i, a.size) for g, i in zip(got, picked))
    store.remove_all()
    store.close()

    rows = []
    for name, t in times.items():
        t.sort()
        rows.append({
            "lookup": name,
            "leases": name == "batch_is_exist",
            "loads": len(t),
            "load_p50_ms": 1e3 * statistics.median(t),
            "load_p99_ms": 1e3 * t[int(0.99 * len(t))],
            "gb_per_s": len(t) * a.batch * a.size / sum(t) / 1e9,
        })
    if a.json:
        print(json.dumps({"rows": rows, "wrong_blocks": wrong, "batch": a.batch, "size": a.size,
                          "gap_ms": a.gap_ms}))
        return
    print(f"{a.batch} blocks of {a.size >> 10} KiB a load, {a.gap_ms:g} ms after the lookup; "
          f"blocks found only on the drive; wrong blocks: {wrong}")
    print(f"{'lookup':>16} {'leases':>7} {'loads':>6} {'load p50 ms':>12} {'p99 ms':>8} {'GB/s':>6}")
    for r in rows:
        print(f"{r['lookup']:>16} {str(r['leases']):>7} {r['loads']:>6} {r['load_p50_ms']:>12.2f}"
              f" {r['load_p99_ms']:>8.2f} {r['gb_per_s']:>6.2f}")
    assert wrong == 0, f"{wrong} blocks with wrong bytes"


if __name__ == "__main__":
    main()
