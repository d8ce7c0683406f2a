"""SGLang HiCache's L3 calls, timed: its own `mooncake` backend and the
native backend, each driving an SGLang MHA `page_first` host pool of
REQUESTS requests of PAGES pages (64 tokens, 8 heads of 128, fp16, LAYERS
layers: K and V of a page are 512 KiB each at 4 layers). Per backend:
`batch_set_v1` of each request, `batch_exists` (the prefix check) and
`batch_get_v1` of each request into other pages; GB/s and per-call
latency. Run by `tools/bench/engines.sh` when the engines' environment is
there (`tools/test-engines.sh` makes it).

Usage: python sglang_bench.py META_ADDR [--requests N] [--layers N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

PAGE, HEADS, DIM, PAGES = 64, 8, 128, 64


def pool(layers: int, pages: int, heads: int = HEADS, dim: int = DIM) -> MHATokenToKVPoolHost:
    """An SGLang MHA `page_first` host pool of `pages` pages, filled with
    random bytes (also `sglang_replay.py`'s)."""
    tokens = pages * PAGE
    k = tuple(torch.zeros(tokens + PAGE, heads, dim, dtype=torch.float16) for _ in range(layers))
    v = tuple(torch.zeros(tokens + PAGE, heads, dim, dtype=torch.float16) for _ in range(layers))
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                          layout=KVBufferLayout.NHD),
        page_size=PAGE, head_num=heads, head_dim=dim, v_head_dim=dim,
        dtype=torch.float16, device=torch.device("cpu"),
    )
    host = MHATokenToKVPoolHost(
        info, 2.0, 0, PAGE, "page_first", pin_memory=False, device="cpu",
        device_capacity_tokens=tokens, start_layer=0, end_layer=layers - 1,
    )
    raw = host.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 255, raw.shape, dtype=torch.uint8))
    return host


def config(extra: dict) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="bench/model", extra_config=extra,
    )


def backends(meta: str, host):
    compat = MooncakeStore(config({"master_server_address": meta, "protocol": "tcp",
                                   "global_segment_size": 0, "check_server": False}))
    compat.register_mem_pool_host(host)
    yield "sglang mooncake", compat
    native = StorageBackendFactory.create_backend("dynamic", config(
        {"backend_name": "mooncake_store", "module_path": "mooncake_store.engines.sglang",
         "class_name": "MooncakeStoreHiCache", "meta": meta}), host)
    native.register_mem_pool_host(host)
    yield "native", native


def row(name: str, op: str, lat: list[float], nbytes: int) -> str:
    lat = sorted(lat)
    gbs = f"{nbytes * len(lat) / sum(lat) / 1e9:.2f}" if nbytes else "-"
    p99 = lat[max(0, int(len(lat) * 0.99) - 1)] * 1e3
    return f"{name:<17}{op:<14}{gbs:>8}{statistics.median(lat) * 1e3:>10.2f}{p99:>10.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("meta")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    a = p.parse_args()
    host = pool(a.layers, 2 * PAGES)
    page_bytes = 2 * a.layers * PAGE * HEADS * DIM * 2
    src = torch.arange(0, PAGES * PAGE, dtype=torch.int64)
    dst = torch.arange(PAGES * PAGE, 2 * PAGES * PAGE, dtype=torch.int64)
    print(f"{a.requests} requests of {PAGES} pages, {page_bytes >> 10} KiB a page (K and V)")
    print(f"{'backend':<17}{'op':<14}{'GB/s':>8}{'p50 ms':>10}{'p99 ms':>10}")
    for name, store in backends(a.meta, host):
        requests = [[f"{r:08x}{i:056x}" for i in range(PAGES)] for r in range(a.requests)]
        sets, exists, gets = [], [], []
        for keys in requests:
            began = time.perf_counter()
            assert store.batch_set_v1(keys, src) == [True] * PAGES
            sets.append(time.perf_counter() - began)
        for _ in range(3):
            for keys in requests:
                began = time.perf_counter()
                assert store.batch_exists(keys) == PAGES
                exists.append(time.perf_counter() - began)
                began = time.perf_counter()
                assert store.batch_get_v1(keys, dst) == [True] * PAGES
                gets.append(time.perf_counter() - began)
        print(row(name, "batch_set_v1", sets, PAGES * page_bytes))
        print(row(name, "batch_exists", exists, 0))
        print(row(name, "batch_get_v1", gets, PAGES * page_bytes))
        store.clear()


if __name__ == "__main__":
    main()
