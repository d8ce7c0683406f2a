"""vLLM's own `MooncakeStoreConnector` (vllm/distributed/kv_transfer/
kv_connector/v1/mooncake/store/), unchanged, on this store: the connector
vLLM documents for Mooncake Store, configured as docs/engines/vllm.md says
(MOONCAKE_CONFIG_PATH, `standalone-store` mode).

Builds vLLM's `VllmConfig` for a small Llama-shaped model (its config.json
only), vLLM's v1 `Scheduler`, which creates the connector's scheduler side
through vLLM's own factory, and the worker side with a paged KV cache on
the CPU in vLLM's layout (blocks, KV heads, block size, K and V), in a
process whose tensor-parallel group vLLM itself set up (gloo). With
tensor parallelism, as vLLM's multiprocess executor runs it: each rank's
worker in a process of its own, holding its share of the KV heads, the
ranks' connector outputs joined by vLLM's `KVOutputAggregator`.
A stand-in for the model runner calls the connector as vLLM's
`KVConnectorModelRunnerMixin` does (bind the step's metadata, write the KV
of the tokens scheduled, start the loads, wait for the saves, collect
finished and failed transfers, load errors, stats, worker metadata) and
writes, for each token and KV head, bytes that depend on the head, the
token and all tokens before it, so that what the connector loads from the
store is checked byte for byte against what the model would have
computed, whichever rank wrote each head.

The connector's lookups, loads and saves run in its own threads, as on a
GPU host. The one substitution: `torch.cuda.Event`, which the connector
records after each forward pass so that its saving thread waits for the
GPU's KV writes, is a host event here (the writes are done when the
stand-in's forward returns); this CPU build of torch has no CUDA.

Run by `tools/test-engines.sh`.

Usage: python vllm_store_connector.py META_ADDR
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch


class HostEvent:
    """`torch.cuda.Event` on a host without a GPU: the work it would order is
    done when it is recorded."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream=None) -> None:
        pass


torch.cuda.Event = HostEvent  # before vLLM's connector module is imported

