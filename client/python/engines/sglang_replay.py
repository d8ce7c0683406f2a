"""A Mooncake-format trace replayed through SGLang HiCache's own `mooncake`
backend (its `MooncakeStore` class, unchanged) on this store: the hit rate
an SGLang deployment gets from the store, measured with the engine's code.

Each request goes as HiCache's storage layer drives it when nothing of the
request is in SGLang's own memory: `batch_exists` of its pages (the prefix
check, SGLang's prefetch), `batch_get_v1` of the pages found, then
`batch_set_v1` of the rest (SGLang's backup: its own existence check, then
the puts). One trace block is one SGLang page of 64 tokens, one layer, one
head of 8 (`--dim`): its K and V are 1 KiB objects each. The token hit rate is
counted as `mooncake-store replay` counts it (a request hits its leading
stored blocks, at 512 tokens a block), so the two can be set side by side.
Exits non-zero if a set failed or nothing hit. `tools/test-engines.sh`
runs it on a short trace; run it by hand on longer ones where that script
made the engines' environment.

Usage: python sglang_replay.py META_ADDR TRACE [--limit N] [--dim N]
"""

from __future__ import annotations

import time

import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

from sglang_bench import PAGE, pool
from trace_replay import arguments, load, replay


def main() -> None:
    a = arguments(__doc__, 8, "head size: K and V of a page are dim KiB / 8").parse_args()
    requests = load(a.trace, a.limit)
    longest = max(len(r["hash_ids"]) for r in requests)
    host = pool(1, longest, heads=1, dim=a.dim)
    store = MooncakeStore(HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="replay/model",
        extra_config={"master_server_address": a.meta, "protocol": "tcp",
                      "global_segment_size": 0, "check_server": False},
    ))
    store.register_mem_pool_host(host)
    # A fresh prefix per run, so that an earlier run's pages do not count.
    run = f"{time.time_ns():016x}"
    failed = [0]

    def one(req: dict) -> int:
        keys = [f"{run}{i:048x}" for i in req["hash_ids"]]
        pages = torch.arange(0, len(keys) * PAGE, dtype=torch.int64)
        found = store.batch_exists(keys)
        read = store.batch_get_v1(keys[:found], pages[: found * PAGE]) if found else []
        usable = next((i for i, ok in enumerate(read) if not ok), found)
        if usable < len(keys):
            stored = store.batch_set_v1(keys[usable:], pages[usable * PAGE:])
            failed[0] += stored.count(False)
        return usable

    replay(requests, one, lambda: failed[0])


if __name__ == "__main__":
    main()
