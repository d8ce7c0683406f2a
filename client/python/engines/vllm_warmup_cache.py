"""vLLM's shared warmup cache on Mooncake Store (`MooncakeArtifactStore`,
vllm/model_executor/model_loader/weight_cache/artifact_store.py), unchanged,
on this store.

vLLM 0.34's weight-cache daemons (`vllm preload --warmup-cache-stores
mooncake`, connected through MOONCAKE_CONFIG_PATH) mirror their warmup
caches, today FlashInfer's per-rank autotune tables, into Mooncake Store:
a daemon that tuned its kernels publishes its table (`is_exist`, then
`put`: the first writer wins), and a daemon of another host whose disk
cache lacks it reads it from the store (`get`) instead of tuning again or
asking a peer. This driver builds vLLM's own `FlashInferWarmupCache` with
the `mooncake` store twice, as two hosts with disk caches of their own
(VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR), publishes one host's tables through
the store vLLM built, and has the other resolve them through vLLM's own
`resolve` (what a daemon answers a peer's seed request with): bytes
exact, the first writer's table kept, a table never published a miss.
Run by `tools/test-engines.sh`.

Usage: python vllm_warmup_cache.py META_ADDR
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

from vllm.model_executor.model_loader.weight_cache.artifact_store import (
    MooncakeArtifactStore,
    artifact_key,
)
from vllm.model_executor.model_loader.weight_cache.warmup_cache import FlashInferWarmupCache
from vllm.model_executor.warmup.flashinfer_autotune_cache import flashinfer_autotune_filename


def host(name: str) -> FlashInferWarmupCache:
    """One host's warmup cache, with its own disk tier, as a weight-cache
    daemon builds it with `--warmup-cache-stores mooncake`."""
    os.environ["VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"autotune-{name}-")
    cache = FlashInferWarmupCache(["mooncake"])
    _disk, store = cache.store_sources  # built now, the disk root read now
    assert isinstance(store, MooncakeArtifactStore), cache.store_sources
    return cache


def table(seed: int, entries: int) -> dict:
    """An autotune table shaped as FlashInfer writes it: tactics per
    operation and shape."""
    return {
        f"fused_moe::tokens={t}::experts=64": [seed, t % 7, (t * seed) % 13] for t in range(entries)
    } | {"_metadata": {"flashinfer": "0.5", "seed": seed}}


def main() -> None:
    meta = sys.argv[1]
    config = {
        "local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
        "mode": "standalone-store", "global_segment_size": 0,
        "protocol": "tcp", "device_name": "", "master_server_address": meta,
    }
    path = Path(tempfile.mkdtemp(prefix="vllm-warmup-"), "mooncake.json")
    path.write_text(json.dumps(config))
    os.environ["MOONCAKE_CONFIG_PATH"] = str(path)

    config_hash = hashlib.sha256(os.urandom(16)).hexdigest()  # one model's compile factors
    tuned = host("a")
    published = {}
    for rank, entries in ((0, 40), (1, 40), (2, 60_000)):  # the last one some MiB
        key = artifact_key(tuned.kind, config_hash, flashinfer_autotune_filename(0, rank))
        data = json.dumps(table(rank + 1, entries)).encode()
        # What `_publish_autotune_table` does with a table it tuned: put
        # to every store (here the shared one; the disk tier holds it).
        tuned.store_sources[1].put(key, data)
        published[rank] = data
    # A second publisher of rank 0's table, tuned elsewhere: the first
    # writer's stays (vLLM's put checks `is_exist` first).
    late = json.dumps(table(99, 40)).encode()
    tuned.store_sources[1].put(artifact_key(tuned.kind, config_hash, flashinfer_autotune_filename(0, 0)), late)

    other = host("b")
    for rank, data in published.items():
        answer = other.resolve({"config_hash": config_hash, "dp_rank": 0, "rank": rank})
        assert answer == {flashinfer_autotune_filename(0, rank): json.loads(data)}, rank
    assert other.resolve({"config_hash": config_hash, "dp_rank": 0, "rank": 7}) is None
    assert other.resolve({"config_hash": "0" * 64, "dp_rank": 0, "rank": 0}) is None
    size = len(published[2])
    print(f"  3 autotune tables published by one host ({size / 2**20:.1f} MiB the largest) resolved by another"
          " from the store, exact; the first writer's table kept; unpublished ones a miss")
    print("vLLM warmup cache on Mooncake Store: ok")


if __name__ == "__main__":
    main()