from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (  # noqa: E402
    MooncakeStoreConnector,
)
from vllm.distributed.parallel_state import (  # noqa: E402
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from mooncake.store import MooncakeDistributedStore  # noqa: E402
from own_store import eventually, replica_kinds, small_store  # noqa: E402
from vllm_harness import (  # noqa: E402
    BLOCK, BLOCKS, HEADS, Requests, check_kv, kv_cache_config, kv_caches, runner_output, write_kv,
)
from vllm_harness import model_dir as make_model_dir  # noqa: E402

# How long the driver waits for the connector's threads to finish a
# transfer before it fails (a bound on a wait, not a speed check).
DEADLINE_S = 60.0


def mooncake_config(meta: str, **fields) -> str:
    """A MOONCAKE_CONFIG_PATH file: docs/engines/vllm.md's (`standalone-store`
    mode, the store's daemons hold the blocks), or with `fields` changed."""
    config = {
        "local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
        "mode": "standalone-store", "global_segment_size": 0,
        "protocol": "tcp", "device_name": "", "master_server_address": meta,
    }
    config.update(fields)
    path = Path(tempfile.mkdtemp(prefix="vllm-mooncake-"), "mooncake.json")
    path.write_text(json.dumps(config))
    return str(path)


def meta_of(mooncake_json: str) -> str:
    return json.loads(Path(mooncake_json).read_text())["master_server_address"]


def vllm_config(model_dir: str, extra: dict | None = None, tp: int = 1) -> VllmConfig:
    config = VllmConfig(
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float16", seed=0),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=512, max_model_len=4096,
            enable_chunked_prefill=True, is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="MooncakeStoreConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config=dict(extra or {}),
        ),
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = BLOCKS
    # The layout vLLM's engine core resolves (resolve_kv_cache_layout) for
    # an HNC attention backend, which is the caches' layout: per layer
    # (blocks, KV heads, block size, K and V).
    config.cache_config.kv_cache_layout = "LBHNC"
    return config


@dataclass
class Work:
    """A model-runner step on one rank, as vLLM's executor hands it to each
    worker: the connector's metadata, and the KV to check (of requests in
    their first step: what they start from was loaded) and to write."""

    metadata: object
    sync_loads: bool
    finished: set[str]
    checks: list[tuple[str, list[int], list[int], int]]  # request, tokens, its blocks, tokens to check
    writes: list[tuple[list[int], list[int], int, int]]  # tokens, blocks, first token, tokens


class Rank:
    """One tensor-parallel rank's worker: the connector's worker side and
    the rank's paged KV cache (its share of the KV heads), in the process
    whose tensor-parallel group vLLM set up."""

    def __init__(self, config: VllmConfig, mooncake_json: str, rank: int, tp: int):
        # vLLM's connector reads it when its worker side is made.
        os.environ["MOONCAKE_CONFIG_PATH"] = mooncake_json
        per_rank = HEADS // tp
        self.heads = range(rank * per_rank, (rank + 1) * per_rank)
        with set_current_vllm_config(config):
            self.worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config(per_rank))
            assert isinstance(self.worker, MooncakeStoreConnector), type(self.worker)
            self.caches = kv_caches(per_rank)
            self.worker.register_kv_caches(self.caches)

    def run(self, work: Work) -> KVConnectorOutput:
        """The step as vLLM's KV connector mixin runs it around the model."""
        w = self.worker
        w.bind_connector_metadata(work.metadata)
        if work.sync_loads:
            w.start_load_kv(None)
        for req_id, tokens, blocks, upto in work.checks:
            try:
                check_kv(self.caches, self.heads, tokens, blocks, upto)
            except AssertionError as e:
                raise AssertionError(f"{req_id}: {e}") from None
        for tokens, blocks, start, n in work.writes:
            write_kv(self.caches, self.heads, tokens, blocks, start, n)
        if not work.sync_loads:
            w.start_load_kv(None)
        w.wait_for_save()
        results = w.get_transfer_results(work.finished)
        output = KVConnectorOutput(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
            invalid_block_ids=w.get_block_ids_with_load_errors(),
            kv_connector_stats=w.get_kv_connector_stats(),
            kv_cache_events=w.get_kv_connector_kv_cache_events(),
            kv_connector_worker_meta=w.build_connector_worker_meta(),
        )
        w.clear_connector_metadata()
        return output

    def saving(self) -> bool:
        return self.worker.connector_worker.kv_send_thread.request_queue.unfinished_tasks > 0

    def close(self) -> None:
        self.worker.shutdown()


def serve_rank(model_dir: str, mooncake_json: str, extra: dict | None, tp: int, rank: int, port: int, pipe) -> None:
    """A worker process of a tensor-parallel instance, as vLLM's
    multiprocess executor starts one: its process group (gloo), its rank,
    then the steps its executor sends, until told to stop."""
    config = vllm_config(model_dir, extra, tp)
    config.parallel_config.rank = rank  # as vLLM's WorkerBase sets it
    init_vllm_process(config, tp, rank, port)
    me = Rank(config, mooncake_json, rank, tp)
    pipe.send("ready")
    while (work := pipe.recv()) is not None:
        try:
            pipe.send(me.saving() if work == "saving" else me.run(work))
        except AssertionError as e:
            pipe.send(e)
    me.close()


class RankProcess:
    """The executor's handle on a rank in a process of its own."""

    def __init__(self, model_dir: str, mooncake_json: str, extra: dict | None, tp: int, rank: int, port: int):
        spawn = multiprocessing.get_context("spawn")
        self.pipe, theirs = spawn.Pipe()
        self.process = spawn.Process(
            target=serve_rank, args=(model_dir, mooncake_json, extra, tp, rank, port, theirs), daemon=True,
        )
        self.process.start()

    def send(self, work) -> None:
        self.pipe.send(work)

    def answer(self):
        if not self.pipe.poll(DEADLINE_S):
            raise AssertionError(f"a worker process did not answer within {DEADLINE_S:.0f}s")
        answer = self.pipe.recv()
        if isinstance(answer, AssertionError):
            raise answer
        return answer

    def close(self) -> None:
        self.send(None)
        self.process.join(DEADLINE_S)
        if self.process.is_alive():
            self.process.kill()


