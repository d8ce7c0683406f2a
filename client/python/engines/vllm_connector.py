"""vLLM's own scheduler on this store, through the native connector
`mooncake_store.engines.vllm`, loaded the way vLLM loads a connector from
`kv_connector_module_path`.

Builds vLLM's `VllmConfig` for a small Llama-shaped model (its config.json
only: no weights, no tokenizer), vLLM's v1 `Scheduler`, which creates the
scheduler side of the connector through vLLM's own factory, and the
worker side with a paged KV cache on the CPU in vLLM's layout (blocks,
KV heads, block size, K and V) per layer. A stand-in for the
model runner does what vLLM's does around a forward pass (binds the
step's connector metadata, starts the loads, writes the KV of the tokens
scheduled, waits for the saves, reports load errors) and writes, for each
token, KV bytes that depend on the token and all tokens before it, so
that a block loaded from the store is checked byte for byte against what
the model would have computed. Run by `tools/test-engines.sh`.

With the store's events ports, it also reads the store's events as a
consumer of vLLM's KV events does: the blocks the connector wrote show up
under vLLM's own block hashes, the ones vLLM's own events carry.

With MOONCAKE_BIN (the `mooncake-store` binary), it also starts a store of
its own, kills it under a running instance and starts it again.

Usage: python vllm_connector.py META_ADDR [EVENTS_ADDR REPLAY_ADDR]
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

import mooncake_store
from mooncake_store.engines import vllm as vllm_native
from mooncake_store.engines.vllm import MooncakeStoreNative
from vllm_harness import BLOCK, BLOCKS, HEADS, Requests, kv_cache_config, kv_caches
from vllm_harness import model_dir as make_model_dir
from vllm_kv_events import Subscriber


def vllm_config(model_dir: str, meta: str, namespace: str, tp: int, events: tuple[int, int] | None = None) -> VllmConfig:
    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float16", seed=0)
    # vLLM's own KV-event publisher (ZeroMQ, on these ports), when asked.
    kv_events = (
        KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq",
            endpoint=f"tcp://127.0.0.1:{events[0]}", replay_endpoint=f"tcp://127.0.0.1:{events[1]}",
        )
        if events
        else None
    )
    return VllmConfig(
        kv_events_config=kv_events,
        parallel_config=ParallelConfig(tensor_parallel_size=tp, distributed_executor_backend="mp"),
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=512, max_model_len=4096,
            enable_chunked_prefill=True, is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="MooncakeStoreNative",
            kv_connector_module_path="mooncake_store.engines.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"meta": meta, "namespace": namespace},
        ),
        device_config=DeviceConfig("cpu"),
    )


class Worker:
    """One tensor-parallel rank: the connector's worker side and the rank's
    paged KV cache."""

    def __init__(self, config: VllmConfig, rank: int):
        self.rank = rank
        # Rank r's KV heads: HEADS of its own (each rank's cache has HEADS).
        self.heads = range(rank * HEADS, (rank + 1) * HEADS)
        self.connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config())
        assert isinstance(self.connector, MooncakeStoreNative)
        self.caches = kv_caches()
        # The rank vLLM's process groups would give this worker's process.
        saved, vllm_native._ranks = vllm_native._ranks, lambda: (rank, 0)
        try:
            self.connector.register_kv_caches(self.caches)
        finally:
            vllm_native._ranks = saved


class Engine(Requests):
    """One vLLM instance: its scheduler (with the connector's scheduler
    side) and a worker per tensor-parallel rank."""

    def __init__(self, model_dir: str, meta: str, namespace: str, tp: int = 1, events: tuple[int, int] | None = None):
        self.config = vllm_config(model_dir, meta, namespace, tp, events)
        self.config.cache_config.num_gpu_blocks = BLOCKS
        scheduler = Scheduler(
            vllm_config=self.config, kv_cache_config=kv_cache_config(), log_stats=True,
            structured_output_manager=StructuredOutputManager(self.config), block_size=BLOCK,
        )
        assert isinstance(scheduler.connector, MooncakeStoreNative), type(scheduler.connector)
        self.workers = [Worker(self.config, rank) for rank in range(tp)]
        super().__init__(
            scheduler, [(w.heads, w.caches) for w in self.workers],
            self.config.cache_config.prefix_caching_hash_algo,
        )
        self.load_errors: set[int] = set()

    def schedule(self):
        return self.scheduler.schedule()

    def run(self, out, before_load=None) -> dict[str, int]:
        """The model runner's step for scheduler output `out`; returns the
        tokens scheduled per request."""
        if before_load is not None:
            before_load()
        errors: set[int] = set()
        for w in self.workers:
            w.connector.bind_connector_metadata(out.kv_connector_metadata)
            w.connector.start_load_kv(None)
            # Loads are synchronous: their failures are known now.
            errors |= w.connector.get_block_ids_with_load_errors()
        self.load_errors |= errors
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        # The loaded blocks hold what the model computes for them (a step
        # with failed loads is recomputed: vLLM drops what it computes).
        if not errors:
            for req_id, start in starts.items():
                self.check(req_id, start)
        for req_id, n in out.num_scheduled_tokens.items():
            self.forward(req_id, starts[req_id], n)
        # Every worker's KV events gathered into the first's, as vLLM's
        # KVOutputAggregator does.
        kv_events = None
        for w in self.workers:
            w.connector.wait_for_save()
            w.connector.clear_connector_metadata()
            mine = w.connector.get_kv_connector_kv_cache_events()
            if mine is None:
                continue
            if kv_events is None:
                kv_events = mine
            else:
                kv_events.add_events(mine.get_all_events())
                kv_events.increment_workers(1)
        self.report(
            out,
            starts,
            KVConnectorOutput(invalid_block_ids=errors, kv_cache_events=kv_events)
            if errors or kv_events is not None
            else None,
            sample=not errors,
        )
        return dict(out.num_scheduled_tokens)

    def finish(self, limit: int = 200) -> None:
        for _ in range(limit):
            if not self.scheduler.has_requests():
                return
            self.run(self.schedule())
        raise AssertionError("requests did not finish")

    def close(self) -> None:
        for w in self.workers:
            w.connector.shutdown()
        self.scheduler.shutdown()


def keys_of(request: Request) -> list[bytes]:
    return [bytes(h) for h in request.block_hashes]


def main() -> None:
    meta = sys.argv[1]
    namespace = "vllm-test"
    model_dir = make_model_dir()
    store = mooncake_store.Client(meta, namespace=f"{namespace}/auto/tp0of1")
    store.remove_all()
    events = Subscriber(*sys.argv[2:4]) if len(sys.argv) >= 4 else None

    # 1. One instance serves a request: its blocks, prompt and generated,
    #    land in the store as they fill, under vLLM's own block hashes.
    a = Engine(model_dir, meta, namespace)
    prompt = [(i * 37 + 11) % 1000 for i in range(200)]
    r1 = a.add("r1", prompt, max_tokens=20)
    a.finish()
    computed = 200 + 20 - 1  # the last token sampled is never a forward's input
    assert len(r1.block_hashes) >= computed // BLOCK
    keys = keys_of(r1)
    assert all(len(k) == 32 for k in keys), "vLLM's sha256 block hashes are the store's keys"
    stored = store.match_prefix(keys)
    assert stored == computed // BLOCK, (stored, computed // BLOCK)
    print(f"  1 instance, 200-token prompt, 20 generated: {stored} blocks stored (sha256 keys)")
    if events is not None:
        # A router reading the store's events (vLLM's format) sees the
        # hashes vLLM's own BlockStored events carry for these blocks.
        # (The store publishes hashes as vLLM's default integers:
        # events_int_hashes in tools/test-engines.sh.)
        chain = [maybe_convert_block_hash(h) for h in r1.block_hashes[:stored]]
        events.follow(lambda: set(chain) <= events.held)
        # And links them as vLLM's own events do: each block's parent is
        # the block before it in the request (the first has none).
        for i, h in enumerate(chain):
            want = chain[i - 1] if i else None
            assert events.parents.get(h) == want, (i, events.parents.get(h), want)
        print(
            f"  the store's events name those {stored} blocks by vLLM's own block hashes,"
            " each after its parent"
        )
        events.close()

    # 2. Another instance, with nothing cached locally, gets a request that
    #    shares 180 tokens: vLLM's scheduler loads the 11 full blocks they
    #    fill from the store and computes only the rest; the loaded bytes
    #    are what the model computes.
    b = Engine(model_dir, meta, namespace)
    b.add("r2", prompt[:180] + [(i * 13 + 5) % 1000 for i in range(40)], max_tokens=4)
    out = b.schedule()
    scheduled = b.run(out)
    assert scheduled["r2"] == 220 - 176, scheduled
    b.finish()
    print(f"  2nd instance, 180 shared tokens: 176 loaded, {scheduled['r2']} computed, loaded bytes exact")
    # What the worker reports, through vLLM's own stats logging.
    stats = b.workers[0].connector.get_kv_connector_stats()
    logged: list[str] = []
    logging = KVConnectorLogging(b.config.kv_transfer_config)
    logging.observe(stats.to_dict())
    logging.log(lambda fmt, *args: logged.append(fmt % args))
    assert stats.reduce()["blocks_loaded"] == 11, stats.reduce()
    assert stats.reduce()["blocks_missed"] == 0, stats.reduce()
    assert logged and "blocks_loaded=11" in logged[0], logged
    print(f"  vLLM's connector stats log: {logged[0]}")

    # 3. A hit whose blocks vanish between the prefix check and the load
    #    (evicted, a daemon gone): the connector reports them, vLLM
    #    recomputes them, and the request ends with the right KV.
    c = Engine(model_dir, meta, namespace)
    r3 = c.add("r3", prompt + [7] * 8, max_tokens=2)
    out = c.schedule()
    gone = keys_of(r3)[5:8]
    blocks = c.slots("r3")[5:8]
    c.run(out, before_load=lambda: store.remove(gone))
    assert c.load_errors == set(blocks), (c.load_errors, blocks)
    # Each later step checks every token before it (Engine.run).
    c.finish()
    print(f"  blocks removed before their load: {len(blocks)} reported to vLLM, recomputed, KV exact")

    # 4. The store has them again (written when recomputed).
    assert store.match_prefix(keys_of(r3)) >= 12, store.match_prefix(keys_of(r3))

    # 5. Two tensor-parallel ranks: each writes its heads of a block under
    #    its own namespace, and a block is a hit only where every rank has
    #    it. Rank 1 loses block 3: another instance loads blocks 0-2 on both.
    d = Engine(model_dir, meta, namespace, tp=2)
    prompt = [(i * 29 + 3) % 1000 for i in range(120)]
    r4 = d.add("r4", prompt, max_tokens=2)
    d.finish()
    rank1 = store.with_namespace(f"{namespace}/auto/tp1of2")
    assert rank1.match_prefix(keys_of(r4)) == 7, rank1.match_prefix(keys_of(r4))
    rank1.remove(keys_of(r4)[3:4])
    e = Engine(model_dir, meta, namespace, tp=2)
    e.add("r5", prompt + [9] * 16, max_tokens=2)
    scheduled = e.run(e.schedule())
    assert scheduled["r5"] == 136 - 48, scheduled
    e.finish()
    print("  2 tensor-parallel ranks: a block one rank lost is a miss; 3 blocks loaded on both, bytes exact")
    for engine in (a, b, c, d, e):
        engine.close()
    engine_events(model_dir, meta, namespace, sys.argv[2:4] if len(sys.argv) >= 4 else None)
    preemption(model_dir, meta, namespace)
    if os.environ.get("MOONCAKE_BIN"):
        store_restarted(model_dir, os.environ["MOONCAKE_BIN"])
        leases(model_dir, os.environ["MOONCAKE_BIN"])
    print("vLLM native connector: ok")


def preemption(model_dir: str, meta: str, namespace: str) -> None:
    """More requests than the KV cache holds: vLLM preempts one, frees its
    blocks, and resumes it later (vLLM 0.34 sends it again in full, among
    the new requests). Its blocks are found again, locally or in the
    store; every step checks that what each request starts from is the
    model's KV, and every request ends."""
    f = Engine(model_dir, meta, f"{namespace}-preempt")
    prompts = [[(i * 7 + 100 * r) % 1000 for i in range(480)] for r in range(3)]
    for r, prompt in enumerate(prompts):
        f.add(f"p{r}", prompt, max_tokens=60)
    preempted: set[str] = set()
    for _ in range(400):
        if not f.scheduler.has_requests():
            break
        out = f.schedule()
        preempted |= set(out.preempted_req_ids or ())
        f.run(out)
    assert not f.scheduler.has_requests(), "requests did not finish"
    assert preempted, "the KV cache held every request: nothing was preempted"
    assert not f.load_errors, f.load_errors
    f.close()
    # What it saved, the preempted request's blocks included, is what the
    # model computes: another instance loads each request's 33 full
    # blocks, prompt and generated tokens.
    g = Engine(model_dir, meta, f"{namespace}-preempt")
    for r in range(3):  # one at a time: its cache holds two such requests
        g.add(f"q{r}", f.tokens[f"p{r}"] + [1] * 16, max_tokens=1)
        out = g.schedule()
        starts = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        assert starts == {f"q{r}": 33 * BLOCK}, starts
        g.run(out)  # checks the loaded blocks byte for byte
        g.finish()
    g.close()
    print(
        f"  {len(preempted)} request(s) preempted and resumed, KV exact at every step; all 3 ended,"
        " and another instance loaded each one's 33 blocks exactly"
    )


