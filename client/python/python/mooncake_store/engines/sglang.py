"""SGLang HiCache's L3 storage on this store, natively: a `HiCacheStorage`
backend that SGLang loads by its own plug-in mechanism, without a patch:

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "mooncake_store",
        "module_path": "mooncake_store.engines.sglang",
        "class_name": "MooncakeStoreHiCache", "meta": "HOST:7070"}'

What it does beyond SGLang's `mooncake` backend on the compatible API:

- A request's prefix check (`batch_exists`) is one `match_prefix` round
  trip, instead of one existence check per object, and a lease on what it
  matched (one round trip more: the daemons keep those pages from
  eviction for their `kv_lease_ttl` until SGLang's prefetch reads them).
- Pages are written as a chain (`prefix_keys` names the page before), so
  that a daemon evicts a chain from its tail and keeps the heads that other
  requests match.
- A page's pieces of `SPLIT_AT` bytes or more (K and V of an MHA page) are
  objects of their own; smaller ones (an MLA pool's per-layer rows) make
  one object a page, one index entry instead of one per layer. Either way
  each piece is read and written in place (no staging copy).

Keys live in the namespace `sglang/<model>/tp<rank>of<size>[/pp<rank>]`
(`namespace` in the extra config overrides it): ranks of one model share
page hashes and must not share objects. MHA and MLA pools with the
`page_first`, `page_first_direct` and `layer_first` layouts are served.

Hybrid models (Mamba, SWA, DSA indexer and DeepSeek V4 side pools) go
through `batch_*_v2`: each side pool registered with
`register_mem_host_pool_v2` keeps a page's pieces in objects named
`<page key>:<pool>` (or `<page key>:<pool>:<j>` for pieces of `SPLIT_AT`
bytes or more), beside the KV chain. `batch_exists_v2` is one
`match_prefix` for the KV pages and one existence check for every side
pool, with SGLang's hit policies (`all_pages`, `trailing_pages`) and its
set of restorable prefixes. A pool whose host memory cannot be addressed
page by page (`get_page_buffer_meta` refuses) is a miss, logged once.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.observability.metrics_collector import StorageMetrics

import mooncake_store

log = logging.getLogger(__name__)

# Pieces this large are objects of their own; smaller pieces of a page make
# one object (read and written in place, piece by piece).
SPLIT_AT = 64 << 10


def _namespace(config: HiCacheStorageConfig, extra: dict) -> str:
    if extra.get("namespace"):
        return str(extra["namespace"])
    model = "-".join((config.model_name or "model").split("/"))
    name = f"sglang/{model}/tp{config.tp_rank}of{config.tp_size}"
    if config.pp_size > 1:
        name += f"/pp{config.pp_rank}"
    # The store's namespaces take letters, digits and ._-:/@+= (128 at most).
    name = "".join(c if c.isalnum() or c in "._-:/@+=" else "_" for c in name)
    return name[:128]


class MooncakeStoreHiCache(HiCacheStorage):
    """SGLang's `HiCacheStorage` on a Mooncake Store (Rust) cluster."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        extra = dict(storage_config.extra_config or {})
        meta = extra.get("meta") or extra.get("master_server_address")
        if not meta:
            raise ValueError(
                "the extra config needs \"meta\": the meta service's HOST:PORT"
            )
        self.client = mooncake_store.Client(meta, namespace=_namespace(storage_config, extra))
        self.storage_config = storage_config
        self.mem_pool_host = None
        # Pieces per page, and whether each is an object of its own.
        self.pieces = 1
        self.split = False
        # Side pools of a hybrid model, by name: their pieces per page and
        # whether each piece is an object of its own (None: not servable).
        self.side: dict = {}
        # SGLang's storage metrics (`--enable-cache-report`'s HiCache
        # counters), when its config asks for them: pages and GB/s of each
        # batch read (prefetch) and written (backup).
        self.metrics = StorageMetrics() if storage_config.enable_storage_metrics else None
        self.metrics_lock = threading.Lock()
        log.info("HiCache L3 on Mooncake Store at %s, namespace %s", meta, self.client.namespace)

    # -- the host pool ----------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if getattr(mem_pool_host, "kv_buffer", None) is None:
            # A hybrid model's logical anchor (DeepSeek V4): it owns only
            # indices; its side pools, registered through v2, hold the data.
            return
        self._register(mem_pool_host)
        _, sizes = mem_pool_host.get_page_buffer_meta(torch.arange(mem_pool_host.page_size))
        self.pieces = len(sizes)
        self.split = self.pieces > 1 and min(sizes) >= SPLIT_AT

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """A hybrid model's side pool (Mamba states, SWA, indexer...)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if host_pool_name == PoolName.KV:
            return  # the anchor, registered by register_mem_pool_host
        self._register(host_pool)
        self.side[str(host_pool_name)] = _side_layout(host_pool, str(host_pool_name))

    def _register(self, host_pool) -> None:
        """Registers every buffer of a host pool with the client."""
        buffers = getattr(host_pool, "get_hybrid_pool_buffer", None)
        for buf in buffers() if buffers else [host_pool.kv_buffer]:
            if buf is not None and buf.numel() > 0:
                self.client.register_buffer(buf.data_ptr(), buf.numel() * buf.element_size())

    def _anchor_only(self) -> bool:
        return getattr(self.mem_pool_host, "kv_buffer", None) is None

    def _names(self, keys: List[str]) -> List[str]:
        """The objects of these pages, in order: the page's key, or with
        split pieces one name per piece."""
        if not self.split:
            return list(keys)
        return [f"{k}:{j}" for k in keys for j in range(self.pieces)]

    def _parent(self, extra_info) -> Optional[str]:
        """The last object of the page before these (the chain's parent)."""
        prefix = getattr(extra_info, "prefix_keys", None) or []
        return self._names(prefix[-1:])[-1] if prefix else None

    def _pages(self, keys: List[str], host_indices: torch.Tensor, pool=None):
        """Each page's pieces (pointers and sizes), as the pool (the KV
        pool unless named) lays them out: one list per key."""
        pool = pool if pool is not None else self.mem_pool_host
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        per = len(ptrs) // len(keys)
        if per * len(keys) != len(ptrs):
            raise ValueError(f"{len(ptrs)} page pieces for {len(keys)} pages")
        return (
            [list(ptrs[i * per : (i + 1) * per]) for i in range(len(keys))],
            [list(sizes[i * per : (i + 1) * per]) for i in range(len(keys))],
        )

    # -- the calls HiCache makes -------------------------------------------

    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        """How many leading pages are stored, leased until the prefetch
        reads them: two round trips."""
        if not keys:
            return 0
        if self._anchor_only():
            return len(keys)
        try:
            return self.client.match_prefix(self._names(keys), lease=True) // (self.pieces if self.split else 1)
        except mooncake_store.StoreError as err:
            log.warning("batch_exists: %s", err)
            return 0

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        if not keys:
            return []
        if self._anchor_only():
            return [True] * len(keys)  # the side pools carry the data (v2)
        ptrs, sizes = self._pages(keys, host_indices)
        parent = self._parent(extra_info)
        began = time.perf_counter()
        try:
            if self.split:
                codes = self.client.put_from_ptrs(
                    self._names(keys), _flat(ptrs), _flat(sizes), chain=True, parent=parent
                )
            else:
                codes = self.client.put_from_ptr_lists(
                    keys, ptrs, sizes, chain=True, parent=parent
                )
        except (mooncake_store.StoreError, ValueError) as err:
            log.warning("batch_set_v1: %s", err)
            return [False] * len(keys)
        self._record("backup", len(keys), sum(map(sum, sizes)), began)
        # A page another writer stored is stored.
        return self._per_page([c == 0 for c in codes])

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        if not keys:
            return []
        if self._anchor_only():
            return [True] * len(keys)
        ptrs, sizes = self._pages(keys, host_indices)
        began = time.perf_counter()
        try:
            if self.split:
                got = self.client.get_into_ptrs(self._names(keys), _flat(ptrs), _flat(sizes))
                ok = self._per_page([n == w for n, w in zip(got, _flat(sizes))])
            else:
                got = self.client.get_into_ptr_lists(keys, ptrs, sizes)
                ok = [n == sum(w) for n, w in zip(got, sizes)]
        except (mooncake_store.StoreError, ValueError) as err:
            log.warning("batch_get_v1: %s", err)
            return [False] * len(keys)
        self._record("prefetch", len(keys), sum(map(sum, sizes)), began)
        return ok

    def _record(self, kind: str, pages: int, nbytes: int, began: float) -> None:
        """Counts a batch in SGLang's storage metrics (GB/s as SGLang's own
        backends count them: GiB per second)."""
        if self.metrics is None:
            return
        seconds = time.perf_counter() - began
        with self.metrics_lock:
            getattr(self.metrics, f"{kind}_pgs").append(pages)
            if seconds > 0:
                getattr(self.metrics, f"{kind}_bandwidth").append(nbytes / seconds / (1 << 30))

    def get_stats(self):
        """SGLang's storage metrics since the last call (None when off)."""
        if self.metrics is None:
            return None
        with self.metrics_lock:
            out, self.metrics = self.metrics, StorageMetrics()
        return out

    def _per_page(self, ok: List[bool]) -> List[bool]:
        """Per object to per page: a page is done when all its objects are."""
        if not self.split:
            return ok
        n = self.pieces
        return [all(ok[i : i + n]) for i in range(0, len(ok), n)]

    # -- hybrid models: side pools beside the KV pages (v2) ---------------

    def _side_names(self, keys: List[str], name: str) -> List[str]:
        """The objects of these pages in side pool `name`, in order."""
        pieces, split = self.side[name]
        if split and pieces > 1:
            return [f"{k}:{name}:{j}" for k in keys for j in range(pieces)]
        return [f"{k}:{name}" for k in keys]

    def _servable(self, name) -> bool:
        return self.side.get(str(name)) is not None

    def batch_exists_v2(
        self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None, extra_info=None
    ) -> PoolTransferResult:
        """The usable prefix of a hybrid model's pages: the KV prefix (one
        `match_prefix`), cut to the prefixes every side pool can restore
        under its hit policy (one existence check for all side pools)."""
        kv = self.batch_exists(keys, extra_info) if keys else 0
        hits = {PoolName.KV: kv} if kv else {}
        restorable = list(range(1, kv + 1))
        if not restorable:
            return PoolTransferResult(0, hits, [])
        transfers = list(pool_transfers or [])
        names: List[str] = []
        spans = []
        for transfer in transfers:
            start = len(names)
            if self._servable(transfer.name):
                names += self._side_names(keys[:kv], str(transfer.name))
            spans.append((start, len(names)))
        try:
            found = self.client.exists(names, lease=True) if names else []
        except mooncake_store.StoreError as err:
            log.warning("batch_exists_v2: %s", err)
            found = [False] * len(names)
        for transfer, (start, end) in zip(transfers, spans):
            if not restorable:
                break
            per = (end - start) // kv
            page_ok = [per > 0 and all(found[start + i * per : start + (i + 1) * per]) for i in range(kv)]
            pool_ok = _restorable(page_ok, transfer)
            if pool_ok:
                hits[transfer.name] = pool_ok[-1]
            keep = set(pool_ok)
            restorable = [p for p in restorable if p in keep]
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def batch_get_v2(self, transfers: List[PoolTransfer], extra_info=None) -> dict:
        """Reads each pool's pages into its host pool: per pool, whether
        each page was read."""
        return {t.name: self._io_v2(t, extra_info, write=False) for t in transfers}

    def batch_set_v2(self, transfers: List[PoolTransfer], extra_info=None) -> dict:
        """Writes each pool's pages: per pool, whether each page is stored."""
        return {t.name: self._io_v2(t, extra_info, write=True) for t in transfers}

    def _io_v2(self, transfer: PoolTransfer, extra_info, write: bool) -> List[bool]:
        keys = list(transfer.keys or [])
        if not keys:
            return []
        if transfer.name == PoolName.KV:
            v1 = self.batch_set_v1 if write else self.batch_get_v1
            return v1(keys, transfer.host_indices, extra_info)
        name = str(transfer.name)
        if not self._servable(name):
            return [False] * len(keys)
        pieces, split = self.side[name]
        op = "set" if write else "get"
        try:
            ptrs, sizes = self._pages(keys, transfer.host_indices, self.registered_pools[transfer.name])
            names = self._side_names(keys, name)
            if split:
                flat_ptrs, flat_sizes = _flat(ptrs), _flat(sizes)
                if write:
                    ok = [c == 0 for c in self.client.put_from_ptrs(names, flat_ptrs, flat_sizes)]
                else:
                    got = self.client.get_into_ptrs(names, flat_ptrs, flat_sizes)
                    ok = [n == w for n, w in zip(got, flat_sizes)]
                return [all(ok[i : i + pieces]) for i in range(0, len(ok), pieces)]
            if write:
                return [c == 0 for c in self.client.put_from_ptr_lists(names, ptrs, sizes)]
            got = self.client.get_into_ptr_lists(names, ptrs, sizes)
            return [n == sum(w) for n, w in zip(got, sizes)]
        except (mooncake_store.StoreError, ValueError) as err:
            log.warning("batch_%s_v2 (%s): %s", op, name, err)
            return [False] * len(keys)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def clear(self) -> None:
        try:
            self.client.remove_all()
        except mooncake_store.StoreError as err:
            log.warning("clear: %s", err)

    # -- the older, address-based calls -----------------------------------

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], None, [target_location], [target_sizes])

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        ptrs, sizes = _as_lists(target_locations, target_sizes)
        try:
            codes = self.client.put_from_ptr_lists(keys, ptrs, sizes)
        except (mooncake_store.StoreError, ValueError) as err:
            log.warning("batch_set: %s", err)
            return False
        return all(c == 0 for c in codes)

    def get(self, key, target_location=None, target_sizes=None) -> bool:
        return self.batch_get([key], [target_location], [target_sizes]) == 1

    def batch_get(self, keys, target_locations=None, target_sizes=None) -> int:
        """How many leading keys were read."""
        ptrs, sizes = _as_lists(target_locations, target_sizes)
        try:
            got = self.client.get_into_ptr_lists(keys, ptrs, sizes)
        except (mooncake_store.StoreError, ValueError) as err:
            log.warning("batch_get: %s", err)
            return 0
        for i, n in enumerate(got):
            if n < 0:
                return i
        return len(keys)


