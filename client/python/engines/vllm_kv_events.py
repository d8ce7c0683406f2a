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


def main(meta: str, events: str, replay: str) -> None:
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://{events}")
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    # A DEALER framed as REQ: a replay answers with many batches.
    rep = ctx.socket(zmq.DEALER)
    rep.connect(f"tcp://{replay}")
    held: set = set()
    state = {"last": None, "clears": 0, "types": set()}

    def apply(seq: int, payload: bytes) -> None:
        if state["last"] is not None and seq <= state["last"]:
            return
        state["last"] = seq
        batch = decoder.decode(payload)
        for event in batch.events:
            state["types"].add(type(event).__name__)
            if isinstance(event, AllBlocksCleared):
                state["clears"] += 1
                held.clear()
            elif isinstance(event, BlockStored):
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)

    def ask_replay(start: int) -> None:
        rep.send_multipart([b"", start.to_bytes(8, "big")])
        while rep.poll(timeout=5000):
            _, _topic, seq, payload = rep.recv_multipart()
            if seq == END_SEQ:
                return
            apply(int.from_bytes(seq, "big"), payload)
        raise SystemExit("replay did not end")

    def follow(done, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise SystemExit(f"events never showed it: {len(held)} blocks held")
            if not sub.poll(timeout=100):
                continue
            _topic, seq_bytes, payload = sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if state["last"] is not None and seq > state["last"] + 1:
                ask_replay(state["last"] + 1)
            apply(seq, payload)

    ask_replay(0)
    store = MooncakeDistributedStore()
    assert store.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", meta) == 0
    keys = [f"vllm@model@0@0@{i:064x}" for i in range(16)]
    for k in keys:
        assert store.put(k, bytes(range(256)) * 16) == 0
    hashes = {mooncake_store.opaque_hash(k) for k in keys}
    follow(lambda: hashes <= held)
    print(f"BlockStored seen for all {len(keys)} objects an engine put")
    for k in keys[:4]:
        assert store.remove(k) == 0
    gone = {mooncake_store.opaque_hash(k) for k in keys[:4]}
    follow(lambda: not (gone & held))
    assert held >= hashes - gone
    assert state["clears"] == 1, state
    assert {"AllBlocksCleared", "BlockStored", "BlockRemoved"} <= state["types"], state
    print("BlockRemoved seen for the 4 removed; vLLM's KVEventBatch decoded every batch")
    store.close()
    ctx.destroy(linger=0)


if __name__ == "__main__":
    main(*sys.argv[1:4])