def engine_events(model_dir: str, meta: str, namespace: str, store_ports: list[str] | None) -> None:
    """7. vLLM's KV events on, two tensor-parallel ranks: vLLM's own
    publisher sends, beside its GPU blocks, a BlockStored for each block
    both ranks wrote to the store, with its parent, tokens and size, the
    hashes as vLLM's events carry them. The connector attaches the same
    hashes and tokens to its puts, so the store's own events carry them
    too."""
    ports = (free_port(), free_port())
    store_sub = Subscriber(*store_ports) if store_ports else None
    h = Engine(model_dir, meta, f"{namespace}-events", tp=2, events=ports)
    sub = Subscriber(f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}")
    prompt = [(i * 41 + 7) % 1000 for i in range(100)]
    r = h.add("r10", prompt, max_tokens=2)
    h.finish()
    stored = (100 + 2 - 1) // BLOCK
    chain = [maybe_convert_block_hash(h_) for h_ in r.block_hashes[:stored]]
    in_store = lambda: {x: e for e in sub.stored if e.medium == "CPU" for x in e.block_hashes}
    sub.follow(lambda: set(chain) <= set(in_store()))
    events, tokens = in_store(), h.tokens["r10"]
    for i, x in enumerate(chain):
        e = events[x]
        assert e.block_hashes == [x], e
        assert e.parent_block_hash == (chain[i - 1] if i else None), (i, e)
        assert e.token_ids == tokens[i * BLOCK : (i + 1) * BLOCK], (i, e)
        assert e.block_size == BLOCK, e
    published = [e for e in sub.stored if e.medium == "CPU"]
    assert len(published) == stored, f"one event a block, not one a rank: {len(published)}"
    gpu = {e.medium for e in sub.stored} - {"CPU"}
    print(
        f"  vLLM's KV events on: its publisher sent {stored} store blocks (parent, tokens, size),"
        f" once for 2 ranks, beside its own {sorted(gpu)} blocks"
    )
    sub.close()
    if store_sub is not None:
        # The store's own events: each rank's copy of each block, named by
        # vLLM's hash, with its tokens and size, after its parent.
        def copies() -> dict:
            by_hash: dict = {}
            for e in store_sub.stored:
                for j, x in enumerate(e.block_hashes):
                    by_hash.setdefault(x, []).append((e.token_ids[j * e.block_size : (j + 1) * e.block_size], e.block_size))
            return by_hash

        store_sub.follow(lambda: all(len(copies().get(x, [])) >= 2 for x in chain))
        by_hash = copies()
        for i, x in enumerate(chain):
            assert len(by_hash[x]) == 2, f"block {i}: one event per rank's copy, got {len(by_hash[x])}"
            assert all(t == tokens[i * BLOCK : (i + 1) * BLOCK] and n == BLOCK for t, n in by_hash[x]), (i, by_hash[x])
            assert store_sub.parents[x] == (chain[i - 1] if i else None), (i, store_sub.parents[x])
        print(f"  the store's own events carry the same {stored} blocks' hashes, parents and tokens, per rank")
        store_sub.close()
    h.close()


