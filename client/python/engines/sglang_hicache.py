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
native backend's extra config. Then a hybrid model's pools as SGLang's
HybridCacheController hands them to a backend (the KV pool as anchor and
a Mamba state pool through `register_mem_host_pool_v2`), driven through
`batch_set_v2` / `batch_exists_v2` / `batch_get_v2` with SGLang's
`trailing_pages` policy, on both backends. With MOONCAKE_BIN, on a store
of 4 MiB of its own: pages HiCache's prefix check found are still there
when its prefetch reads them, though another client put 16 MiB in
between (both backends lease what the check finds, as Mooncake's
`batch_is_exist` does), and HiCache's `clear()` then leaves them with
SGLang's backend (Mooncake's `remove_all()` without `force` keeps what a
lease holds); and pages that went down to that store's NVMe
drive are back in DRAM when SGLang's backend reads them, its prefix check
having leased them. Run by `tools/test-engines.sh`.

Usage: python sglang_hicache.py META_ADDR
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch

import mooncake_store
from own_store import eventually, replica_kinds, small_store

from sglang.srt.mem_cache.device_pool_info import (
    KVBufferLayout,
    KVBuffers,
    MambaStateBufferInfo,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
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


def mamba_host_pool(slots: int = 16) -> MambaPoolHost:
    """A Mamba state pool as a hybrid model (Qwen3-Next's shape, small)
    has it: per layer and slot a temporal (SSM) state and a conv state;
    a host "page" is one slot."""
    layers = 2
    temporal = torch.zeros(layers, slots + 1, 4, 32, 32, dtype=torch.float32)  # 16 KiB a layer
    conv = (torch.zeros(layers, slots + 1, 256, 3, dtype=torch.bfloat16),)  # 1.5 KiB a layer
    return MambaPoolHost(
        MambaStateBufferInfo(temporal=temporal, conv=conv), 2.0, 0,
        device_capacity=slots, pin_memory=False, device="cpu", layout="page_first",
    )


def pages_bytes(pool, indices: torch.Tensor) -> list[bytes]:
    """The bytes of each page object, where the pool itself says they are
    (the pointers and sizes it hands to the store)."""
    ptrs, sizes = pool.get_page_buffer_meta(indices)
    return [ctypes.string_at(p, n) for p, n in zip(ptrs, sizes)]


def config(mla: bool, extra: dict) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=True, is_page_first_layout=True,
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


def pages_to_copy(pool, pages: int, first: int = 0):
    """Keys for `pages` pages, the pool's pages to write them from and the
    others to read them into; the pool filled with random bytes."""
    keys = [f"{i + first:064x}" for i in range(pages)]
    src = torch.arange(0, pages * PAGE, dtype=torch.int64)
    dst = torch.arange(pages * PAGE, 2 * pages * PAGE, dtype=torch.int64)
    raw = pool.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 255, raw.shape, dtype=torch.uint8))
    return keys, src, dst


def fill_over(meta: str) -> None:
    """Another client puts 16 MiB, none of it read again: four times a
    small store's pool."""
    filler = mooncake_store.Client(meta, namespace="filler")
    for i in range(64):
        filler.put(f"filler-{i}", b"f" * (256 << 10))


def cleared(store, found) -> None:
    """SGLang's `clear()`, then what a lease may have kept from it. SGLang's
    own backend calls Mooncake's `remove_all()` without `force`, which, as
    in Mooncake, leaves what a lease holds (the pages its prefix checks
    found, for 5 s: `leased_until_read` checks that); they go with a forced
    removal, as the next case reuses the keys. The native backend's
    `clear()` takes everything. `found()` counts the pages still stored."""
    store.clear()
    if isinstance(store, MooncakeStore):
        store.store.remove_all(force=True)
    assert found() == 0, "pages left after clear()"


def round_trip(store, pool) -> int:
    """Stores 32 pages of `pool` through `store`, checks the prefix as
    HiCache does, reads them into 32 other pages and compares the bytes;
    returns the pages."""
    pages = 32
    keys, src, dst = pages_to_copy(pool, pages)
    assert pages_bytes(pool, src) != pages_bytes(pool, dst)
    assert store.batch_exists(keys) == 0, "nothing stored yet"
    assert store.batch_set_v1(keys, src) == [True] * pages
    assert store.batch_exists(keys) == pages
    assert store.batch_exists(keys[:5] + [f"{999:064x}"] + keys[5:]) == 5, "a hole ends the prefix"
    assert store.batch_get_v1(keys, dst) == [True] * pages
    assert pages_bytes(pool, src) == pages_bytes(pool, dst), "pages differ"
    # Storing pages again is a no-op success (they exist).
    assert store.batch_set_v1(keys, src) == [True] * pages
    # SGLang's storage metrics: the pages read back, the pages written.
    stats = store.get_stats()
    assert sum(stats.prefetch_pgs) == pages and len(stats.prefetch_bandwidth) == 1, stats
    assert pages <= sum(stats.backup_pgs) <= 2 * pages, stats
    cleared(store, lambda: store.batch_exists(keys))
    return pages


