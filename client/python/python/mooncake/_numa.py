"""``bind_to_numa_node``, Mooncake's module function: LMCache calls it on
GPU hosts before ``setup``, so that the thread that copies KV blocks runs
next to the GPU's memory.

As Mooncake's (``numa_run_on_node`` and ``numa_set_preferred`` of
libnuma), it runs the calling thread on the node's CPUs and makes that
node the preferred one for the thread's future allocations, falling back
to others when it is full; where the machine has no such node it logs a
warning and changes nothing. Read from ``/sys`` and done with
``sched_setaffinity`` and the ``set_mempolicy`` system call, so it needs
no libnuma.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from typing import List, Optional, Set

log = logging.getLogger("mooncake.store")

NODES = "/sys/devices/system/node"
# `set_mempolicy` and `get_mempolicy` by architecture (Linux's tables).
SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}
GET_MEMPOLICY = {"x86_64": 239, "aarch64": 236}
MPOL_PREFERRED = 1
WORD_BITS = 8 * ctypes.sizeof(ctypes.c_ulong)


def bind_to_numa_node(node: int) -> None:
    """Runs the calling thread on NUMA node ``node`` and prefers that node's
    memory for its allocations; a warning, and nothing changed, where
    the machine has no such node."""
    node = int(node)
    cpus = node_cpus(node)
    if cpus is None:
        log.warning("bind_to_numa_node: no NUMA node %d on this machine; binding skipped", node)
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as err:
        log.warning("bind_to_numa_node: running on node %d's CPUs: %s", node, err)
    err = _set_preferred(node)
    if err is not None:
        log.warning("bind_to_numa_node: preferring node %d's memory: %s", node, err)


def node_cpus(node: int) -> Optional[Set[int]]:
    """The CPUs of NUMA node ``node``, or ``None`` if there is no such node
    (or it has no CPU)."""
    if node < 0:
        return None
    try:
        with open(f"{NODES}/node{node}/cpulist") as f:
            cpus = parse_cpu_list(f.read())
    except (OSError, ValueError):
        return None
    return cpus or None


def parse_cpu_list(text: str) -> Set[int]:
    """A CPU list as the kernel writes it (``0-3,8,10-11``); raises
    ``ValueError`` for anything else."""
    cpus: Set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        lo, hi = int(first), int(last or first)
        if lo < 0 or hi < lo:
            raise ValueError(f"not a CPU list: {text!r}")
        cpus.update(range(lo, hi + 1))
    return cpus


def preferred_node() -> Optional[int]:
    """The node the calling thread's memory policy prefers, or ``None``
    where it prefers none (or the policy cannot be read here)."""
    nr = GET_MEMPOLICY.get(platform.machine())
    if nr is None:
        return None
    mode = ctypes.c_int(0)
    mask = (ctypes.c_ulong * 16)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(nr, ctypes.byref(mode), mask, ctypes.c_ulong(len(mask) * WORD_BITS), None, 0) != 0:
        return None
    if mode.value != MPOL_PREFERRED:
        return None
    nodes = _bits(mask)
    return nodes[0] if nodes else None


def _set_preferred(node: int) -> Optional[str]:
    nr = SET_MEMPOLICY.get(platform.machine())
    if nr is None:
        return f"no set_mempolicy number known for {platform.machine()}"
    mask = (ctypes.c_ulong * (node // WORD_BITS + 1))()
    mask[node // WORD_BITS] = 1 << (node % WORD_BITS)
    libc = ctypes.CDLL(None, use_errno=True)
    # The kernel reads maxnode - 1 bits of the mask (libnuma passes one more).
    if libc.syscall(nr, MPOL_PREFERRED, mask, ctypes.c_ulong(len(mask) * WORD_BITS + 1)) != 0:
        return os.strerror(ctypes.get_errno())
    return None


def _bits(mask: "ctypes.Array[ctypes.c_ulong]") -> List[int]:
    return [
        word * WORD_BITS + bit
        for word, value in enumerate(mask)
        for bit in range(WORD_BITS)
        if value >> bit & 1
    ]
