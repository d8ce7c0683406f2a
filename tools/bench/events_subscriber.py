"""A store-events subscriber for tools/bench/events.sh: reads batches from
the events port as a router would (ZeroMQ SUB, msgpack), and when told to
stop (SIGTERM) prints one JSON line: batches and blocks seen, gaps in the
sequence numbers, and the delay from a batch's oldest change (its `ts`) to
its arrival here, p50/p99/max in milliseconds.

Usage: python events_subscriber.py HOST:PORT
"""

import json
import signal
import sys
import time

import msgspec
import zmq

stop = False


def on_term(*_):
    global stop
    stop = True


def main() -> None:
    signal.signal(signal.SIGTERM, on_term)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 1_000_000)
    sub.connect(f"tcp://{sys.argv[1]}")
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    decoder = msgspec.msgpack.Decoder()
    delays, blocks, gaps, last = [], 0, 0, None
    while not stop:
        if not sub.poll(timeout=100):
            continue
        _topic, seq_bytes, payload = sub.recv_multipart()
        arrived = time.time()
        seq = int.from_bytes(seq_bytes, "big")
        if last is not None and seq != last + 1:
            gaps += 1
        last = seq
        ts, events = decoder.decode(payload)[:2]
        delays.append((arrived - ts) * 1000)
        blocks += sum(len(e.get("block_hashes", ())) for e in events)
    delays.sort()
    pick = lambda q: round(delays[min(len(delays) - 1, int(q * len(delays)))], 3) if delays else None
    print(json.dumps({"batches": len(delays), "blocks": blocks, "gaps": gaps,
                      "delay_ms_p50": pick(0.5), "delay_ms_p99": pick(0.99),
                      "delay_ms_max": pick(1.0)}), flush=True)


if __name__ == "__main__":
    main()