def hybrid_round_trip(store, kv_pool, mamba_pool) -> int:
    """A hybrid model's request of 12 pages as HiCache backs it up and
    prefetches it: the KV pages through v1, the Mamba state of the last 2
    pages (`trailing_pages`) through v2; then the prefix check counts only
    the prefixes whose trailing states are stored, and the states read
    back byte for byte."""
    pages, window = 12, 2
    keys = [f"{i + 100:064x}" for i in range(pages)]
    kv_src = torch.arange(0, pages * PAGE, dtype=torch.int64)
    state_src, state_dst = torch.arange(0, window), torch.arange(window, 2 * window)
    for pool in (kv_pool, mamba_pool):
        for buf in pool.get_hybrid_pool_buffer() if hasattr(pool, "get_hybrid_pool_buffer") else [pool.kv_buffer]:
            raw = buf.view(torch.uint8)
            raw.copy_(torch.randint(0, 255, raw.shape, dtype=torch.uint8))
    mamba = lambda indices, ks: PoolTransfer(
        name=PoolName.MAMBA, host_indices=indices, keys=ks,
        hit_policy=PoolHitPolicy.TRAILING_PAGES)
    info = HiCacheStorageExtraInfo(prefix_keys=None)
    assert store.batch_exists_v2(keys, [mamba(state_src, keys[-window:])], info).kv_hit_pages == 0

    assert store.batch_set_v1(keys, kv_src, info) == [True] * pages
    # Only the KV pages: no prefix has its trailing states yet.
    got = store.batch_exists_v2(keys, [mamba(state_src, keys[-window:])], info)
    assert got.kv_hit_pages == 0 and got.extra_pool_hit_pages.get(PoolName.KV) == pages, got
    assert store.batch_set_v2([mamba(state_src, keys[-window:])], info) == {PoolName.MAMBA: [True] * window}
    got = store.batch_exists_v2(keys, [mamba(state_src, keys[-window:])], info)
    assert got.kv_hit_pages == pages, got
    # Only the whole prefix has its window of states (pages 11 and 12).
    assert got.restorable_prefix_pages == [pages], got.restorable_prefix_pages
    # A longer request over the same pages restores at most those 12.
    longer = keys + [f"{999:064x}"]
    assert store.batch_exists_v2(longer, [mamba(state_src, longer[-window:])], info).kv_hit_pages == pages

    got = store.batch_get_v2([mamba(state_dst, keys[-window:])], info)
    assert got == {PoolName.MAMBA: [True] * window}, got
    assert pages_bytes(mamba_pool, state_src) == pages_bytes(mamba_pool, state_dst), "states differ"
    cleared(store, lambda: store.batch_exists_v2(keys, [mamba(state_src, keys[-window:])], info).kv_hit_pages)
    return pages


def leased_until_read(meta: str, backend) -> int:
    """HiCache checks a prefix, then another client fills the store four
    times over, then HiCache's prefetch reads the pages: all there, exact.
    Returns the pages."""
    pool = mha_host_pool()
    store = backend(meta, pool, False)
    pages = 32
    keys, src, dst = pages_to_copy(pool, pages, first=5000)
    assert store.batch_set_v1(keys, src) == [True] * pages
    assert store.batch_exists(keys) == pages
    fill_over(meta)
    assert store.batch_get_v1(keys, dst) == [True] * pages, "pages the check found were evicted"
    assert pages_bytes(pool, src) == pages_bytes(pool, dst), "pages differ"
    # HiCache's clear() with pages a lease holds (10 minutes here) and
    # pages none does: SGLang's backend calls Mooncake's remove_all()
    # without force, which leaves the leased ones, as Mooncake does; the
    # native backend's clear() takes everything.
    unleased = [f"{i:064x}" for i in range(6000, 6004)]
    assert store.batch_set_v1(unleased, src[: 4 * PAGE]) == [True] * 4
    store.clear()
    assert store.batch_exists(unleased) == 0, "clear() left pages no lease holds"
    kept = pages if backend is sglang_mooncake else 0
    assert store.batch_exists(keys) == kept, "clear() and the pages a lease holds"
    return pages


