"""Store events as vLLM's consumers read them: a ZeroMQ SUB socket on the
meta service's events port and a REQ socket on its replay port, each batch
decoded with msgspec into vLLM's `KVEventBatch` schema (vLLM 0.33,
`vllm/distributed/kv_events.py`, declared below from the consumer's side
as vLLM's own subscriber example does), block hashes matched to keys with
`mooncake_store.opaque_hash`."""

from __future__ import annotations

import time
from typing import Any, Optional, Union

import msgspec
import pytest
import zmq

import mooncake_store

from conftest import free_port, single_host_store

ExternalBlockHash = Union[bytes, int]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None
    lookahead_token_ids: Optional[list[list[int]]] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Consumer:
    """A subscriber as vLLM's example writes one: live batches from SUB, a
    gap filled by asking the replay port from the first missing number.
    The replay socket is a DEALER that frames its request as REQ does (an
    empty delimiter first): a REQ socket takes one answer per request,
    and a replay answers with many batches."""

    def __init__(self, events: str, replay: str):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(f"tcp://{events}")
        self.sub.setsockopt_string(zmq.SUBSCRIBE, "")
        self.replay = self.ctx.socket(zmq.DEALER)
        self.replay.connect(f"tcp://{replay}")
        self.last: Optional[int] = None
        self.blocks: set[bytes] = set()
        self.parents: dict = {}
        self.tokens: dict = {}
        self.seqs: list[int] = []
        self.clears = 0
        self.media: set[str] = set()
        self.topics: set[str] = set()

    def apply(self, topic: bytes, seq: int, payload: bytes) -> None:
        if self.last is not None and seq <= self.last:
            return
        self.last = seq
        self.seqs.append(seq)
        self.topics.add(topic.decode())
        for event in DECODER.decode(payload).events:
            if isinstance(event, AllBlocksCleared):
                self.clears += 1
                self.blocks.clear()
            elif isinstance(event, BlockStored):
                self.media.add(event.medium)
                self.blocks.update(event.block_hashes)
                # A BlockStored is one chain: the first block extends the
                # parent named, each next one the block before it.
                parents = [event.parent_block_hash, *event.block_hashes[:-1]]
                self.parents.update(zip(event.block_hashes, parents))
                n = event.block_size
                for i, block in enumerate(event.block_hashes):
                    if n:
                        self.tokens[block] = event.token_ids[i * n : (i + 1) * n]
            else:
                self.media.add(event.medium)
                self.blocks.difference_update(event.block_hashes)

    def ask_replay(self, start: int) -> None:
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        while self.replay.poll(timeout=5000):
            empty, topic, seq, payload = self.replay.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                return
            self.apply(topic, int.from_bytes(seq, "big"), payload)
        raise AssertionError("the replay did not end within 5 s")

    def follow_until(self, done, timeout: float = 20.0) -> bool:
        """Applies live batches until `done(self)`; False after `timeout`."""
        deadline = time.monotonic() + timeout
        while not done(self):
            if time.monotonic() > deadline:
                return False
            if not self.sub.poll(timeout=100):
                continue
            topic, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if self.last is not None and seq > self.last + 1:
                self.ask_replay(self.last + 1)
            self.apply(topic, seq, payload)
        return True

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def test_a_vllm_style_consumer_sees_puts_and_removals_and_catches_up_by_replay():
    events, replay = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    with single_host_store("256MiB", "--events", events, "--events-replay", replay) as meta:
        client = mooncake_store.Client(meta, namespace="t/events")
        consumer = Consumer(events, replay)
        try:
            # Everything so far (the term's AllBlocksCleared first), then live.
            consumer.ask_replay(0)
            assert consumer.clears == 1
            keys = [f"prefix-block-{i}" for i in range(32)]
            assert client.put_batch(keys, [bytes([i]) * 4096 for i in range(32)]) == [0] * 32
            hashes = {mooncake_store.opaque_hash(k) for k in keys}
            assert consumer.follow_until(lambda c: hashes <= c.blocks)
            assert client.remove(keys[:4]) == [True] * 4
            gone = {mooncake_store.opaque_hash(k) for k in keys[:4]}
            assert consumer.follow_until(lambda c: not (gone & c.blocks))
            assert consumer.blocks == hashes - gone
            assert consumer.media == {"CPU"}
            # AllBlocksCleared on the prefix alone; blocks on prefix@host@namespace
            # (the readiness probe's namespace too).
            assert "kv" in consumer.topics
            mine = {t for t in consumer.topics if t.endswith("@t/events")}
            assert len(mine) == 1 and next(iter(mine)).startswith("kv@"), consumer.topics
            assert all(b == a + 1 for a, b in zip(consumer.seqs, consumer.seqs[1:])), "no gap"

            # A consumer that starts late sees a gap at its first live batch
            # and gets what it missed from the replay port.
            # (Its SUB socket joins in the background: puts go on until a
            # live batch reaches it.)
            late = Consumer(events, replay)
            try:
                late.last = 0
                extra = []
                while not late.seqs:
                    assert len(extra) < 100, "no live batch reached the late consumer"
                    extra.append(f"late-{len(extra)}")
                    client.put(extra[-1], b"x" * 100)
                    late.follow_until(lambda c: bool(c.seqs), timeout=0.2)
                expected = (hashes - gone) | {mooncake_store.opaque_hash(k) for k in extra}
                assert late.follow_until(lambda c: c.blocks == expected)
                assert late.clears == 1, "the replay began with the term"
                assert all(b == a + 1 for a, b in zip(late.seqs, late.seqs[1:])), "gap filled"
            finally:
                late.close()
        finally:
            consumer.close()


