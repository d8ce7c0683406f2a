"""SGLang HiCache on this store: its own Mooncake backend, unchanged, and
the native backend `mooncake_store.engines.sglang`, loaded the way SGLang
loads a dynamic storage backend.

Imports `MooncakeStore` from the installed `sglang` package, gives it a
real CPU host KV pool of SGLang's (`MHATokenToKVPoolHost`, page_first
layout, then an MLA pool) and the store's address the way SGLang's docs
say (`extra_config` with `master_server_address`), and drives it through
the calls HiCache makes: set pages, check the prefix, get them back into
other pages of the pool, byte for byte. Then the same through SGLang's
`StorageBackendFactory` with `--hicache-storage-backend dynamic` and the
native backend's extra config. Run by `tools/test-engines.sh`.

Usage: python sglang_hicache.py META_ADDR
"""

from __future__ import annotations

import ctypes
import sys

import torch

from sglang.srt.mem_cache.device_pool_info import (
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

PAGE, LAYERS, HEADS, DIM = 16, 4, 2, 64
TOKENS = 64 * PAGE  # device tokens; the host pool holds twice as many


def mha_host_pool(heads: int = HEADS, dim: int = DIM) -> MHATokenToKVPoolHost:
    dtype = torch.float16
    k = tuple(torch.zeros(TOKENS + PAGE, heads, dim, dtype=dtype) for _ in range(LAYERS))
    v = tuple(torch.zeros(TOKENS + PAGE, heads, dim, dtype=dtype) for _ in range(LAYERS))
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                          layout=KVBufferLayout.NHD),
        page_size=PAGE, head_num=heads, head_dim=dim, v_head_dim=dim,
        dtype=dtype, device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info, 2.0, 0, PAGE, "page_first", pin_memory=False, device="cpu",
        device_capacity_tokens=TOKENS, start_layer=0, end_layer=LAYERS - 1,
    )


def mla_host_pool() -> MLATokenToKVPoolHost:
    """DeepSeek's shape, small: 512 + 64 wide latent rows, layer_first, so
    that a page is one object made of one piece per layer."""
    dtype, lora, rope = torch.bfloat16, 512, 64
    rows = tuple(torch.zeros(TOKENS + PAGE, 1, lora + rope, dtype=dtype) for _ in range(LAYERS))
    info = MLABufferInfo(
        buffers=rows,
        data_ptrs=torch.tensor([t.data_ptr() for t in rows], dtype=torch.uint64),
        layer_indices=tuple(range(LAYERS)), device_layer_num=LAYERS, page_size=PAGE,
        kv_lora_rank=lora, qk_rope_head_dim=rope, kv_cache_dim=lora + rope,
        dtype=dtype, device=torch.device("cpu"),
    )
    return MLATokenToKVPoolHost(
        info, 2.0, 0, PAGE, "layer_first", pin_memory=False, device="cpu",
        device_capacity_tokens=TOKENS, start_layer=0, end_layer=LAYERS - 1,
        target_layer_num=LAYERS,
    )


def pages_bytes(pool, indices: torch.Tensor) -> list[bytes]:
    """The bytes of each page object, where the pool itself says they are
    (the pointers and sizes it hands to the store)."""
    ptrs, sizes = pool.get_page_buffer_meta(indices)
    return [ctypes.string_at(p, n) for p, n in zip(ptrs, sizes)]


def config(mla: bool, extra: dict) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="test/model", extra_config=extra,
    )


def sglang_mooncake(meta: str, pool, mla: bool):
    """SGLang's `mooncake` backend, configured as its docs say."""
    extra = {"master_server_address": meta, "protocol": "tcp",
             "global_segment_size": 0, "check_server": False}
    store = MooncakeStore(config(mla, extra))
    store.register_mem_pool_host(pool)
    return store


def native(meta: str, pool, mla: bool):
    """`--hicache-storage-backend dynamic` with the native backend."""
    extra = {"backend_name": "mooncake_store", "module_path": "mooncake_store.engines.sglang",
             "class_name": "MooncakeStoreHiCache", "meta": meta}
    store = StorageBackendFactory.create_backend("dynamic", config(mla, extra), pool)
    store.register_mem_pool_host(pool)
    return store


def round_trip(store, pool) -> int:
    """Stores 32 pages of `pool` through `store`, checks the prefix as
    HiCache does, reads them into 32 other pages and compares the bytes;
    returns the pages."""
    pages = 32
    keys = [f"{i:064x}" for i in range(pages)]
    src = torch.arange(0, pages * PAGE, dtype=torch.int64)
    dst = torch.arange(pages * PAGE, 2 * pages * PAGE, dtype=torch.int64)
    raw = pool.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 255, raw.shape, dtype=torch.uint8))
    assert pages_bytes(pool, src) != pages_bytes(pool, dst)
    assert store.batch_exists(keys) == 0, "nothing stored yet"
    assert store.batch_set_v1(keys, src) == [True] * pages
    assert store.batch_exists(keys) == pages
    assert store.batch_exists(keys[:5] + [f"{999:064x}"] + keys[5:]) == 5, "a hole ends the prefix"
    assert store.batch_get_v1(keys, dst) == [True] * pages
    assert pages_bytes(pool, src) == pages_bytes(pool, dst), "pages differ"
    # Storing pages again is a no-op success (they exist).
    assert store.batch_set_v1(keys, src) == [True] * pages
    store.clear()
    assert store.batch_exists(keys) == 0
    return pages


def main() -> None:
    meta = sys.argv[1]
    for name, backend in (("sglang's MooncakeStore", sglang_mooncake),
                          ("native MooncakeStoreHiCache", native)):
        # K and V of 16 KiB a page (the native backend gathers them into one
        # object), of 128 KiB (objects of their own), and MLA's layer rows.
        for layout, pool, mla in (("MHA page_first 16 KiB", mha_host_pool(), False),
                                  ("MHA page_first 128 KiB", mha_host_pool(8, 128), False),
                                  ("MLA layer_first", mla_host_pool(), True)):
            n = round_trip(backend(meta, pool, mla), pool)
            print(f"{name}, {layout} pool: {n} pages set, prefix checked, read back byte for byte")


if __name__ == "__main__":
    main()
