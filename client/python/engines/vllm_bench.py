"""vLLM's KV blocks through the native connector, timed: the worker side
of `mooncake_store.engines.vllm` with a paged KV cache on the CPU in
FlashAttention's layout (LAYERS layers of (2, blocks, 16 tokens, 8 heads of
128), fp16: 512 KiB a block at 8 layers), writing and loading requests of
BLOCKS blocks as vLLM's model runner asks it to (`wait_for_save`, then
`start_load_kv` into other blocks of the cache); GB/s and per-request
latency. Run by `tools/bench/engines.sh` when the engines' environment is
there (`tools/test-engines.sh` makes it).

Usage: python vllm_bench.py META_ADDR [--requests N] [--layers N] [--blocks N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

import mooncake_store
from mooncake_store.engines.vllm import MooncakeStoreNative, StoreMetadata, Transfer
from vllm_connector import vllm_config
from vllm_harness import MODEL

BLOCK, HEADS, DIM = 16, 8, 128


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("meta")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=64)
    args = parser.parse_args()

    model_dir = tempfile.mkdtemp(prefix="vllm-model-")
    Path(model_dir, "config.json").write_text(json.dumps(MODEL))
    config = vllm_config(model_dir, args.meta, "vllm-bench", 1)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(args.layers)]
    num_blocks = 2 * args.blocks
    kv_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(layers, FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float16))
        ],
    )
    worker = MooncakeStoreNative(config, KVConnectorRole.WORKER, kv_config)
    caches = {
        name: torch.randint(-1000, 1000, (2, num_blocks, BLOCK, HEADS, DIM)).to(torch.float16)
        for name in layers
    }
    worker.register_kv_caches(caches)
    block_bytes = sum(c[:, 0].numel() * c.element_size() for c in caches.values())
    store = mooncake_store.Client(args.meta, namespace="vllm-bench/auto/tp0of1")
    store.remove_all()

    def step(meta: StoreMetadata, what) -> float:
        worker.bind_connector_metadata(meta)
        t = time.perf_counter()
        what()
        took = time.perf_counter() - t
        worker.clear_connector_metadata()
        return took

    saves, loads = [], []
    src, dst = list(range(args.blocks)), list(range(args.blocks, 2 * args.blocks))
    for r in range(args.requests):
        keys = [os.urandom(32) for _ in range(args.blocks)]
        save = StoreMetadata(saves=[Transfer(f"r{r}", keys, src)])
        saves.append(step(save, worker.wait_for_save))
        load = StoreMetadata(loads=[Transfer(f"r{r}", keys, dst)])
        loads.append(step(load, lambda: worker.start_load_kv(None)))
        if worker.get_block_ids_with_load_errors():
            raise SystemExit("a block was not read back")
        for cache in caches.values():
            if not torch.equal(cache[:, src], cache[:, dst]):
                raise SystemExit("a block read back differs")
    total = args.blocks * block_bytes
    print(f"{args.requests} requests of {args.blocks} blocks, {block_bytes // 1024} KiB a block ({args.layers} layers)")
    print(f"{'op':<42}{'GB/s':>8}{'p50 ms':>10}{'max ms':>10}")
    for name, times in (("wait_for_save (gather, put)", saves), ("start_load_kv (get, scatter)", loads)):
        rate = total * len(times) / sum(times) / 1e9
        print(f"{'vllm native ' + name:<42}{rate:>8.2f}{statistics.median(times) * 1e3:>10.2f}{max(times) * 1e3:>10.2f}")
    worker.shutdown()


if __name__ == "__main__":
    main()
