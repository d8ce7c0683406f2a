"""SGLang's direct linker (`MooncakeDirectLinker`), unchanged, on this store:
the unified cache's external linker that writes a request's KV pages from
the device pool to Mooncake Store and loads them back layer by layer,
straight into the device pool, while the forward runs.

SGLang 0.5.23 builds the linker's view of the device pool for hybrid
models only (DeepSeek's sparse attention, Mamba, sliding window); this
driver gives it the pool of a DeepSeek sparse-attention model (SGLang's
own `DSATokenToKVPool`: an MLA latent cache and the indexer's keys, per
layer) on the CPU, where SGLang's device module is `torch.cpu`, so that
nothing of SGLang's is replaced. SGLang's `create_unified_cache_linker`
makes the linker from the options SGLang's docs give
(`--unified-cache-external-linker-backend mooncake` with the store's
address in its config); the driver then calls it as SGLang's
`UnifiedCacheLinkerWrapper` does, with the page keys SGLang's radix tree
computes (`get_storage_hash_str`):

- offload a request's pages (its write-through), and wait for it;
- look the pages up (the match of a later request);
- load them into other slots of the pool, start the batch's layer-wise
  loading, and read each layer as the forward's layer wait does: every
  byte of the KV and the indexer pages must equal what was offloaded;
- with a page gone from the store, the lookup stops before it;
- with pages removed between the lookup and the load, the batch reports
  its failure and no layer is marked landed.

Run by `tools/test-engines.sh`.

Usage: python sglang_direct_linker.py META_ADDR
"""

from __future__ import annotations

import concurrent.futures
import logging
import sys
import tempfile
import time

import torch

from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_direct_linker import MooncakeDirectLinker
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_context

from mooncake.store import MooncakeDistributedStore

PAGE = 64  # DSA's physical page
LAYERS, PAGES = 3, 32
# How long the driver waits for the linker's threads (a bound on a wait,
# not a speed check).
DEADLINE_S = 60.0


def linker_config(meta: str) -> dict:
    """`--unified-cache-external-linker-config`: the store's address, the
    daemons holding the blocks (no segment of the worker's own)."""
    return {
        "master_server_address": meta, "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
        "device_name": "", "global_segment_size": 0, "local_buffer_size": 64 << 20,
    }


class Worker:
    """One SGLang worker's pools and its direct linker."""

    def __init__(self, meta: str):
        self.server_args = get_context().override_server_args(
            model_path=tempfile.mkdtemp(prefix="sglang-dsa-"), tp_size=1, pp_size=1, dp_size=1, device="cpu",
        ).install()
        self.kv = DSATokenToKVPool(
            size=PAGES * PAGE, page_size=PAGE, kv_lora_rank=64, dtype=torch.bfloat16, qk_rope_head_dim=16,
            layer_num=LAYERS, device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=80,
        )
        allocator = PagedTokenToKVPoolAllocator(PAGES * PAGE, PAGE, torch.bfloat16, "cpu", self.kv, need_sort=False)
        requests = ReqToTokenPool(size=8, max_context_len=PAGES * PAGE, device="cpu", enable_memory_saver=False)
        params = CacheInitParams(
            disable=False, req_to_token_pool=requests, token_to_kv_pool_allocator=allocator, page_size=PAGE,
        )
        self.linker = create_unified_cache_linker(
            self.server_args, params, backend="mooncake", config=linker_config(meta), components={ComponentType.FULL},
        )
        assert isinstance(self.linker, MooncakeDirectLinker), type(self.linker)
        self.kv.register_layer_transfer_counter(self.linker.layer_done_counter)

    def buffers(self, layer: int) -> list[tuple[torch.Tensor, int]]:
        """A layer's buffers as bytes, with the rows a page spans in each:
        the latent KV (a row a token) and the indexer's keys (a row a page)."""
        return [
            (self.kv.kv_buffer[layer].view(torch.uint8), PAGE),
            (self.kv.index_k_with_scale_buffer[layer].view(torch.uint8), 1),
        ]

    def page_bytes(self, page: int, layer: int) -> list[torch.Tensor]:
        return [buf[page * rows : (page + 1) * rows].clone() for buf, rows in self.buffers(layer)]

    def fill(self, pages: list[int], seed: int) -> None:
        """What a forward writes into these pages: bytes of their own."""
        g = torch.Generator().manual_seed(seed)
        for layer in range(LAYERS):
            for page in pages:
                for buf, rows in self.buffers(layer):
                    part = buf[page * rows : (page + 1) * rows]
                    part.copy_(torch.randint(0, 256, part.shape, dtype=torch.uint8, generator=g))

    def offload(self, keys: list[str], pages: list[int]) -> None:
        """The write-through of a request's pages; waits for it to land."""
        assert self.linker.offload([kv_transfer(keys, pages)])
        deadline = time.monotonic() + DEADLINE_S
        while not self.linker.num_completed_offloads():
            assert time.monotonic() < deadline, "the offload did not complete"
            time.sleep(0.01)
        assert self.linker.pop_completed_offload() is True, "the offload failed"

    def lookup(self, rid: str, keys: list[str]) -> int:
        """Pages of `keys` the store can restore, as the match sees them."""
        restorable = self.linker.lookup(rid, [kv_transfer(keys, None)])
        return max(restorable, default=0)

    def load(self, rid: str, keys: list[str], pages: list[int]) -> tuple[bool, list[list[list[torch.Tensor]]]]:
        """Loads `keys` into `pages` as a batch, then reads each layer as the
        forward does once the layer's wait returns; whether the batch landed,
        and what each layer's pages held when the forward read them."""
        assert self.linker.load(rid, [kv_transfer(keys, pages)])
        counter = self.linker.layer_done_counter
        index = self.linker.start_layer_wise_loading()
        # Bound the wait on SGLang's futures before its own unbounded waits.
        done, _ = concurrent.futures.wait(counter.futures[index], timeout=DEADLINE_S)
        assert len(done) == LAYERS, "the layer-wise load did not end"
        counter.set_consumer(index)
        seen = []
        for layer in range(LAYERS):
            counter.wait_until(layer)  # the attention layer's wait on the KV pool
            seen.append([self.page_bytes(page, layer) for page in pages])
        return self.linker.finish_layer_wise_loading(index), seen

    def close(self) -> None:
        self.linker.close()