def test_chains_are_published_with_their_parents_and_as_vllms_integer_hashes_when_asked(tmp_path):
    config = tmp_path / "store.toml"
    config.write_text("[meta]\nevents_int_hashes = true\n")
    events, replay = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    args = ("--events", events, "--events-replay", replay, "--config", str(config))
    with single_host_store("256MiB", *args) as meta:
        client = mooncake_store.Client(meta, namespace="t/chains")
        consumer = Consumer(events, replay)
        try:
            consumer.ask_replay(0)
            # vLLM's integer form of a hash: its last 8 bytes, big endian.
            as_int = lambda k: int.from_bytes(mooncake_store.opaque_hash(k)[24:], "big")
            chain = [f"turn-1-block-{i}" for i in range(6)]
            assert client.put_chain(chain, [bytes([i]) * 1024 for i in range(6)]) == [0] * 6
            more = [f"turn-2-block-{i}" for i in range(3)]
            assert client.put_chain(more, [b"m" * 1024] * 3, parent=chain[-1]) == [0] * 3
            apart = [f"apart-{i}" for i in range(4)]
            assert client.put_batch(apart, [b"a" * 1024] * 4) == [0] * 4
            every = chain + more + apart
            assert consumer.follow_until(lambda c: {as_int(k) for k in every} <= c.blocks)
            linked = chain + more
            for i, key in enumerate(linked):
                want = as_int(linked[i - 1]) if i else None
                assert consumer.parents[as_int(key)] == want, (key, consumer.parents[as_int(key)])
            for key in apart:
                assert consumer.parents[as_int(key)] is None, key
        finally:
            consumer.close()


def test_a_writers_tags_name_blocks_by_the_engines_hashes_with_their_tokens(tmp_path):
    events, replay = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    with single_host_store("256MiB", "--events", events, "--events-replay", replay) as meta:
        client = mooncake_store.Client(meta, namespace="t/tags")
        consumer = Consumer(events, replay)
        try:
            consumer.ask_replay(0)
            # SGLang-style page keys; the engine's own hashes (an int, bytes)
            # and each page's 4 tokens attached.
            keys = [f"page-{i}" for i in range(4)]
            tokens = [list(range(4 * i, 4 * i + 4)) for i in range(4)]
            tags = [(7000 + i, tokens[i]) for i in range(3)] + [(b"engine-page-3", tokens[3])]
            assert client.put_chain(keys, [bytes([i]) * 1024 for i in range(4)], tags=tags) == [0] * 4
            # Tokens only: the event keeps the store's hash.
            assert client.put_batch(["alone"], [b"x" * 1024], tags=[(None, [1, 2])]) == [0]
            # No tag for one key: None.
            assert client.put_batch(["plain", "tagged"], [b"p" * 64] * 2, tags=[None, (9, None)]) == [0, 0]
            names = [7000, 7001, 7002, b"engine-page-3"]
            alone = mooncake_store.opaque_hash("alone")
            every = {*names, alone, mooncake_store.opaque_hash("plain"), 9}
            assert consumer.follow_until(lambda c: every <= c.blocks), consumer.blocks
            assert consumer.parents[7000] is None
            assert [consumer.parents[n] for n in names[1:]] == names[:-1]
            assert [consumer.tokens[n] for n in names] == tokens
            assert consumer.tokens[alone] == [1, 2]
            # Removed, a block leaves under its engine's name.
            assert client.remove(["page-3"]) == [True]
            assert consumer.follow_until(lambda c: b"engine-page-3" not in c.blocks)
            # Bad tags are refused before anything is stored.
            for bad, why in [
                ([(b"x" * 65, None)], "64"),
                ([(-1, None)], "2\\*\\*64"),
                ([(1, [2**32])], "token_ids"),
                ([("a", None), None], "keys and"),
            ]:
                with pytest.raises(ValueError, match=why):
                    client.put_batch(["bad"], [b"b"], tags=bad)
            assert client.exists(["bad"]) == [False]
        finally:
            consumer.close()


