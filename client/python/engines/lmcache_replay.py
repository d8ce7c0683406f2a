"""A Mooncake-format trace replayed through LMCache's own `mooncakestore`
connector (LMCache's `RemoteBackend` and `MooncakestoreConnector`,
unchanged) on this store: the hit rate an LMCache deployment gets from the
store, measured with the engine's code.

Each request goes as LMCache's storage manager drives its remote tier:
whether each chunk exists, one `is_exist` a chunk up to the first missing
one (`batched_contains`, LMCache's prefix lookup), the chunks found read
(`batched_get_blocking`), then the rest put in one call
(`batched_submit_put_task`, which is `batch_put_from` in the connector's
zero-copy mode, `save_chunk_meta: false`, the mode Mooncake deployments of
LMCache configure). With `--native`, through this package's own LMCache
connector instead (`mooncake_store.engines.lmcache`: one prefix match a
lookup, each put a chain naming its parent). One trace block is one LMCache
chunk of 256 tokens, one layer, one head of `--dim` (a chunk is `--dim`
KiB). The token hit rate is counted as `mooncake-store replay` counts it (a
request hits its leading stored blocks, at 512 tokens a block), so the two
can be set side by side. Exits non-zero if a put failed or nothing hit.
`tools/test-engines.sh` runs it on a short trace; run it by hand on longer
ones where that script made the engines' environment.

Usage: python lmcache_replay.py META_ADDR TRACE [--limit N] [--dim N] [--native]
"""

from __future__ import annotations

import asyncio
import threading
import time

import torch

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

from lmcache_remote import DTYPE, MODEL, TOKENS, Done, config, metadata
from trace_replay import arguments, load, replay


def main() -> None:
    p = arguments(__doc__, 1, "head size: a chunk is dim KiB")
    p.add_argument("--native", action="store_true", help="this package's LMCache connector")
    a = p.parse_args()
    requests = load(a.trace, a.limit)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cfg = config(a.meta, "native" if a.native else "zero copy")
    md = metadata(layers=1, heads=1, dim=a.dim)
    cpu = LocalCPUBackend(config=cfg, metadata=md, dst_device="cpu")
    backend = RemoteBackend(config=cfg, metadata=md, loop=loop, local_cpu_backend=cpu, dst_device="cpu")
    connector = backend.connection
    connector = getattr(connector, "getWrappedConnector", lambda: connector)()
    wanted = "MooncakeStoreRemote" if a.native else "MooncakestoreConnector"
    assert type(connector).__name__ == wanted, type(connector)
    shape = torch.Size([2, 1, TOKENS, a.dim])
    # A fresh chunk hash per block and run, so that an earlier run's chunks do not count.
    run = time.time_ns() << 64

    def key(block: int) -> CacheEngineKey:
        return CacheEngineKey(model_name=MODEL, world_size=1, worker_id=0, chunk_hash=run | block, dtype=DTYPE)

    def one(req: dict) -> int:
        keys = [key(i) for i in req["hash_ids"]]
        found = backend.batched_contains(keys)
        usable = 0
        if found:
            got = backend.batched_get_blocking(keys[:found])
            usable = next((i for i, obj in enumerate(got) if obj is None), found)
            for obj in got:
                if obj is not None:
                    obj.ref_count_down()
        missing = keys[usable:]
        if missing:
            objs = [cpu.allocate(shape, DTYPE, MemoryFormat.KV_2LTD) for _ in missing]
            assert all(obj is not None for obj in objs), "LMCache's CPU allocator is full"
            done = Done(len(missing))
            backend.batched_submit_put_task(missing, objs, on_complete_callback=done.one)
            done.wait(timeout=60)
            for obj in objs:
                obj.ref_count_down()
        return usable

    try:
        replay(requests, one, lambda: backend.put_failed_count)
    finally:
        backend.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)


if __name__ == "__main__":
    main()
