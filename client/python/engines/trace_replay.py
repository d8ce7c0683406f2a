"""What the trace replays through the engines' own classes share
(`sglang_replay.py`, `lmcache_replay.py`): their arguments, the trace, and
the token hit rate counted as `mooncake-store replay` counts it (a request
hits its leading stored blocks, at 512 tokens a block), so that each can be
set beside `replay`'s."""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

BLOCK_TOKENS = 512


def arguments(doc: str, dim: int, dim_help: str) -> argparse.ArgumentParser:
    """The arguments every replay takes; a script adds its own."""
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("meta")
    p.add_argument("trace")
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--dim", type=int, default=dim, help=dim_help)
    return p


def load(path: str, limit: int) -> list[dict]:
    """The trace's requests (the first `limit`, if not 0)."""
    requests = [json.loads(line) for line in open(path) if line.strip()]
    return requests[:limit] if limit else requests


def replay(requests: list[dict], one: Callable[[dict], int], failed: Callable[[], int]) -> None:
    """Runs `one` on each request (it returns how many leading blocks were
    read back), prints progress and a JSON summary; exits non-zero if a
    put failed (`failed`: how many so far) or nothing hit."""
    hit_tokens = tokens = 0
    began = time.perf_counter()
    for n, req in enumerate(requests):
        usable = one(req)
        tokens += req["input_length"]
        hit_tokens += min(usable * BLOCK_TOKENS, req["input_length"])
        if (n + 1) % 2000 == 0:
            print(f"  {n + 1} requests, token hit rate {hit_tokens / tokens:.2%}", flush=True)
    seconds = time.perf_counter() - began
    print(json.dumps({"requests": len(requests), "token_hit_rate": hit_tokens / max(tokens, 1),
                      "failed_puts": failed(), "seconds": round(seconds, 1)}))
    if failed() or not hit_tokens:
        raise SystemExit(f"{failed()} puts failed, {hit_tokens} tokens hit")