def kv_transfer(keys: list[str], pages: list[int] | None) -> PoolTransfer:
    """The FULL component's transfer, as SGLang's tree builds it: page keys,
    and the device slots of those pages (token indices)."""
    slots = None
    if pages is not None:
        slots = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE, dtype=torch.int64) for p in pages])
    return PoolTransfer(name=PoolName.KV, keys=list(keys), device_indices=slots)


def main() -> None:
    meta = sys.argv[1]
    w = Worker(meta)
    tokens = [(i * 31 + 7) % 32000 for i in range(6 * PAGE)]
    keys = get_storage_hash_str(tokens, None, page_size=PAGE)
    assert len(keys) == 6

    # A request's six pages, computed into pages 1-6 of the pool, written
    # through to the store.
    source = list(range(1, 7))
    w.fill(source, seed=1)
    w.offload(keys, source)
    before = [[w.page_bytes(page, layer) for page in source] for layer in range(LAYERS)]
    print(f"  offloaded {len(keys)} pages of {LAYERS} layers (MLA latent KV and DSA indexer keys)")

    # A later request with that prefix: the match finds all six; they are
    # loaded into other pages, layer by layer, bytes exact.
    assert w.lookup("r2", keys) == 6
    target = list(range(10, 16))
    landed, seen = w.load("r2", keys, target)
    assert landed, "the layer-wise load failed"
    for layer in range(LAYERS):
        for i, page in enumerate(target):
            for got, want in zip(seen[layer][i], before[layer][i]):
                assert torch.equal(got, want), f"page {page} of layer {layer} differs"
    print(f"  lookup: 6 pages; loaded layer by layer into other pages, all {LAYERS} layers bytes exact")

    # A page gone from the store (evicted, or its daemon lost): the match
    # stops before it.
    store = MooncakeDistributedStore()
    assert store.setup("localhost", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", meta) == 0
    tagged = stored_keys(w, keys)
    assert all(store.is_exist(k) == 1 for k in tagged), "the linker's objects are not where SGLang names them"
    # Forced: the lookup above leased the pages, and as in Mooncake a lease
    # refuses a removal that is not (a loss is not asked).
    assert store.remove(tagged[3], force=True) == 0
    assert w.lookup("r3", keys) == 3
    print("  a page removed from the store: the lookup finds the 3 before it")

    # Pages removed between the lookup and the load: the batch reports the
    # failure (SGLang then aborts the loading requests) and no page is read
    # from a half-loaded slot as if it had landed.
    assert w.lookup("r4", keys[:3]) == 3
    for k in tagged[:3]:
        assert store.remove(k, force=True) == 0
    # SGLang logs the failure with its traceback; this one is expected.
    logging.getLogger(MooncakeDirectLinker.__module__).disabled = True
    landed, _ = w.load("r4", keys[:3], list(range(20, 23)))
    logging.getLogger(MooncakeDirectLinker.__module__).disabled = False
    assert not landed, "a load of removed pages reported success"
    print("  pages removed between lookup and load: the batch reports its failure")
    store.close()
    w.close()
    print("SGLang MooncakeDirectLinker: ok")


def stored_keys(w: Worker, keys: list[str]) -> list[str]:
    """The store's object keys of `keys`' pages, as SGLang's Mooncake
    backend names them (its tags and the rank's suffix), one a page."""
    storage = w.linker.storage
    transfer = w.linker.pool_group.resolve_transfers([kv_transfer(keys, None)], allow_partial=True)[0]
    component_keys, per_page = storage._get_hybrid_page_component_keys(list(keys), transfer)
    assert per_page == 1, per_page
    return storage._tag_keys(component_keys)


if __name__ == "__main__":
    main()