class Engine(Requests):
    """One vLLM instance: its scheduler (with the connector's scheduler
    side, as in vLLM's engine core) and its tensor-parallel ranks' workers:
    in this process with one rank; with several, each in a process of its
    own, their connector outputs joined by vLLM's own `KVOutputAggregator`
    as its multiprocess executor does."""

    def __init__(self, model_dir: str, mooncake_json: str, extra: dict | None = None, tp: int = 1):
        self.config = vllm_config(model_dir, extra, tp)
        # The workers first: rank 0 serves the scheduler's lookups.
        if tp == 1:
            self.local: Rank | None = Rank(self.config, mooncake_json, 0, 1)
            self.processes: list[RankProcess] = []
        else:
            self.local, port = None, free_port()
            self.processes = [RankProcess(model_dir, mooncake_json, extra, tp, r, port) for r in range(tp)]
            for p in self.processes:
                assert p.answer() == "ready"
        with set_current_vllm_config(self.config):
            scheduler = Scheduler(
                vllm_config=self.config, kv_cache_config=kv_cache_config(HEADS // tp), log_stats=True,
                structured_output_manager=StructuredOutputManager(self.config), block_size=BLOCK,
            )
        assert isinstance(scheduler.connector, MooncakeStoreConnector), type(scheduler.connector)
        # The KV is written and checked by the ranks, wherever they run.
        super().__init__(scheduler, [], self.config.cache_config.prefix_caching_hash_algo)
        self.aggregator = KVOutputAggregator.from_connector(scheduler.connector, tp)
        self.loaded: dict[str, int] = {}  # tokens loaded from the store, per request
        self.load_errors: set[int] = set()
        self.stats: list = []

    def step(self, before_load=None) -> dict[str, int]:
        """One engine step: schedule, then the model runner's step on every
        rank; the tokens computed per request."""
        out = self.scheduler.schedule()
        if before_load is not None:
            before_load()
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        checks = []
        for req_id, start in starts.items():
            if req_id not in self.loaded:
                # Its first step: what it starts from came from the store
                # (or vLLM's own cache, which these instances start without).
                self.loaded[req_id] = start
                checks.append((req_id, self.tokens[req_id], self.slots(req_id), start))
        writes = [(self.tokens[r], self.slots(r), starts[r], n) for r, n in out.num_scheduled_tokens.items()]
        work = Work(out.kv_connector_metadata, out.has_sync_kv_loads, out.finished_req_ids, checks, writes)
        outputs = [self.local.run(work)] if self.local else self.on_processes(work)
        joined = self.aggregator.aggregate(
            [runner_output([], kv_connector_output=o) for o in outputs]
        ).kv_connector_output
        self.load_errors |= joined.invalid_block_ids
        if joined.kv_connector_stats is not None:
            self.stats.append(joined.kv_connector_stats)
        self.report(out, starts, joined)
        return dict(out.num_scheduled_tokens)

    def on_processes(self, work) -> list:
        for p in self.processes:
            p.send(work)
        return [p.answer() for p in self.processes]

    def saving(self) -> bool:
        """Whether a rank's connector still has saves to do."""
        return self.local.saving() if self.local else any(self.on_processes("saving"))

    def finish(self) -> None:
        """Steps until every request is done and every save has landed."""
        deadline = time.monotonic() + DEADLINE_S
        while self.scheduler.has_requests() or self.saving():
            if time.monotonic() > deadline:
                raise AssertionError("requests or their saves did not finish")
            if not self.step():
                time.sleep(0.01)  # waiting on the connector's threads

    def run(self, req_id: str, prompt: list[int], max_tokens: int) -> int:
        """Serves one request to its end; the tokens it loaded from the store."""
        self.add(req_id, prompt, max_tokens)
        self.finish()
        return self.loaded.get(req_id, 0)

    def counted(self, name: str) -> int:
        return sum(s.reduce().get(name, 0) for s in self.stats)

    def close(self) -> None:
        self.scheduler.shutdown()
        if self.local:
            self.local.close()
        for p in self.processes:
            p.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_vllm_process(config: VllmConfig, tp: int = 1, rank: int = 0, port: int | None = None) -> None:
    """The process groups vLLM gives a worker process: rank `rank` of `tp`,
    on the CPU (gloo)."""
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=tp, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port or free_port()}",
            local_rank=rank, backend="gloo",
        )
        initialize_model_parallel(tp, 1)


