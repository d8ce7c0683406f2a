"""vLLM's KV cache on this store, natively: a v1 KV connector that vLLM
loads by its own plug-in mechanism, without a patch:

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "MooncakeStoreNative",
        "kv_connector_module_path": "mooncake_store.engines.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"meta": "HOST:7070"}}'

What it does:

- Objects are vLLM's own blocks, keyed by vLLM's own block hashes (the
  chained hash of a block's tokens and of every block before it), so the
  store's events name the same blocks as vLLM's. One object holds a block
  of every layer on one rank.
- A request's prefix check is one `match_prefix` round trip per rank, in
  the scheduler, before vLLM allocates blocks, and a lease on what it
  matched (one round trip more: the daemons keep those blocks from
  eviction for their `kv_lease_ttl`, as Mooncake's `batch_is_exist`
  does); the hit is loaded into vLLM's paged KV cache before the forward
  pass that needs it.
- Every block that fills (prompt and generated tokens) is written after the
  forward pass that computed it, as a chain (each block names the one
  before), so that daemons evict a request's blocks from the tail and keep
  the heads that others match.
- vLLM's KV cache may live on the GPU: blocks pass through a pinned host
  staging buffer (one copy each way, the one PCIe transfer any host-memory
  store needs), so no GPU memory is registered with the store.
- A block that cannot be read when its load comes (evicted, a daemon gone)
  is reported to vLLM (`get_block_ids_with_load_errors`), which recomputes
  it; a block that cannot be written is a future miss. Neither fails the
  step.
- Each worker's traffic (blocks loaded, missed, written, bytes, GB/s) goes
  to vLLM's connector stats, which vLLM logs as "KV Transfer metrics".
- With vLLM's KV events on (`--kv-events-config
  '{"enable_kv_cache_events": true, ...}'`), each block every rank wrote
  to the store is published through vLLM's own event publisher, as vLLM's
  Mooncake connector does: a `BlockStored` of one block with its parent,
  its token ids and the block size, medium `"CPU"`, beside vLLM's own
  events for its GPU blocks. A router then learns from the engine which
  prefixes the store holds, tokens included.

Keys live in the namespace `vllm/<model>/<kv dtype>/tp<rank>of<size>`
(`namespace` in the extra config replaces `vllm/<model>`): ranks hold
different heads of the same blocks and must not share objects.

Extra config: `meta` (the meta service's HOST:PORT, or `MOONCAKE_META`),
`namespace`, `token` (or `MOONCAKE_TOKEN`), `staging_mib` (the host staging
buffer, 256 by default; larger batches go through it in turns).
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored, KVCacheEvent, KVConnectorKVEvents
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

import mooncake_store

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class Transfer:
    """Blocks of one request to read or write: their keys, and the block
    ids of vLLM's paged KV cache they go to or come from. `parent` is the
    key of the block before the first (a write's chain)."""

    req_id: str
    keys: list[Any]
    block_ids: list[int]
    parent: Any = None
    # A write's tokens (block_size a block), when KV events are on.
    token_ids: Optional[list[int]] = None


@dataclass
class StoreMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers for one step."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


COUNTS = ("blocks_loaded", "blocks_missed", "blocks_saved", "blocks_not_saved", "bytes_loaded", "bytes_saved")
TIMES = ("load_seconds", "save_seconds")


@dataclass
class StoreStats(KVConnectorStats):
    """What the workers moved since vLLM last asked: blocks loaded, blocks
    that could not be (misses vLLM recomputes), blocks written and not, their
    bytes and the time spent. vLLM sums them over workers and logs them as
    "KV Transfer metrics" at its logging interval."""

    def __post_init__(self):
        for name in COUNTS + TIMES:
            self.data.setdefault(name, 0)

    def reset(self):
        for name in COUNTS + TIMES:
            self.data[name] = 0

    def aggregate(self, other: KVConnectorStats) -> "StoreStats":
        for name in COUNTS + TIMES:
            self.data[name] += other.data.get(name, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        out = {name: self.data[name] for name in COUNTS}
        for what, moved, seconds in (("load", "bytes_loaded", "load_seconds"), ("save", "bytes_saved", "save_seconds")):
            if self.data[seconds] > 0:
                out[f"{what}_gb_per_s"] = round(self.data[moved] / self.data[seconds] / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in COUNTS)


class StoreKVEvents(KVConnectorKVEvents):
    """The blocks the workers wrote, as vLLM's KV events. vLLM gathers every
    worker's into one (`add_events`, `increment_workers`); a block is
    published once every rank wrote its part (as many reports of the same
    event as workers), since a block some rank lacks is a miss."""

    def __init__(self, num_workers: int = 1) -> None:
        self.counts: Counter[KVCacheEvent] = Counter()
        self.workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self.counts.update(events)

    def aggregate(self) -> "StoreKVEvents":
        common = self.pop_common_events()
        self.counts = Counter(common)
        self.workers = 1
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self.counts.elements())

    def get_number_of_workers(self) -> int:
        return self.workers

    def clear_events(self) -> None:
        self.counts.clear()

    def pop_common_events(self) -> list[KVCacheEvent]:
        """The events every worker reported, in the order first reported."""
        common = [e for e, n in self.counts.items() if n >= self.workers]
        for event in common:
            del self.counts[event]
        return common


def _external(key: Any) -> Any:
    """The block hash a store key was made from, as vLLM's events carry it."""
    raw = key if isinstance(key, bytes) else bytes.fromhex(key)
    return maybe_convert_block_hash(raw)


@dataclass
class _Tracked:
    """A request the scheduler follows, to write its blocks as they fill."""

    request: "Request"
    block_ids: list[int]
    # Blocks [0, stored) are in the store (matched there, or written).
    stored: int


def _key(block_hash: Any) -> Any:
    """The store key of a vLLM block hash: the hash itself when it is 32
    bytes (sha256, vLLM's default), otherwise its hex as a string key."""
    raw = bytes(block_hash)
    return raw if len(raw) == 32 else raw.hex()


def _base_namespace(vllm_config: "VllmConfig", extra: dict) -> str:
    if extra.get("namespace"):
        base = str(extra["namespace"])
    else:
        model = vllm_config.model_config.model if vllm_config.model_config else "model"
        base = "vllm/" + "-".join(str(model).strip("/").split("/")[-2:])
    dtype = str(vllm_config.cache_config.cache_dtype)
    return f"{base}/{dtype}"


def _rank_namespace(base: str, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int) -> str:
    name = f"{base}/tp{tp_rank}of{tp_size}"
    if pp_size > 1:
        name += f"/pp{pp_rank}of{pp_size}"
    # The store's namespaces take letters, digits and ._-:/@+= (128 at most).
    name = "".join(c if c.isalnum() or c in "._-:/@+=" else "_" for c in name)
    return name[-128:]


def _ranks() -> tuple[int, int]:
    """This worker's tensor- and pipeline-parallel ranks, as vLLM's process
    groups say; (0, 0) where they are not set up (one process)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return get_tp_group().rank_in_group, get_pp_group().rank_in_group
    except (AssertionError, AttributeError, RuntimeError):
        return 0, 0


def _client(extra: dict, namespace: str) -> mooncake_store.Client:
    meta = extra.get("meta") or extra.get("master_server_address") or os.environ.get("MOONCAKE_META")
    if not meta:
        raise ValueError(
            "kv_connector_extra_config needs \"meta\": the meta service's HOST:PORT "
            "(or set MOONCAKE_META)"
        )
    token = extra.get("token") or os.environ.get("MOONCAKE_TOKEN")
    return mooncake_store.Client(str(meta), namespace=namespace, token=token)


class MooncakeStoreNative(KVConnectorBase_V1):
    """vLLM's KV connector (v1) on a Mooncake Store (Rust) cluster."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._block_size = vllm_config.cache_config.block_size
        parallel = vllm_config.parallel_config
        self._tp_size = parallel.tensor_parallel_size
        self._pp_size = parallel.pipeline_parallel_size
        base = _base_namespace(vllm_config, extra)
        events = vllm_config.kv_events_config
        self._events_on = bool(events is not None and events.enable_kv_cache_events)
        # Scheduler side: reports of blocks written, until every rank's came.
        self._events: Optional[StoreKVEvents] = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(self, extra, base)
            self._worker = None
        else:
            self._scheduler = None
            self._worker = _WorkerSide(self, extra, base)

    # -- the scheduler's calls ---------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        return self._scheduler.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._scheduler.build_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        self._scheduler.forget(request.request_id)
        return False, None

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        events = connector_output.kv_cache_events
        if not isinstance(events, StoreKVEvents):
            return
        if self._events is None:
            self._events = events
        else:
            self._events.add_events(events.get_all_events())

    def take_events(self):
        if self._events is None:
            return
        yield from self._events.pop_common_events()
        if not self._events.counts:
            self._events = None

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache: a write lost to a preemption is a future miss.
        return False

    # -- the worker's calls ------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StoreMetadata)
        self._worker.load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads finish in start_load_kv, before the forward pass.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        # Blocks are written whole (every layer) in wait_for_save.
        return

    def wait_for_save(self):
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, StoreMetadata)
        self._worker.save(meta.saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def get_kv_connector_stats(self) -> Optional[StoreStats]:
        if self._worker is None:
            return None
        return self._worker.take_stats()

    def get_kv_connector_kv_cache_events(self) -> Optional[StoreKVEvents]:
        if self._worker is None or not self._events_on:
            return None
        # Empty too: this worker still counts toward every rank's report.
        events = StoreKVEvents()
        events.add_events(self._worker.take_events())
        return events

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None) -> StoreStats:
        return StoreStats(data=dict(data or {}))

    def shutdown(self):
        if self._worker is not None:
            self._worker.close()