class OwnStore:
    """A `mooncake-store up` of this driver's, on fixed ports, to kill and
    start again."""

    def __init__(self, binary: str, dram: str = "256MiB", config: str | None = None):
        self.binary = binary
        self.meta, self.daemon = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        self.args = ["--dram", dram]
        if config is not None:
            toml = Path(tempfile.mkdtemp(prefix="vllm-native-"), "store.toml")
            toml.write_text(config)
            self.args += ["--config", str(toml)]
        self.proc = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "up", "--meta-listen", self.meta, "--listen", self.daemon,
             "--admin", "", *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        # Ready when a put lands: the meta service answers, and its daemon
        # has registered.
        deadline = time.monotonic() + 30
        while True:
            try:
                probe = mooncake_store.Client(self.meta, namespace="probe", timeout=1.0)
                probe.put(b"\0" * 32, b"ready")
                probe.remove([b"\0" * 32])
                return
            except mooncake_store.StoreError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise SystemExit("the driver's own store did not start")
                time.sleep(0.1)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def store_restarted(model_dir: str, binary: str) -> None:
    """6. The store killed mid-run: vLLM goes on, every block a miss and
    every write dropped and counted; the store started again (empty) on the
    same address: the same instance writes again, and another loads."""
    store = OwnStore(binary)
    store.start()
    try:
        f = Engine(model_dir, store.meta, "vllm-restart")
        prompt = lambda seed: [(i * 17 + seed) % 1000 for i in range(96)]
        f.add("r6", prompt(1), max_tokens=2)
        f.finish()
        f.workers[0].connector.get_kv_connector_stats()  # this interval starts now
        store.kill()
        # A prompt this instance never saw: nothing local, nothing remote.
        f.add("r7", prompt(2), max_tokens=2)
        scheduled = f.run(f.schedule())
        assert scheduled["r7"] == 96, scheduled
        f.finish()
        lost = f.workers[0].connector.get_kv_connector_stats().reduce()
        assert lost["blocks_loaded"] == 0 and lost["blocks_saved"] == 0, lost
        assert lost["blocks_not_saved"] == 6, lost
        store.start()
        f.add("r8", prompt(3), max_tokens=2)
        f.finish()
        g = Engine(model_dir, store.meta, "vllm-restart")
        g.add("r9", prompt(3) + [7] * 24, max_tokens=2)
        scheduled = g.run(g.schedule())
        assert scheduled["r9"] == 120 - 96, scheduled
        g.finish()
        for engine in (f, g):
            engine.close()
        print(f"  store killed: {lost['blocks_not_saved']} writes dropped and counted, requests "
              "computed in full; started again: written by the same instance, loaded by another")
    finally:
        if store.proc is not None and store.proc.poll() is None:
            store.kill()