def main() -> None:
    meta = sys.argv[1]
    standalone = mooncake_config(meta)
    model_dir = make_model_dir()
    init_vllm_process(vllm_config(model_dir))

    # 1. One instance serves a request; the connector saves the prompt's
    #    full blocks (vLLM's default leaves decode blocks unsaved).
    a = Engine(model_dir, standalone)
    prompt = [(i * 37 + 11) % 1000 for i in range(200)]
    assert a.run("r1", prompt, max_tokens=20) == 0
    saved = a.counted("save_put_total_keys")
    assert saved == 200 // BLOCK and a.counted("save_put_failed_keys") == 0, [s.reduce() for s in a.stats]
    a.close()
    print(f"  1 instance, 200-token prompt: {saved} blocks saved by vLLM's connector")

    # 2. Another instance, with nothing cached locally, gets a request that
    #    shares 180 tokens: the connector's lookup finds the 11 full blocks
    #    they fill, its threads load them, and vLLM computes only the rest;
    #    the loaded bytes are what the model computes. This one puts with
    #    Mooncake's group semantics on (ReplicateConfig.group_ids).
    b = Engine(model_dir, standalone, {"enable_group_semantics": "true"})
    loaded = b.run("r2", prompt[:180] + [(i * 13 + 5) % 1000 for i in range(40)], max_tokens=4)
    assert loaded == 176 and not b.load_errors, (loaded, b.load_errors)
    assert b.counted("load_get_total_keys") == 11 and b.counted("load_get_failed_keys") == 0
    # Its own two new full blocks; the 11 it found are not written again.
    assert b.counted("save_put_total_keys") == 2, [s.reduce() for s in b.stats]
    b.close()
    print(
        f"  2nd instance, 180 shared tokens: {loaded} loaded by vLLM's connector, bytes exact;"
        " 2 new blocks saved (group semantics on)"
    )

    # 3. Blocks gone between the lookup and the load (removed here; evicted
    #    or a daemon lost in a cluster): the connector reports them, vLLM
    #    recomputes them, and the request ends with the right KV.
    c = Engine(model_dir, standalone)
    other = MooncakeDistributedStore()
    assert other.setup("localhost", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", meta) == 0
    c.add("r3", prompt + [7] * 8, max_tokens=2)
    removed: list[bool] = []

    def remove_once_loading() -> None:
        # The step whose schedule gave the request its blocks to load (the
        # lookup runs in the connector's thread; vLLM asks again each step).
        if not removed and c.scheduler.requests["r3"].status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            # The lookup leased them: as in Mooncake, only a forced removal
            # takes them (a loss is not asked).
            assert other.remove_all(force=True) >= 12
            removed.append(True)

    deadline = time.monotonic() + DEADLINE_S
    while not removed:
        assert time.monotonic() < deadline, "the lookup found nothing to load"
        c.step(before_load=remove_once_loading)
        time.sleep(0.01)
    c.finish()
    failed = c.counted("load_get_failed_keys")
    assert failed == 12 and len(c.load_errors) == 12, (failed, c.load_errors)
    c.close()
    print(f"  blocks removed before their load: {failed} reported to vLLM, recomputed, KV exact")

    # 4. The store has them again (saved when recomputed): another instance
    #    loads them. 5. vLLM's prefix-cache reset reaches the store (the
    #    connector's remove_all): afterwards nothing is found.
    d = Engine(model_dir, standalone)
    # Before it serves, it sleeps and wakes as vLLM's sleep mode does: its
    # KV cache unregistered from the connector, its memory given back and
    # committed again (same addresses, other bytes), registered again.
    d.local.worker.unregister_kv_caches()
    for cache in d.local.caches.values():
        cache.fill_(-1.0)
    d.local.worker.restore_kv_caches()
    loaded = d.run("r4", prompt + [7] * 8 + [5] * 30, max_tokens=2)
    assert loaded == 208, loaded
    # An instance of another tenant (vLLM passes Mooncake's `tenant_id`)
    # finds none of them.
    t = Engine(model_dir, mooncake_config(meta, tenant_id="another-team"))
    assert t.run("r4t", prompt + [7] * 8 + [5] * 30, max_tokens=2) == 0
    t.close()
    assert d.scheduler.connector.reset_cache() is True
    d.close()
    e = Engine(model_dir, standalone)
    assert e.run("r5", prompt + [7] * 8, max_tokens=2) == 0
    e.close()
    other.close()
    print(
        f"  recomputed blocks saved again ({loaded} tokens loaded by a 4th instance, none by another tenant's);"
        " vLLM's reset_cache empties the store; loads after a sleep and wake-up are exact"
    )

    # 6. vLLM's default `embedded` mode: each instance contributes a segment
    #    (here a daemon of this package beside it, from MOONCAKE_BIN); another
    #    instance loads what it saved.
    if os.environ.get("MOONCAKE_BIN"):
        f = Engine(model_dir, mooncake_config(meta, mode="embedded", global_segment_size="64MB"))
        prompt = [(i * 11 + 3) % 1000 for i in range(96)]
        f.run("r6", prompt, max_tokens=2)
        g = Engine(model_dir, mooncake_config(meta, mode="embedded", global_segment_size="64MB"))
        loaded = g.run("r7", prompt + [9] * 20, max_tokens=2)
        assert loaded == 96, loaded
        g.close()
        f.close()
        print(f"  embedded mode (a 64MB segment each): {loaded} tokens one instance saved, loaded by another")
    tensor_parallel(model_dir, standalone)
    if os.environ.get("MOONCAKE_BIN"):
        leases(model_dir)
        drive_blocks(model_dir)
    print("vLLM MooncakeStoreConnector: ok")


def tensor_parallel(model_dir: str, mooncake_json: str) -> None:
    """7. Tensor parallelism: each rank's worker in a process of its own,
    as vLLM's multiprocess executor runs them, each holding half the KV
    heads. With vLLM's `store_tp_size` the ranks' shards of a block are
    stored so that instances of other TP sizes load them."""
    prompt = [(i * 29 + 17) % 1000 for i in range(200)]
    sharded = {"store_tp_size": 2}

    # A TP 2 instance saves the prompt's 12 full blocks, a shard a rank.
    h = Engine(model_dir, mooncake_json, sharded, tp=2)
    request = h.add("t1", prompt, max_tokens=4)
    h.finish()
    saved = h.counted("save_put_total_keys")
    assert h.loaded["t1"] == 0 and saved == 2 * 12 and h.counted("save_put_failed_keys") == 0, h.stats
    h.close()

    # Rank 1's shard of the 6th block is lost (removed here; in a cluster,
    # a daemon lost). Its key as vLLM's connector names it: the TP 1
    # instance's layout holds both shards.
    second = prompt[:180] + [(i * 3 + 1) % 1000 for i in range(40)]
    i = Engine(model_dir, mooncake_json, sharded, tp=1)
    layout = i.local.worker.connector_worker.token_dbs[0].store_layout
    assert tuple(layout.local_shard_ids) == (0, 1), layout.local_shard_ids
    shard = layout.key_for(1, request.block_hashes[5])
    store = MooncakeDistributedStore()
    assert store.setup("localhost", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", meta_of(mooncake_json)) == 0
    # is_exist leases it: as in Mooncake, only a forced removal takes it.
    assert store.is_exist(shard) == 1 and store.remove(shard, force=True) == 0, shard
    store.close()

    # The TP 1 instance (all heads on one rank) gets a request sharing 180
    # tokens: it loads the 5 blocks before the lost shard, each from its
    # two shards into its heads, bytes exact; it computes the rest and
    # saves what the store lacks: the lost shard, and its 2 new blocks'.
    loaded = i.run("t2", second, max_tokens=4)
    assert loaded == 5 * BLOCK and not i.load_errors, (loaded, i.load_errors)
    assert i.counted("load_get_total_keys") == 2 * 5 and i.counted("save_put_total_keys") == 1 + 2 * 2, i.stats
    i.close()
    print(
        f"  tensor parallelism, vLLM's store_tp_size 2: a TP 2 instance saved {saved} shards (12 blocks);"
        f" after one shard was lost, a TP 1 instance loaded the {loaded} tokens before it, bytes exact,"
        " and saved the lost shard and its new blocks'"
    )

    # A TP 2 instance loads the 13 blocks both wrote (11 by TP 2, 2 by
    # TP 1), each rank its heads, bytes exact.
    j = Engine(model_dir, mooncake_json, sharded, tp=2)
    loaded = j.run("t3", second + [4] * 20, max_tokens=2)
    assert loaded == 13 * BLOCK and not j.load_errors, (loaded, j.load_errors)
    j.close()
    print(f"  a TP 2 instance loaded {loaded} tokens, 3 blocks' shards of them saved by TP 1, both ranks bytes exact")


def leases(model_dir: str) -> None:
    """8. What a lookup found is still in the store when vLLM loads it,
    however much the store took in between: Mooncake's `batch_is_exist`
    leases each key it finds (here for the daemon's `kv_lease_ttl`), and
    with VLLM_MOONCAKE_STORE_SELECTIVE_LEASE vLLM probes without a lease
    (`batch_probe_key`), then leases what its hit loads. A 4 MiB store, in
    which another client puts four times its size between each lookup and
    its load."""
    with small_store("4MiB", '[daemon]\nkv_lease_ttl = "10m"\n') as meta:
        mooncake_json = mooncake_config(meta)
        other = MooncakeDistributedStore()
        assert other.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", meta) == 0
        filled: list[str] = []

        def fill_once_loading(engine: Engine, req_id: str) -> None:
            if req_id in filled or engine.scheduler.requests[req_id].status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                return
            filled.append(req_id)
            for i in range(64):
                assert other.put(f"{req_id}-filler-{i}", b"f" * (256 << 10)) == 0

        def serve(engine: Engine, req_id: str, prompt: list[int]) -> int:
            engine.add(req_id, prompt, max_tokens=2)
            deadline = time.monotonic() + DEADLINE_S
            while req_id not in filled:
                assert time.monotonic() < deadline, "the lookup found nothing to load"
                engine.step(before_load=lambda: fill_once_loading(engine, req_id))
                time.sleep(0.01)
            engine.finish()
            assert not engine.load_errors and engine.counted("load_get_failed_keys") == 0, engine.load_errors
            return engine.loaded[req_id]

        first = [(i * 41 + 7) % 1000 for i in range(200)]
        second = [(i * 43 + 9) % 1000 for i in range(200)]
        a = Engine(model_dir, mooncake_json)
        a.run("s1", first, max_tokens=2)
        b = Engine(model_dir, mooncake_json)
        loaded = serve(b, "l1", first + [7] * 8)
        assert loaded == 192, loaded
        b.close()

        # Selective: a block of the hit is lost between vLLM's probe and
        # its lease (removed here); the lease says so, vLLM's hit ends
        # before it, and that much loads, exact, the rest recomputed.
        a.run("s2", second, max_tokens=2)
        a.close()
        os.environ["VLLM_MOONCAKE_STORE_SELECTIVE_LEASE"] = "1"
        try:
            c = Engine(model_dir, mooncake_json)
        finally:
            del os.environ["VLLM_MOONCAKE_STORE_SELECTIVE_LEASE"]
        store = c.local.worker.connector_worker.store
        probe, lost = store.batch_probe_key, []

        def probe_then_lose(keys: list[str]) -> list[int]:
            found = probe(keys)
            if not lost and len(keys) >= 12:
                lost.append(keys[6])
                assert other.remove(keys[6]) == 0
            return found

        store.batch_probe_key = probe_then_lose
        loaded = serve(c, "l2", second + [7] * 8)
        assert lost and loaded == 6 * BLOCK, (lost, loaded)
        c.close()
        other.close()
    print(
        "  leases: 192 tokens found by a lookup loaded exactly after 16 MiB went into a 4 MiB store;"
        f" vLLM's selective lease: a block lost after the probe, the {loaded} tokens before it loaded exactly"
    )


def drive_blocks(model_dir: str) -> None:
    """9. Blocks that went down to the daemon's NVMe drive: vLLM's lookup
    (`batch_is_exist`, a lease) has the daemon read them back into DRAM and
    hold them there, before the load that follows, which then reads DRAM
    (vLLM's load summary counts them as memory keys, not disk keys). A
    4 MiB store over a 64 MiB drive: the blocks one instance saved go to
    the drive under another client's 16 MiB; another instance then serves
    the same prompt."""
    with small_store("4MiB", '[daemon]\nkv_lease_ttl = "10m"\n', drive="64MiB") as meta:
        mooncake_json = mooncake_config(meta)
        other = MooncakeDistributedStore()
        assert other.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", meta) == 0
        prompt = [(i * 47 + 3) % 1000 for i in range(200)]
        a = Engine(model_dir, mooncake_json)
        a.run("d1", prompt, max_tokens=2)
        a.close()
        for i in range(64):
            assert other.put(f"drive-filler-{i}", b"f" * (256 << 10)) == 0

        b = Engine(model_dir, mooncake_json)
        store = b.local.worker.connector_worker.store
        exists, found = store.batch_is_exist, []

        def looking_up(keys: list[str]) -> list[int]:
            # Before vLLM's lookup: every block it will find lies on the
            # drive only (demotions are written in the background). Asked
            # without a lease, which would bring them back itself.
            stored = [k for k, e in zip(keys, other.batch_probe_key(keys)) if e == 1]
            if stored and not found:
                eventually(lambda: replica_kinds(other, stored) == {"disk"}, "blocks on the drive")
            answer = exists(keys)
            found.extend(k for k, e in zip(keys, answer) if e == 1 and k not in found)
            return answer

        store.batch_is_exist = looking_up
        brought: list[bool] = []

        def brought_back() -> None:
            # The step whose schedule gave the request its blocks to load:
            # the lease brought them back to DRAM before the load.
            if not brought and b.scheduler.requests["d2"].status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                eventually(lambda: replica_kinds(other, found) == {"memory"}, "blocks back in DRAM")
                brought.append(True)

        b.add("d2", prompt + [7] * 8, max_tokens=2)
        deadline = time.monotonic() + DEADLINE_S
        while not brought:
            assert time.monotonic() < deadline, "the lookup found nothing to load"
            b.step(before_load=brought_back)
            time.sleep(0.01)
        b.finish()
        assert not b.load_errors and b.counted("load_get_failed_keys") == 0, b.load_errors
        loaded = b.loaded["d2"]
        assert loaded == 192, loaded
        b.close()
        other.close()
    print(
        f"  drive blocks: {len(found)} blocks vLLM's lookup found only on the daemon's drive were back in DRAM"
        f" before its load; {loaded} tokens loaded exactly"
    )


if __name__ == "__main__":
    main()