class _SchedulerSide:
    """Finds a request's blocks in the store, and plans each step's reads
    and writes."""

    def __init__(self, connector: MooncakeStoreNative, extra: dict, base: str):
        self.block_size = connector._block_size
        self.events_on = connector._events_on
        namespaces = [
            _rank_namespace(base, tp, connector._tp_size, pp, connector._pp_size)
            for pp in range(connector._pp_size)
            for tp in range(connector._tp_size)
        ]
        first = _client(extra, namespaces[0])
        # One client per rank's namespace, sharing the first's connections.
        self.clients = [first] + [first.with_namespace(ns) for ns in namespaces[1:]]
        self.tracked: dict[str, _Tracked] = {}
        # Per request: (local hit in tokens, store hit in tokens), from the
        # prefix check to the allocation.
        self.pending: dict[str, tuple[int, int]] = {}
        self.loads: list[Transfer] = []
        log.info("vLLM KV cache on Mooncake Store, namespaces %s", ", ".join(namespaces))

    def matched_tokens(self, request: "Request", num_computed_tokens: int) -> int:
        hashes = request.block_hashes
        # At least one token is computed by the model, to sample from.
        loadable = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        stored = 0
        if loadable > 0:
            keys = [_key(h) for h in hashes[:loadable]]
            try:
                # Every rank must hold a block for it to be loaded.
                stored = min(c.match_prefix(keys, lease=True) for c in self.clients)
            except mooncake_store.StoreError as err:
                log.warning("prefix check of %s: %s", request.request_id, err)
                stored = 0
        hit = stored * self.block_size
        self.pending[request.request_id] = (num_computed_tokens, hit)
        return max(0, hit - num_computed_tokens)

    def after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        local, hit = self.pending.pop(request.request_id, (0, 0))
        block_ids = list(blocks.get_block_ids()[0]) if blocks is not None else []
        tracked = self.tracked.get(request.request_id)
        if tracked is None:
            self.tracked[request.request_id] = _Tracked(request, block_ids, hit // self.block_size)
        else:
            # Resumed after a preemption: vLLM allocated its blocks anew.
            tracked.block_ids = block_ids
            tracked.stored = max(tracked.stored, hit // self.block_size)
        if num_external_tokens <= 0:
            return
        first = local // self.block_size
        last = (local + num_external_tokens) // self.block_size
        hashes = request.block_hashes
        self.loads.append(
            Transfer(
                req_id=request.request_id,
                keys=[_key(hashes[i]) for i in range(first, last)],
                block_ids=block_ids[first:last],
            )
        )

    def build_meta(self, out: "SchedulerOutput") -> StoreMetadata:
        meta = StoreMetadata(loads=self.loads)
        self.loads = []
        for new in out.scheduled_new_reqs:
            tracked = self.tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0])
                self._plan_save(meta, tracked, new.num_computed_tokens, out.num_scheduled_tokens[new.req_id])
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self.tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                # vLLM 0.33 lists a request resumed after preemption here,
                # its new ids being all of its blocks; vLLM 0.34 sends it
                # again in full among the new requests (above).
                if req_id in getattr(cached, "resumed_req_ids", ()):
                    tracked.block_ids = list(new_ids[0])
                else:
                    tracked.block_ids.extend(new_ids[0])
            self._plan_save(meta, tracked, cached.num_computed_tokens[i], out.num_scheduled_tokens[req_id])
        return meta

    def _plan_save(self, meta: StoreMetadata, tracked: _Tracked, start: int, scheduled: int) -> None:
        """Writes the blocks this step fills, after the blocks the store has.
        A request that starts below them recomputes blocks vLLM could not
        load (their writes were dropped): they are written again."""
        tracked.stored = min(tracked.stored, start // self.block_size)
        hashes = tracked.request.block_hashes
        full = min((start + scheduled) // self.block_size, len(hashes), len(tracked.block_ids))
        if full <= tracked.stored:
            return
        first = tracked.stored
        bs = self.block_size
        meta.saves.append(
            Transfer(
                req_id=tracked.request.request_id,
                keys=[_key(hashes[i]) for i in range(first, full)],
                block_ids=tracked.block_ids[first:full],
                parent=_key(hashes[first - 1]) if first > 0 else None,
                token_ids=list(tracked.request.all_token_ids[first * bs : full * bs]) if self.events_on else None,
            )
        )
        tracked.stored = full

    def forget(self, req_id: str) -> None:
        self.tracked.pop(req_id, None)
        self.pending.pop(req_id, None)


@dataclass
class _Layer:
    """One layer's paged KV cache, and where a block lies in it."""

    name: str
    cache: torch.Tensor
    # The dimension of `cache` that indexes blocks.
    block_dim: int
    # Bytes of one block of this layer, and where they start in an object.
    nbytes: int
    offset: int


class _WorkerSide:
    """Moves blocks between vLLM's paged KV cache and the store, through a
    host staging buffer registered with the store."""

    def __init__(self, connector: MooncakeStoreNative, extra: dict, base: str):
        self.connector = connector
        self.extra = extra
        self.base = base
        self.client: Optional[mooncake_store.Client] = None
        self.layers: list[_Layer] = []
        self.block_bytes = 0
        self.staging: Optional[torch.Tensor] = None
        self.staging_blocks = 0
        self.load_errors: set[int] = set()
        # Requests whose load failed this step: what their forward pass
        # computes read missing blocks, and is not written.
        self.failed: set[str] = set()
        # Since vLLM last asked, and since the start (logged at shutdown).
        self.stats = StoreStats()
        self.total = StoreStats()
        self.block_size = connector._block_size
        # vLLM's events for the blocks written since vLLM last asked.
        self.events: list[KVCacheEvent] = []

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        tp_rank, pp_rank = _ranks()
        namespace = _rank_namespace(
            self.base, tp_rank, self.connector._tp_size, pp_rank, self.connector._pp_size
        )
        self.client = _client(self.extra, namespace)
        num_blocks = self.connector._kv_cache_config.num_blocks
        offset = 0
        for name, cache in kv_caches.items():
            block_dim = _block_dim(name, cache, num_blocks)
            nbytes = cache.numel() * cache.element_size() // cache.shape[block_dim]
            self.layers.append(_Layer(name, cache, block_dim, nbytes, offset))
            offset += nbytes
        self.block_bytes = offset
        budget = int(self.extra.get("staging_mib", 256)) << 20
        self.staging_blocks = max(1, budget // max(1, self.block_bytes))
        device = next(iter(kv_caches.values())).device if kv_caches else torch.device("cpu")
        self.staging = torch.empty(
            self.staging_blocks * self.block_bytes,
            dtype=torch.uint8,
            pin_memory=device.type == "cuda",
        )
        self.client.register_buffer(self.staging.data_ptr(), self.staging.numel())
        log.info(
            "%d layers, %d bytes a block, namespace %s, staging %d blocks on the host",
            len(self.layers), self.block_bytes, namespace, self.staging_blocks,
        )

    def _staged(self, n: int) -> tuple[list[int], list[int]]:
        """Addresses and sizes of the first n blocks of the staging buffer."""
        base = self.staging.data_ptr()
        return [base + i * self.block_bytes for i in range(n)], [self.block_bytes] * n

    def _rows(self, n: int) -> torch.Tensor:
        return self.staging[: n * self.block_bytes].view(n, self.block_bytes)

    def load(self, loads: list[Transfer]) -> None:
        self.failed = set()
        started = time.perf_counter()
        for transfer in loads:
            for start in range(0, len(transfer.keys), self.staging_blocks):
                keys = transfer.keys[start : start + self.staging_blocks]
                ids = transfer.block_ids[start : start + self.staging_blocks]
                if not self._load_some(keys, ids):
                    self.failed.add(transfer.req_id)
        if loads:
            self._count("load_seconds", time.perf_counter() - started)

    def _load_some(self, keys: list[Any], block_ids: list[int]) -> bool:
        """Reads blocks into the cache; False if any could not be read."""
        n = len(keys)
        ptrs, sizes = self._staged(n)
        try:
            got = self.client.get_into_ptrs(keys, ptrs, sizes)
        except mooncake_store.StoreError as err:
            log.warning("load of %d blocks: %s", n, err)
            got = [-1] * n
        ok = [i for i, g in enumerate(got) if g == self.block_bytes]
        missed = [block_ids[i] for i, g in enumerate(got) if g != self.block_bytes]
        self.load_errors.update(missed)
        self._count("blocks_missed", len(missed))
        self._count("blocks_loaded", len(ok))
        self._count("bytes_loaded", len(ok) * self.block_bytes)
        if ok:
            self._scatter(n, ok, [block_ids[i] for i in ok])
        return not missed

    def _scatter(self, n: int, ok: list[int], ids: list[int]) -> None:
        """Copies the staged blocks `ok` (of n) into cache blocks `ids`."""
        rows = self._rows(n)
        if len(ok) < n:
            rows = rows[ok]
        device = self.layers[0].cache.device
        # One transfer to the cache's device, then each layer's part, read
        # in place (a view) and copied into the cache once.
        rows = rows.to(device)
        index = torch.tensor(ids, dtype=torch.long, device=device)
        for layer in self.layers:
            cache = layer.cache
            shape = list(cache.shape)
            shape.pop(layer.block_dim)
            part = rows[:, layer.offset : layer.offset + layer.nbytes].view(cache.dtype)
            blocks = part.unflatten(1, shape).movedim(0, layer.block_dim)
            cache.index_copy_(layer.block_dim, index, blocks)

    def save(self, saves: list[Transfer]) -> None:
        started = time.perf_counter()
        for transfer in saves:
            if transfer.req_id in self.failed:
                continue
            parent = transfer.parent
            for start in range(0, len(transfer.keys), self.staging_blocks):
                keys = transfer.keys[start : start + self.staging_blocks]
                ids = transfer.block_ids[start : start + self.staging_blocks]
                tokens = None if transfer.token_ids is None else transfer.token_ids[start * self.block_size :]
                codes = self._save_some(keys, ids, parent, tokens)
                if tokens is not None:
                    self._stored_events(keys, codes, parent, tokens)
                parent = keys[-1]
        if saves:
            self._count("save_seconds", time.perf_counter() - started)

    def _stored_events(self, keys: list[Any], codes: list[int], parent: Any, tokens: list[int]) -> None:
        """vLLM's events for the blocks written (code 0): one block each,
        with its parent and tokens, as vLLM's Mooncake connector reports."""
        bs = self.block_size
        for i, (key, code) in enumerate(zip(keys, codes)):
            before = keys[i - 1] if i > 0 else parent
            if code == 0:
                self.events.append(
                    BlockStored(
                        block_hashes=[_external(key)],
                        parent_block_hash=_external(before) if before is not None else None,
                        token_ids=tokens[i * bs : (i + 1) * bs],
                        block_size=bs,
                        lora_id=None,
                        medium=MEDIUM_CPU,
                        lora_name=None,
                    )
                )

    def take_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events

    def _save_some(self, keys: list[Any], block_ids: list[int], parent: Any, tokens: Optional[list[int]] = None) -> list[int]:
        n = len(keys)
        # Each block tagged with vLLM's hash of it (and its tokens, when
        # vLLM's KV events are on), so that the store's own events name it
        # as vLLM's events do, whatever the store's hash form.
        bs = self.block_size
        tags = [(_external(k), None if tokens is None else tokens[i * bs : (i + 1) * bs]) for i, k in enumerate(keys)]
        rows = self._rows(n)
        device = self.layers[0].cache.device
        # Each layer's part gathered where the cache is, then one transfer.
        gathered = rows if device.type == "cpu" else torch.empty((n, self.block_bytes), dtype=torch.uint8, device=device)
        index = torch.tensor(block_ids, dtype=torch.long, device=device)
        for layer in self.layers:
            cache = layer.cache
            shape = list(cache.shape)
            shape.pop(layer.block_dim)
            part = gathered[:, layer.offset : layer.offset + layer.nbytes].view(cache.dtype).unflatten(1, shape)
            torch.index_select(cache, layer.block_dim, index, out=part.movedim(0, layer.block_dim))
        if gathered is not rows:
            # A blocking copy: the store reads the staging buffer next.
            rows.copy_(gathered)
        ptrs, sizes = self._staged(n)
        try:
            codes = self.client.put_from_ptrs(keys, ptrs, sizes, chain=True, parent=parent, tags=tags)
        except mooncake_store.StoreError as err:
            log.warning("save of %d blocks: %s", n, err)
            codes = [-1] * n
        saved = sum(1 for c in codes if c == 0)
        if saved < n:
            # A cache: an unwritten block is a future miss, counted in the stats.
            log.warning("save: %d of %d blocks not stored (codes %s)", n - saved, n, sorted(set(codes) - {0}))
        self._count("blocks_saved", saved)
        self._count("blocks_not_saved", n - saved)
        self._count("bytes_saved", saved * self.block_bytes)
        return codes

    def _count(self, name: str, value: float) -> None:
        self.stats.data[name] += value
        self.total.data[name] += value

    def take_stats(self) -> Optional[StoreStats]:
        """The stats since the last call, or None if nothing moved."""
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, StoreStats()
        return stats

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def close(self) -> None:
        if self.client is not None and self.staging is not None:
            self.client.unregister_buffer(self.staging.data_ptr())
        log.info("KV blocks: %s", ", ".join(f"{k} {v}" for k, v in self.total.reduce().items()))


def _block_dim(name: str, cache: torch.Tensor, num_blocks: int) -> int:
    """The dimension of a layer's KV cache that indexes blocks: the first of
    the two leading ones that has `num_blocks` entries ((2, blocks, ...) for
    FlashAttention's K and V, (blocks, ...) for MLA and FlashInfer)."""
    for dim in range(min(2, cache.dim())):
        if cache.shape[dim] == num_blocks:
            return dim
    raise ValueError(
        f"layer {name}: KV cache of shape {tuple(cache.shape)} has no block dimension "
        f"of {num_blocks} blocks among its first two"
    )