def leases(model_dir: str, binary: str) -> None:
    """7. What the prefix check matched is still in the store at the load,
    however much the store took in between: the connector leases it
    (`match_prefix(lease=True)`, as Mooncake's `batch_is_exist` leases what
    it finds), for the daemon's `kv_lease_ttl`. A 4 MiB store, into which
    another client puts 16 MiB between the check and the load."""
    store = OwnStore(binary, dram="4MiB", config='[daemon]\nkv_lease_ttl = "10m"\n')
    store.start()
    try:
        prompt = [(i * 23 + 5) % 1000 for i in range(200)]
        a = Engine(model_dir, store.meta, "vllm-lease")
        a.add("l1", prompt, max_tokens=2)
        a.finish()
        b = Engine(model_dir, store.meta, "vllm-lease")
        b.add("l2", prompt + [7] * 8, max_tokens=2)
        out = b.schedule()  # the prefix check: 12 blocks matched, leased
        other = mooncake_store.Client(store.meta, namespace="filler")

        def fill() -> None:
            for i in range(64):
                other.put(f"filler-{i}", b"f" * (256 << 10))

        scheduled = b.run(out, before_load=fill)
        assert not b.load_errors, sorted(b.load_errors)
        assert scheduled["l2"] == 208 - 192, scheduled
        b.finish()
        for engine in (a, b):
            engine.close()
        print("  leases: 192 tokens matched by the prefix check loaded exactly after 16 MiB went into a 4 MiB store")
    finally:
        if store.proc is not None and store.proc.poll() is None:
            store.kill()


if __name__ == "__main__":
    main()
