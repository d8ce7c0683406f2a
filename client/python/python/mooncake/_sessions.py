"""Mooncake's ranged read sessions, which SGLang's direct linker uses to
load KV pages into GPU memory one layer at a time:
``batch_get_session_start(keys)``, then per layer
``batch_get_into_multi_buffer_ranges(keys, ptrs, sizes, offsets)`` (a
slice of each page object), then ``batch_get_session_end(keys)``.

A slice of a block cannot be checked against the block's checksum, which
covers all of it. So a session reads each block once, whole, into host
memory of its own, where the checksum is checked as for any get; each
ranged read then copies slices from there (into host memory, or into GPU
memory through the client's pinned staging). What a session holds is the
block as it was read: its eviction or removal meanwhile does not reach the
session, as Mooncake's lease keeps a block readable until the session
ends. A key read in ranges outside any session is read whole for that
call. Sessions hold at most ``MOONCAKE_READ_SESSION_BYTES`` (default 8 GiB)
at once; the keys of a start past that answer ``-200``
(NO_AVAILABLE_HANDLE) and hold nothing. A start reads its blocks into one
piece of memory, given back once all of them ended (SGLang ends a batch's
keys together), and the last such piece (up to 1 GiB) is kept for the
next start, whose blocks then land in memory already mapped.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from mooncake_store import INVALID_PARAMS, OBJECT_NOT_FOUND, OK

log = logging.getLogger("mooncake.store")

NO_AVAILABLE_HANDLE = -200
DEFAULT_LIMIT = 8 << 30
# The most memory kept idle between starts.
KEPT_IDLE = 1 << 30


class _Slab:
    """Host memory one start read its blocks into: registered with the
    client while any of them is held."""

    def __init__(self, client, size: int) -> None:
        self.client = client
        self.size = size
        self.mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.mem))
        client.register_buffer(self.addr, size)
        self.live = 0

    def free(self) -> None:
        self.client.unregister_buffer(self.addr)
        self.mem.close()


@dataclass
class _Held:
    """A block held by open sessions: where its bytes are, and how many
    sessions hold it."""

    slab: _Slab
    addr: int
    size: int
    opens: int


class ReadSessions:
    """The blocks open read sessions hold, by key."""

    def __init__(self, client, limit: int | None = None) -> None:
        self._c = client
        self._limit = limit if limit is not None else _limit_from_env()
        self._held: Dict[str, _Held] = {}
        self._bytes = 0
        # The memory of the last start whose sessions all ended, kept for
        # the next one: its pages are mapped already.
        self._idle: _Slab | None = None
        self._lock = threading.Lock()

    def start(self, keys: Sequence[str]) -> List[int]:
        """Opens a session on each key (a key named twice, two): ``0``, or
        why not (``-704`` not stored, ``-200`` past the sessions' memory,
        another negative code for a read that failed)."""
        with self._lock:
            out = [OK] * len(keys)
            first: Dict[str, int] = {}  # a key to read: where it first stands
            again: List[int] = []  # where it stands again
            for i, key in enumerate(keys):
                held = self._held.get(key)
                if held is not None:
                    held.opens += 1
                elif key in first:
                    again.append(i)
                else:
                    first[key] = i
            if not first:
                return out
            reads: List[Tuple[int, int]] = []  # (index in keys, size)
            budget = self._limit - self._bytes
            for i, size in zip(first.values(), self._c.sizes(list(first))):
                if size is None:
                    out[i] = OBJECT_NOT_FOUND
                elif size > budget:
                    out[i] = NO_AVAILABLE_HANDLE
                else:
                    reads.append((i, size))
                    budget -= size
            if NO_AVAILABLE_HANDLE in out:
                log.warning(
                    "read sessions hold %d bytes, at most %d (MOONCAKE_READ_SESSION_BYTES): "
                    "keys refused", self._bytes, self._limit,
                )
            if reads:
                self._read(keys, reads, out)
            for i in again:
                out[i] = out[first[keys[i]]]
                if out[i] == OK:
                    self._held[keys[i]].opens += 1
            return out

    def _read(self, keys: Sequence[str], reads: List[Tuple[int, int]], out: List[int]) -> None:
        total = sum(size for _, size in reads)
        try:
            slab = self._slab(max(total, 1))
        except (OSError, ValueError) as err:
            log.warning("read sessions: no memory for %d bytes of blocks: %s", total, err)
            for i, _ in reads:
                out[i] = NO_AVAILABLE_HANDLE
            return
        addrs, at = [], 0
        for _, size in reads:
            addrs.append(slab.addr + at)
            at += size
        got = self._c.get_into_ptrs([keys[i] for i, _ in reads], addrs, [s for _, s in reads])
        for (i, size), addr, n in zip(reads, addrs, got):
            if n == size:
                self._held[keys[i]] = _Held(slab, addr, size, 1)
                slab.live += 1
            else:
                # A block that changed size since it was looked up, or a
                # read that failed: not held.
                out[i] = n if n < 0 else OBJECT_NOT_FOUND
        if slab.live:
            self._bytes += slab.size
        else:
            self._give_back(slab)

    def _slab(self, size: int) -> _Slab:
        """Memory for a start's blocks: the idle slab if it fits (its pages
        already mapped), else a new one."""
        idle, self._idle = self._idle, None
        if idle is not None and idle.size >= size:
            return idle
        if idle is not None:
            idle.free()
        return _Slab(self._c, size)

    def _give_back(self, slab: _Slab) -> None:
        """Keeps the larger of `slab` and the idle one for the next start
        (up to KEPT_IDLE bytes), and frees the other."""
        if slab.size > KEPT_IDLE or (self._idle is not None and self._idle.size >= slab.size):
            slab.free()
            return
        if self._idle is not None:
            self._idle.free()
        self._idle = slab

    def end(self, keys: Sequence[str]) -> int:
        """Closes a session on each key; keys without one are passed over."""
        with self._lock:
            for key in keys:
                held = self._held.get(key)
                if held is None:
                    continue
                held.opens -= 1
                if held.opens == 0:
                    del self._held[key]
                    held.slab.live -= 1
                    if held.slab.live == 0:
                        self._bytes -= held.slab.size
                        self._give_back(held.slab)
        return OK

    def ranges(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        offsets: Sequence[Sequence[int]],
    ) -> List[int]:
        """Copies slices of each key's block (``sizes[i][j]`` bytes at
        ``offsets[i][j]``) into ``ptrs[i][j]``: per key the bytes copied,
        or a negative code (``-600`` for a slice past the block's end or a
        destination outside every registered buffer; ``-704`` for a key
        not stored)."""
        n = len(keys)
        if not (len(ptrs) == len(sizes) == len(offsets) == n) or any(
            not len(p) == len(s) == len(o) for p, s, o in zip(ptrs, sizes, offsets)
        ):
            log.error("batch_get_into_multi_buffer_ranges: lists of different lengths")
            return [INVALID_PARAMS] * n
        outside = [k for k in dict.fromkeys(keys) if k not in self._held]
        opened = self.start(outside) if outside else []
        try:
            return self._copy(keys, ptrs, sizes, offsets, dict(zip(outside, opened)))
        finally:
            self.end([k for k, code in zip(outside, opened) if code == OK])

    def _copy(self, keys, ptrs, sizes, offsets, refused: Dict[str, int]) -> List[int]:
        out = [OK] * len(keys)
        srcs, lens, dsts, owner = [], [], [], []
        with self._lock:
            for i, key in enumerate(keys):
                held = self._held.get(key)
                if held is None:
                    out[i] = refused.get(key) or OBJECT_NOT_FOUND
                    continue
                if any(o < 0 or s < 0 or o + s > held.size for o, s in zip(offsets[i], sizes[i])):
                    out[i] = INVALID_PARAMS
                    continue
                for p, s, o in zip(ptrs[i], sizes[i], offsets[i]):
                    srcs.append(held.addr + o)
                    lens.append(s)
                    dsts.append(p)
                    owner.append(i)
            # Copied while the lock keeps the slabs mapped.
            copied = self._c.copy_into_ptr_lists(srcs, lens, [[d] for d in dsts], [[s] for s in lens])
        for i, n in zip(owner, copied):
            if out[i] >= 0:
                out[i] = out[i] + n if n >= 0 else n
        return out

    def close(self) -> None:
        with self._lock:
            for slab in {id(h.slab): h.slab for h in self._held.values()}.values():
                slab.free()
            if self._idle is not None:
                self._idle.free()
                self._idle = None
            self._held.clear()
            self._bytes = 0


def _limit_from_env() -> int:
    raw = os.environ.get("MOONCAKE_READ_SESSION_BYTES")
    if not raw:
        return DEFAULT_LIMIT
    try:
        return max(0, int(raw))
    except ValueError:
        log.warning("MOONCAKE_READ_SESSION_BYTES=%r is not a number of bytes; using %d", raw, DEFAULT_LIMIT)
        return DEFAULT_LIMIT