def test_the_engines_puts_through_mooncake_store_name_the_parents_their_order_and_lookups_imply():
    import numpy as np
    from mooncake.store import MooncakeDistributedStore

    events, replay = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    with single_host_store("256MiB", "--events", events, "--events-replay", replay) as meta:
        consumer = Consumer(events, replay)
        store = MooncakeDistributedStore()
        try:
            consumer.ask_replay(0)
            assert store.setup("localhost", "", 0, 64 << 20, "tcp", "", meta) == 0
            buf = np.arange(8 * 1024, dtype=np.uint8)
            assert store.register_buffer(buf.ctypes.data, buf.nbytes) == 0
            ptrs = [buf.ctypes.data + i * 1024 for i in range(8)]
            # As LMCache saves a request: its chunks past the stored prefix,
            # in one call, in order.
            request = ["lm-0", "lm-1", "lm-2", "vl-3", "vl-4"]
            assert store.batch_put_from(request[:3], ptrs[:3], [1024] * 3) == [0] * 3
            # As vLLM's connector saves one: which of its keys exist, then
            # the missing ones put.
            assert store.batch_is_exist(request) == [1, 1, 1, 0, 0]
            assert store.batch_put_from_multi_buffers(
                request[3:], [[ptrs[3]], [ptrs[4]]], [[1024], [1024]]
            ) == [0, 0]
            # One key alone implies nothing.
            assert store.put_from("alone", ptrs[5], 1024) == 0
            h = mooncake_store.opaque_hash
            every = {h(k) for k in [*request, "alone"]}
            assert consumer.follow_until(lambda c: every <= c.blocks), consumer.blocks
            assert [consumer.parents[h(k)] for k in request] == [None, *map(h, request[:-1])]
            assert consumer.parents[h("alone")] is None
        finally:
            store.close()
            consumer.close()


def mooncake_batches(sub, until, timeout: float = 20.0) -> list[dict]:
    """Mooncake-format events from `sub` until `until(events)` holds of all
    seen so far; each batch `[timestamp_ms, [maps], dp_rank]` on the empty
    topic, decoded as a plain msgpack value (as Conductor's decoder reads
    it)."""
    seen: list[dict] = []
    deadline = time.monotonic() + timeout
    while not until(seen):
        assert time.monotonic() < deadline, f"no such events within {timeout} s: {seen[-5:]}"
        if not sub.poll(timeout=100):
            continue
        topic, _seq, payload = sub.recv_multipart()
        assert topic == b""
        at_ms, events, dp_rank = msgspec.msgpack.decode(payload)
        assert isinstance(at_ms, int) and dp_rank == 0
        seen.extend(events)
    return seen


def test_mooncakes_format_names_blocks_by_the_keys_vllms_connector_wrote(tmp_path):
    from mooncake.store import MooncakeDistributedStore

    config = tmp_path / "store.toml"
    config.write_text('[meta]\nevents_format = "mooncake"\n')
    events, replay = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    args = ("--events", events, "--events-replay", replay, "--config", str(config))
    with single_host_store("256MiB", *args) as meta:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.connect(f"tcp://{events}")
        sub.setsockopt_string(zmq.SUBSCRIBE, "")
        store = MooncakeDistributedStore()
        try:
            assert store.setup("localhost", "", 0, 64 << 20, "tcp", "", meta) == 0
            # vLLM's Mooncake connector's keys: model, ranks, block hash.
            hashes = [f"{i:02x}" * 32 for i in range(1, 4)]
            keys = [f"Qwen/Qwen3-8B@tp_rank:0@pcp0@dcp0@pp_rank:0@{h}" for h in hashes]
            # SUB joins in the background: put until the first event arrives.
            for attempt in range(100):
                assert store.put(f"warm-up-{attempt}", b"w") == 0
                if sub.poll(timeout=100):
                    break
            else:
                raise AssertionError("no event reached the subscriber")
            values = [bytes([i]) * 4096 for i in range(3)]
            assert store.put_batch(keys, values) == 0
            stored = lambda seen: {e.get("object_key") for e in seen if e["event_type"] == "stored"}
            seen = mooncake_batches(sub, lambda s: set(keys) <= stored(s))
            by_key = {e["object_key"]: e for e in seen if e.get("object_key") in keys}
            for key, h in zip(keys, hashes):
                e = by_key[key]
                assert e["type"] == "BlockStored" and e["medium"] == "cpu"
                assert e["model_name"] == "Qwen/Qwen3-8B"
                assert e["tenant_id"] == "default" and e["backend_id"] == "mooncake-store"
                assert e["connector_block_hash"] == h
                assert e["tp_rank"] == 0 and e["pp_rank"] == 0
                assert e["seq_hashes"] == [int(h[-16:], 16)]
            assert store.remove(keys[0]) == 0
            seen = mooncake_batches(
                sub,
                lambda s: any(e["event_type"] == "removed" and e.get("object_key") == keys[0] for e in s),
            )
        finally:
            store.close()
            ctx.destroy(linger=0)
