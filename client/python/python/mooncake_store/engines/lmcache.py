"""LMCache's remote tier on this store, natively: a `RemoteConnector` that
LMCache loads through its remote storage plug-in framework, without a
patch:

    remote_url: "plugin://mooncake_store"
    remote_storage_plugins: ["mooncake_store"]
    extra_config:
      remote_storage_plugin.mooncake_store.module_path: mooncake_store.engines.lmcache
      remote_storage_plugin.mooncake_store.class_name: MooncakeStoreRemote
      meta: "HOST:7070"

What it does beyond LMCache's `mooncakestore` connector on the compatible
API:

- LMCache's prefix lookup (`batched_contains`, `batched_async_contains`:
  how many leading chunks of a request are stored) is one `match_prefix`
  round trip, where the `mooncakestore` connector asks one `is_exist` per
  chunk, one after another; and a lease on what it matched (one round
  trip more: the daemons keep those chunks from eviction for their
  `kv_lease_ttl` until LMCache retrieves them).
- A batch of chunks is written as a chain (each chunk names the one
  before: LMCache stores a request's chunks in order), so that daemons evict
  a request's chunks from the tail and keep the heads others match. The
  first chunk names the last one of the prefix a lookup matched before it
  (the first missing chunk of a lookup is remembered with the chunk before
  it), so that a conversation's next turn is kept as a branch that readers
  come back to (2Q's branch rule, `docs/benchmarks.md`).
- Chunks are read and written in place in LMCache's CPU buffer (registered
  once), without a header: a chunk's shape comes from LMCache's metadata,
  and a shorter last chunk from the bytes read.

Keys are LMCache's chunk keys (`CacheEngineKey.to_string()`: model, world
size, worker, chunk hash, dtype) in the namespace `lmcache` (`namespace` in
the extra config replaces it). Extra config: `meta` (or `MOONCAKE_META`),
`namespace`, `token` (or `MOONCAKE_TOKEN`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, List, Optional

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

import mooncake_store

log = logging.getLogger(__name__)

# Lookups remembered at most; emptied when full (a forgotten one only
# leaves a put without its parent).
AWAITED_MAX = 65_536


class MooncakeStoreRemote(RemoteConnector):
    """LMCache's remote connector on a Mooncake Store (Rust) cluster."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any):
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        extra = dict(config.extra_config or {})
        meta = extra.get("meta") or os.environ.get("MOONCAKE_META")
        if not meta:
            raise ValueError(
                "extra_config needs \"meta\": the meta service's HOST:PORT (or set MOONCAKE_META)"
            )
        token = extra.get("token") or os.environ.get("MOONCAKE_TOKEN")
        self.client = mooncake_store.Client(str(meta), namespace=str(extra.get("namespace") or "lmcache"), token=token)
        # The first chunk missing from a lookup, with the last one matched
        # before it: the parent the put of that chunk names.
        self.awaited: dict[str, str] = {}
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        # LMCache's CPU buffer, where every chunk it hands over lives.
        pinned = getattr(local_cpu_backend.memory_allocator, "pin_allocator", None)
        buffer = getattr(pinned, "buffer", None)
        if buffer is None:
            raise ValueError("LMCache's CPU allocator has no buffer to register with the store")
        self.buffer = buffer
        self.client.register_buffer(buffer.data_ptr(), buffer.numel() * buffer.element_size())
        log.info("LMCache's remote tier on Mooncake Store at %s, namespace %s", meta, self.client.namespace)

    # -- lookups -----------------------------------------------------------

    async def exists(self, key: CacheEngineKey) -> bool:
        return self.exists_sync(key)

    def exists_sync(self, key: CacheEngineKey) -> bool:
        try:
            return self.client.exists([key.to_string()], lease=True)[0]
        except mooncake_store.StoreError as err:
            log.warning("exists: %s", err)
            return False

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: List[CacheEngineKey]) -> int:
        """How many leading chunks are stored, leased until LMCache
        retrieves them: two round trips."""
        if not keys:
            return 0
        names = [k.to_string() for k in keys]
        try:
            matched = self.client.match_prefix(names, lease=True)
        except mooncake_store.StoreError as err:
            log.warning("batched_contains: %s", err)
            return 0
        if 0 < matched < len(names):
            if len(self.awaited) >= AWAITED_MAX:
                self.awaited.clear()
            self.awaited[names[matched]] = names[matched - 1]
        return matched

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey], pin: bool = False) -> int:
        return await asyncio.to_thread(self.batched_contains, keys)

    # -- reads -------------------------------------------------------------

    def support_batched_get(self) -> bool:
        return True

    async def get(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        return (await self.batched_get([key]))[0]

    async def batched_get(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        return await asyncio.to_thread(self._read, keys)

    def _read(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        objs = [self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt) for _ in keys]
        wanted = [i for i, obj in enumerate(objs) if obj is not None]
        results: List[Optional[MemoryObj]] = [None] * len(keys)
        if len(wanted) < len(keys):
            log.warning("LMCache's CPU buffer is full: %d of %d chunks not read", len(keys) - len(wanted), len(keys))
        if not wanted:
            return results
        try:
            got = self.client.get_into_ptrs(
                [keys[i].to_string() for i in wanted],
                [objs[i].data_ptr for i in wanted],
                [objs[i].get_size() for i in wanted],
            )
        except mooncake_store.StoreError as err:
            log.warning("batched_get of %d chunks: %s", len(wanted), err)
            got = [-1] * len(wanted)
        for i, n in zip(wanted, got):
            obj = objs[i]
            if n <= 0:
                obj.ref_count_down()
                continue
            try:
                results[i] = self.reshape_partial_chunk(obj, n)
            except ValueError as err:
                # Not a whole number of tokens: never hand LMCache such bytes.
                log.warning("chunk %s: %s", keys[i], err)
                obj.ref_count_down()
        return results

    async def batched_get_non_blocking(self, lookup_id: str, keys: List[CacheEngineKey]) -> List[MemoryObj]:
        """The leading chunks read, up to the first that could not be."""
        objs = await self.batched_get(keys)
        out: List[MemoryObj] = []
        for i, obj in enumerate(objs):
            if obj is None:
                for rest in objs[i + 1 :]:
                    if rest is not None:
                        rest.ref_count_down()
                break
            out.append(obj)
        return out

    # -- writes ------------------------------------------------------------

    def support_batched_put(self) -> bool:
        return True

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj):
        await self.batched_put([key], [memory_obj])

    async def batched_put(self, keys: List[CacheEngineKey], memory_objs: List[MemoryObj]):
        await asyncio.to_thread(self._write, keys, memory_objs)

    def _write(self, keys: List[CacheEngineKey], memory_objs: List[MemoryObj]) -> None:
        try:
            names = [k.to_string() for k in keys]
            codes = self.client.put_from_ptrs(
                names,
                [obj.data_ptr for obj in memory_objs],
                [obj.get_size() for obj in memory_objs],
                chain=True,
                parent=self.awaited.pop(names[0], None) if names else None,
            )
        except mooncake_store.StoreError as err:
            log.warning("batched_put of %d chunks: %s", len(keys), err)
            return
        failed = sum(1 for c in codes if c != 0)
        if failed:
            # A cache: an unwritten chunk is a future miss.
            log.warning("batched_put: %d of %d chunks not stored (codes %s)", failed, len(keys), sorted(set(codes)))

    # -- the rest ----------------------------------------------------------

    def remove_sync(self, key: CacheEngineKey) -> bool:
        try:
            return self.client.remove([key.to_string()])[0]
        except mooncake_store.StoreError as err:
            log.warning("remove: %s", err)
            return False

    async def list(self) -> List[str]:
        # The store lists no keys to a client (its index is by hash).
        return []

    async def close(self):
        self.client.unregister_buffer(self.buffer.data_ptr())
