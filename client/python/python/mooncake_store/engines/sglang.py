"""SGLang HiCache's L3 storage on this store, natively: a `HiCacheStorage`
backend that SGLang loads by its own plug-in mechanism, without a patch:

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "mooncake_store",
        "module_path": "mooncake_store.engines.sglang",
        "class_name": "MooncakeStoreHiCache", "meta": "HOST:7070"}'

What it does beyond SGLang's `mooncake` backend on the compatible API:

- A request's prefix check (`batch_exists`) is one `match_prefix` round
  trip, instead of one existence check per object.
- Pages are written as a chain (`prefix_keys` names the page before), so
  that a daemon evicts a chain from its tail and keeps the heads that other
  requests match.
- A page's pieces of `SPLIT_AT` bytes or more (K and V of an MHA page) are
  objects of their own, read and written in place; smaller ones (an MLA
  pool's per-layer rows) are gathered into one object a page, which costs
  a copy but one index entry instead of one per layer.

Keys live in the namespace `sglang/<model>/tp<rank>of<size>[/pp<rank>]`
(`namespace` in the extra config overrides it): ranks of one model share
page hashes and must not share objects. MHA and MLA pools with the
`page_first`, `page_first_direct` and `layer_first` layouts are served; the
hybrid pools of `batch_*_v2` are not (SGLang then uses `batch_*_v1` for
KV only).
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

import mooncake_store

log = logging.getLogger(__name__)

# Pieces this large are objects of their own (no copy); smaller pieces of a
# page are gathered into one object.
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
        log.info("HiCache L3 on Mooncake Store at %s, namespace %s", meta, self.client.namespace)

    # -- the host pool ----------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        buf = mem_pool_host.kv_buffer
        self.client.register_buffer(buf.data_ptr(), buf.numel() * buf.element_size())
        _, sizes = mem_pool_host.get_page_buffer_meta(torch.arange(mem_pool_host.page_size))
        self.pieces = len(sizes)
        self.split = self.pieces > 1 and min(sizes) >= SPLIT_AT

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

    def _pages(self, keys: List[str], host_indices: torch.Tensor):
        """Each page's pieces (pointers and sizes), as the pool lays them
        out: one list per key."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        per = len(ptrs) // len(keys)
        if per * len(keys) != len(ptrs):
            raise ValueError(f"{len(ptrs)} page pieces for {len(keys)} pages")
        return (
            [list(ptrs[i * per : (i + 1) * per]) for i in range(len(keys))],
            [list(sizes[i * per : (i + 1) * per]) for i in range(len(keys))],
        )

    # -- the calls HiCache makes -------------------------------------------

    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        """How many leading pages are stored: one round trip."""
        if not keys:
            return 0
        try:
            return self.client.match_prefix(self._names(keys)) // (self.pieces if self.split else 1)
        except mooncake_store.StoreError as err:
            log.warning("batch_exists: %s", err)
            return 0

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        if not keys:
            return []
        ptrs, sizes = self._pages(keys, host_indices)
        parent = self._parent(extra_info)
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
        # A page another writer stored is stored.
        return self._per_page([c == 0 for c in codes])

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        if not keys:
            return []
        ptrs, sizes = self._pages(keys, host_indices)
        try:
            if self.split:
                got = self.client.get_into_ptrs(self._names(keys), _flat(ptrs), _flat(sizes))
                return self._per_page([n == w for n, w in zip(got, _flat(sizes))])
            got = self.client.get_into_ptr_lists(keys, ptrs, sizes)
        except (mooncake_store.StoreError, ValueError) as err:
            log.warning("batch_get_v1: %s", err)
            return [False] * len(keys)
        return [n == sum(w) for n, w in zip(got, sizes)]

    def _per_page(self, ok: List[bool]) -> List[bool]:
        """Per object to per page: a page is done when all its objects are."""
        if not self.split:
            return ok
        n = self.pieces
        return [all(ok[i : i + n]) for i in range(0, len(ok), n)]

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


def _flat(lists: List[List[int]]) -> List[int]:
    return [x for xs in lists for x in xs]


def _as_lists(locations: Any, sizes: Any):
    """Addresses and sizes, one or several per key, as lists per key."""
    as_list = lambda v: list(v) if isinstance(v, (list, tuple)) else [v]
    return [as_list(p) for p in locations], [as_list(s) for s in sizes]
