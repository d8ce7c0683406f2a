"""vLLM's own KV-event classes read this store's events: a consumer built
the way vLLM's `examples/online_serving/kv_events_subscriber.py` builds one
(ZeroMQ SUB on the events port, the replay port asked from the first
missing number), decoding with `vllm.distributed.kv_events.KVEventBatch`
from the installed vLLM, while an engine's Mooncake backend
(`mooncake.store.MooncakeDistributedStore`) puts and removes objects. Every
key's hash (`mooncake_store.opaque_hash`) shows up in a `BlockStored` and,
once removed, in a `BlockRemoved`. Run by `tools/test-engines.sh`.

Usage: python vllm_kv_events.py META_ADDR EVENTS_ADDR REPLAY_ADDR
"""

from __future__ import annotations

import sys
import time

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

import mooncake_store
from mooncake.store import MooncakeDistributedStore

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Subscriber:
    """The store's events as a consumer of vLLM's sees them: `held` is the
    set of block hashes stored and not removed, from the first batch the
    replay port keeps, following the live stream (a gap in the numbers is
    filled from the replay port)."""

    def __init__(self, events: str, replay: str):
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(f"tcp://{events}")
        self.sub.setsockopt_string(zmq.SUBSCRIBE, "")
        # A DEALER framed as REQ: a replay answers with many batches.
        self.rep = self.ctx.socket(zmq.DEALER)
        self.rep.connect(f"tcp://{replay}")
        self.held: set = set()
        self.parents: dict = {}
        # Every BlockStored applied, in order.
        self.stored: list = []
        self.last = None
        self.clears = 0
        self.types: set = set()
        self.ask_replay(0)

    def apply(self, seq: int, payload: bytes) -> None:
        if self.last is not None and seq <= self.last:
            return
        self.last = seq
        batch = self.decoder.decode(payload)
        for event in batch.events:
            self.types.add(type(event).__name__)
            if isinstance(event, AllBlocksCleared):
                self.clears += 1
                self.held.clear()
            elif isinstance(event, BlockStored):
                self.stored.append(event)
                self.held.update(event.block_hashes)
                # The first block names its parent; each next one extends
                # the one before, as vLLM reads a BlockStored.
                parents = [event.parent_block_hash, *event.block_hashes[:-1]]
                self.parents.update(zip(event.block_hashes, parents))
            elif isinstance(event, BlockRemoved):
                self.held.difference_update(event.block_hashes)

    def ask_replay(self, start: int) -> None:
        self.rep.send_multipart([b"", start.to_bytes(8, "big")])
        while self.rep.poll(timeout=5000):
            _, _topic, seq, payload = self.rep.recv_multipart()
            if seq == END_SEQ:
                return
            self.apply(int.from_bytes(seq, "big"), payload)
        raise SystemExit("replay did not end")

    def follow(self, done, timeout: float = 20.0) -> None:
        """Reads events until `done()` holds; fails after `timeout` s."""
        deadline = time.monotonic() + timeout
        quiet = 0
        while not done():
            if time.monotonic() > deadline:
                raise SystemExit(f"events never showed it: {len(self.held)} blocks held")
            if not self.sub.poll(timeout=100):
                # A batch sent before the subscription took hold is never
                # received: after a quiet second, ask the replay port.
                quiet += 1
                if quiet % 10 == 0:
                    self.ask_replay(0 if self.last is None else self.last + 1)
                continue
            quiet = 0
            _topic, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if self.last is not None and seq > self.last + 1:
                self.ask_replay(self.last + 1)
            self.apply(seq, payload)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def main(meta: str, events: str, replay: str) -> None:
    sub = Subscriber(events, replay)
    store = MooncakeDistributedStore()
    assert store.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", meta) == 0
    keys = [f"vllm@model@0@0@{i:064x}" for i in range(16)]
    for k in keys:
        assert store.put(k, bytes(range(256)) * 16) == 0
    # The store runs with events_int_hashes (tools/test-engines.sh): a
    # hash is its last 8 bytes as an integer, as vLLM publishes its own.
    as_int = lambda k: int.from_bytes(mooncake_store.opaque_hash(k)[24:], "big")
    hashes = {as_int(k) for k in keys}
    sub.follow(lambda: hashes <= sub.held)
    print(f"BlockStored seen for all {len(keys)} objects an engine put")
    for k in keys[:4]:
        assert store.remove(k) == 0
    gone = {as_int(k) for k in keys[:4]}
    sub.follow(lambda: not (gone & sub.held))
    assert sub.held >= hashes - gone
    assert sub.clears == 1, sub.clears
    assert {"AllBlocksCleared", "BlockStored", "BlockRemoved"} <= sub.types, sub.types
    print("BlockRemoved seen for the 4 removed; vLLM's KVEventBatch decoded every batch")
    store.close()
    sub.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