def on_drive_until_read(meta: str) -> int:
    """SGLang's backend sets pages; another client's 16 MiB pushes them to
    the drive of a 4 MiB store (checked without a lease: they lie on the
    drive only); HiCache's prefix check (`batch_is_exist`, a lease) has the
    daemon read them back into DRAM before the read, which is exact.
    Returns the pages."""
    from mooncake.store import MooncakeDistributedStore

    pool = mha_host_pool()
    store = sglang_mooncake(meta, pool, False)
    pages = 32
    keys, src, dst = pages_to_copy(pool, pages, first=7000)
    assert store.batch_set_v1(keys, src) == [True] * pages
    other = MooncakeDistributedStore()
    assert other.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", meta) == 0
    fill_over(meta)
    inner, found = store.store, []
    exists = inner.batch_is_exist

    def looking_up(object_keys: list[str]) -> list[int]:
        stored = [k for k, e in zip(object_keys, other.batch_probe_key(object_keys)) if e == 1]
        eventually(lambda: replica_kinds(other, stored) == {"disk"}, "pages on the drive")
        found.extend(stored)
        return exists(object_keys)

    inner.batch_is_exist = looking_up
    assert store.batch_exists(keys) == pages
    assert found, "the prefix check asked the store"
    eventually(lambda: replica_kinds(other, found) == {"memory"}, "pages back in DRAM")
    assert store.batch_get_v1(keys, dst) == [True] * pages
    assert pages_bytes(pool, src) == pages_bytes(pool, dst), "pages differ"
    store.clear()
    other.close()
    return pages


def native_on_drive_until_read(meta: str) -> int:
    """The same with the native backend: the pages it set, pushed to the
    drive (checked without a lease, in its namespace), are back in DRAM
    after its prefix check (`match_prefix(lease=True)`) and before its
    read, which is exact. Returns the pages."""
    from mooncake.store import MooncakeDistributedStore

    pool = mha_host_pool()
    store = native(meta, pool, False)
    pages = 32
    keys, src, dst = pages_to_copy(pool, pages, first=8000)
    assert store.batch_set_v1(keys, src) == [True] * pages
    names = store._names(keys)
    other = MooncakeDistributedStore()
    assert other.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", meta,
                       tenant_id=store.client.namespace) == 0
    fill_over(meta)
    stored = [k for k, e in zip(names, other.batch_probe_key(names)) if e == 1]
    assert stored, "every page left the store"
    eventually(lambda: replica_kinds(other, stored) == {"disk"}, "pages on the drive")
    assert store.batch_exists(keys) == pages
    eventually(lambda: replica_kinds(other, stored) == {"memory"}, "pages back in DRAM")
    assert store.batch_get_v1(keys, dst) == [True] * pages
    assert pages_bytes(pool, src) == pages_bytes(pool, dst), "pages differ"
    store.clear()
    other.close()
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
        kv_pool, mamba_pool = mha_host_pool(), mamba_host_pool()
        store = backend(meta, kv_pool, False)
        store.register_mem_host_pool_v2(mamba_pool, PoolName.MAMBA)
        n = hybrid_round_trip(store, kv_pool, mamba_pool)
        print(f"{name}, hybrid MHA + Mamba pools (v2): {n} pages, trailing states checked, read back byte for byte")
        if os.environ.get("MOONCAKE_BIN"):
            with small_store("4MiB", '[daemon]\nkv_lease_ttl = "10m"\n') as own:
                n = leased_until_read(own, backend)
            kept = "kept by clear() (Mooncake's remove_all without force)" if backend is sglang_mooncake \
                else "taken by the native backend's clear()"
            print(f"{name}, leases: {n} pages the prefix check found read back exactly after 16 MiB"
                  f" went into a 4 MiB store; {kept}")
    if os.environ.get("MOONCAKE_BIN"):
        with small_store("4MiB", '[daemon]\nkv_lease_ttl = "10m"\n', drive="64MiB") as own:
            n = on_drive_until_read(own)
        print(f"sglang's MooncakeStore, drive: {n} pages the prefix check found only on the daemon's drive"
              " were back in DRAM before the read, read back exactly")
        with small_store("4MiB", '[daemon]\nkv_lease_ttl = "10m"\n', drive="64MiB") as own:
            n = native_on_drive_until_read(own)
        print(f"native MooncakeStoreHiCache, drive: {n} pages the prefix check found only on the daemon's"
              " drive were back in DRAM before the read, read back exactly")


if __name__ == "__main__":
    main()
