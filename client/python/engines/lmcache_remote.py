"""LMCache's own `mooncakestore` remote backend, unchanged, on this store.

Builds LMCache's `LMCacheEngineConfig` the way LMCache's docs configure
Mooncake (`remote_url: mooncakestore://...`, the Mooncake keys in
`extra_config`), LMCache's `LocalCPUBackend` (its CPU memory allocator),
and LMCache's `RemoteBackend`, which creates LMCache's
`MooncakestoreConnector` through LMCache's own connector factory; that
connector calls `mooncake.store` as Mooncake's package defines it, and this
repository's package answers. Then does what LMCache's storage manager
does with a remote backend: batched puts of KV chunks (LMCache's
`KV_2LTD` memory objects, random bytes), `contains`, batched gets back
into new memory objects, byte for byte, and misses for chunks never put.
Both of the connector's modes run: with `save_chunk_meta` (LMCache's
default: `put_parts` and `batch_get_buffer`) and without (`batch_put_from`
and `batch_get_into`, zero copy into LMCache's registered buffer). Then
LMCache's `MooncakeLookupClient`, the scheduler side's prefix lookup (one
`batch_is_exist` of a request's chunk keys, made by LMCache's token
database from its tokens), on chunks the connector put.
Run by `tools/test-engines.sh`.

Usage: python lmcache_remote.py META_ADDR
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import torch

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

MODEL = "test-model"
LAYERS, TOKENS, HEADS, DIM = 4, 256, 2, 64
DTYPE = torch.bfloat16


def config(meta: str, mode: str) -> LMCacheEngineConfig:
    """LMCache's config for one of the three ways to reach the store."""
    if mode == "native":
        # This package's connector, through LMCache's plug-in framework.
        remote = {
            "remote_url": "plugin://mooncake_store",
            "remote_storage_plugins": ["mooncake_store"],
            "extra_config": {
                "remote_storage_plugin.mooncake_store.module_path": "mooncake_store.engines.lmcache",
                "remote_storage_plugin.mooncake_store.class_name": "MooncakeStoreRemote",
                "meta": meta,
                "save_chunk_meta": False,
            },
        }
    else:
        # LMCache's own mooncakestore connector, as LMCache's docs set it up.
        remote = {
            "remote_url": f"mooncakestore://{meta}/",
            "extra_config": {
                "local_hostname": "localhost",
                "metadata_server": "P2PHANDSHAKE",
                "global_segment_size": 0,
                "local_buffer_size": "64MB",
                "protocol": "tcp",
                "device_name": "",
                "master_server_address": meta,
                "save_chunk_meta": mode == "save_chunk_meta",
            },
        }
    return LMCacheEngineConfig.from_dict(
        {"chunk_size": TOKENS, "local_cpu": False, "max_local_cpu_size": 0.5, "remote_serde": "naive", **remote}
    )


def metadata(layers: int = LAYERS, heads: int = HEADS, dim: int = DIM) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=DTYPE, kv_shape=(layers, 2, TOKENS, heads, dim),
    )


def key(name: str) -> CacheEngineKey:
    chunk = int.from_bytes(name.encode().ljust(32, b"."), "big")
    return CacheEngineKey(model_name=MODEL, world_size=1, worker_id=0, chunk_hash=chunk, dtype=DTYPE)