def _side_layout(pool, name: str):
    """A side pool's pieces per page, and whether each piece is an object
    of its own; None when its pages cannot be addressed one by one."""
    try:
        _, sizes = pool.get_page_buffer_meta(torch.arange(pool.page_size or 1))
    except (AttributeError, NotImplementedError, RuntimeError, ValueError) as err:
        log.warning("HiCache side pool %s cannot be stored page by page (%s): its pages are misses", name, err)
        return None
    pieces = len(sizes)
    return pieces, pieces == 1 or min(sizes) >= SPLIT_AT


def _restorable(page_ok: List[bool], transfer: PoolTransfer) -> List[int]:
    """The prefix lengths (in pages) a side pool can restore, given which
    of the KV prefix's pages it holds: under `all_pages` every page up to
    the length, under `trailing_pages` the window of `len(keys)` pages
    that ends there."""
    if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
        lead = page_ok.index(False) if False in page_ok else len(page_ok)
        return list(range(1, lead + 1))
    if transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
        window = max(1, len(transfer.keys or ()))
        out, run = [], 0
        for length, ok in enumerate(page_ok, 1):
            run = run + 1 if ok else 0
            if run >= min(window, length):
                out.append(length)
        return out
    raise ValueError(f"hit policy {transfer.hit_policy} is not served by this backend")


def _flat(lists: List[List[int]]) -> List[int]:
    return [x for xs in lists for x in xs]


def _as_lists(locations: Any, sizes: Any):
    """Addresses and sizes, one or several per key, as lists per key."""
    as_list = lambda v: list(v) if isinstance(v, (list, tuple)) else [v]
    return [as_list(p) for p in locations], [as_list(s) for s in sizes]