def run(meta: str, mode: str, loop: asyncio.AbstractEventLoop) -> None:
    cfg, md = config(meta, mode), metadata()
    cpu = LocalCPUBackend(config=cfg, metadata=md, dst_device="cpu")
    backend = RemoteBackend(config=cfg, metadata=md, loop=loop, local_cpu_backend=cpu, dst_device="cpu")
    assert backend.connection is not None, f"LMCache could not create its connector ({mode})"
    connector = backend.connection
    connector = getattr(connector, "getWrappedConnector", lambda: connector)()
    wanted_class = "MooncakeStoreRemote" if mode == "native" else "MooncakestoreConnector"
    assert type(connector).__name__ == wanted_class, type(connector)
    shape = torch.Size([2, LAYERS, TOKENS, HEADS * DIM])
    # Chunk hashes of this run only: a chunk stored before keeps its bytes.
    run_id = os.urandom(4).hex()
    keys = [key(f"{mode}/{run_id}/{i}") for i in range(64)]
    objs = []
    for _ in keys:
        obj = cpu.allocate(shape, DTYPE, MemoryFormat.KV_2LTD)
        assert obj is not None, "LMCache's CPU allocator is full"
        obj.tensor.copy_(torch.randn(shape).to(DTYPE))
        objs.append(obj)
    expected = [obj.tensor.clone() for obj in objs]

    # Puts, batched as LMCache's storage manager submits them; LMCache
    # calls back once per chunk written.
    written = Done(len(keys))
    for start in range(0, len(keys), 16):
        backend.batched_submit_put_task(
            keys[start : start + 16], objs[start : start + 16], on_complete_callback=written.one
        )
    written.wait(timeout=30)
    assert backend.put_failed_count == 0, backend.put_failed_count
    held = [backend.contains(k) for k in keys]
    assert all(held), f"{held.count(False)} of {len(keys)} chunks put are not found"
    never = key(f"{mode}/{run_id}/never-put")
    assert not backend.contains(never)
    # LMCache's prefix lookup: how many leading chunks are stored.
    prefix = backend.batched_contains(keys[:8] + [never] + keys[8:16])
    assert prefix == 8, prefix

    # A request's last chunk is shorter (100 tokens): it reads back as such.
    short = torch.Size([2, LAYERS, 100, HEADS * DIM])
    tail = cpu.allocate(short, DTYPE, MemoryFormat.KV_2LTD)
    tail.tensor.copy_(torch.randn(short).to(DTYPE))
    tail_bytes = tail.tensor.clone()
    written = Done(1)
    backend.batched_submit_put_task([key(f"{mode}/{run_id}/tail")], [tail], on_complete_callback=written.one)
    written.wait(timeout=30)
    [back] = backend.batched_get_blocking([key(f"{mode}/{run_id}/tail")])
    assert back is not None and back.tensor.shape == short, None if back is None else back.tensor.shape
    assert torch.equal(back.tensor, tail_bytes), "the short chunk differs"
    back.ref_count_down()
    tail.ref_count_down()

    # Gets, into new memory objects, byte for byte; a chunk never put is a miss.
    wanted = keys[:32] + [never]
    got = backend.batched_get_blocking(wanted)
    assert got[-1] is None, "a chunk never put was found"
    for i, obj in enumerate(got[:-1]):
        assert obj is not None, f"chunk {i} missing"
        assert torch.equal(obj.tensor.view(shape), expected[i]), f"chunk {i} differs"
        obj.ref_count_down()
    who = "the native connector" if mode == "native" else f"LMCache's mooncakestore connector ({mode})"
    print(f"{who}: {len(keys)} chunks of {expected[0].numel() * 2 >> 10} KiB put, found, prefix "
          "looked up, read back byte for byte, a short last chunk too; a miss is None")
    for obj in objs:
        obj.ref_count_down()
    backend.close()


def lookup_client(meta: str, loop: asyncio.AbstractEventLoop) -> None:
    """LMCache's `MooncakeLookupClient` finds the chunks its connector put
    from a request's tokens: as many tokens as the stored leading chunks
    hold."""
    from lmcache.v1.lookup_client.mooncake_lookup_client import MooncakeLookupClient
    from lmcache.v1.token_database import ChunkedTokenDatabase

    cfg, md = config(meta, "zero copy"), metadata()
    cpu = LocalCPUBackend(config=cfg, metadata=md, dst_device="cpu")
    backend = RemoteBackend(config=cfg, metadata=md, loop=loop, local_cpu_backend=cpu, dst_device="cpu")
    # Tokens of this run only, so that no chunk of an earlier run matches.
    first = int.from_bytes(os.urandom(3), "big")
    tokens = list(range(first, first + 3 * TOKENS + 100))
    # Full chunks only: LMCache leaves a request's short last chunk out.
    keys = [k for _, _, k in ChunkedTokenDatabase(cfg, md).process_tokens(tokens)]
    assert len(keys) == 3, len(keys)
    shape = torch.Size([2, LAYERS, TOKENS, HEADS * DIM])
    objs = []
    for _ in range(2):
        obj = cpu.allocate(shape, DTYPE, MemoryFormat.KV_2LTD)
        obj.tensor.copy_(torch.randn(shape).to(DTYPE))
        objs.append(obj)
    written = Done(2)
    backend.batched_submit_put_task(keys[:2], objs, on_complete_callback=written.one)
    written.wait(timeout=30)
    client = MooncakeLookupClient(cfg, md, meta)
    assert client.lookup(tokens) == 2 * TOKENS, client.lookup(tokens)
    # The request without its first chunk shares no prefix with it.
    assert client.lookup(tokens[TOKENS:]) == 0
    print(f"LMCache's MooncakeLookupClient: {client.lookup(tokens)} of {len(tokens)} tokens "
          "stored (two chunks put), 0 for another prefix")
    client.close()
    for obj in objs:
        obj.ref_count_down()
    backend.close()


class Done:
    """Counts LMCache's per-chunk completion callbacks."""

    def __init__(self, expected: int):
        self.expected = expected
        self.count = 0
        self.cond = threading.Condition()

    def one(self, _key) -> None:
        with self.cond:
            self.count += 1
            self.cond.notify_all()

    def wait(self, timeout: float) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: self.count >= self.expected, timeout=timeout):
                raise SystemExit(f"{self.count} of {self.expected} puts done after {timeout} s")


def main(meta: str) -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        for mode in ("save_chunk_meta", "zero copy", "native"):
            run(meta, mode, loop)
        lookup_client(meta, loop)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)


if __name__ == "__main__":
    main(sys.argv[1])
