"""``MooncakeDistributedStore`` on top of Mooncake Store (Rust).

A drop-in for the class of the same name in Mooncake's ``mooncake.store``,
which vLLM's MooncakeStoreConnector, SGLang HiCache's ``mooncake`` backend
and LMCache's ``mooncakestore`` connector call. Same methods, same return
conventions: ``0`` or a byte count on success, the same negative codes
where a meaning matches (``-704`` OBJECT_NOT_FOUND, ``-600``
INVALID_PARAMS, ``-200`` NO_AVAILABLE_HANDLE, ``-900`` RPC_FAIL, ...).
Nothing here raises for a store failure.

How the two models map (see ``client/python/README.md``):

- ``master_server_addr`` is our meta service (``host:port``). A
  ``metadata_server`` of the form ``etcd://host:port[,host:port]`` follows
  whichever meta replica leads through etcd; any other value (an HTTP
  metadata URL, ``P2PHANDSHAKE``) is accepted and not needed.
- ``global_segment_size``: Mooncake clients contribute a memory segment to
  the cluster. Ours are separate from the storage daemons, so a non-zero
  size starts a storage daemon of that size inside this process, on
  ``local_hostname``, registered with the meta service. Pass 0 to only use
  the cluster's daemons (vLLM's ``standalone-store`` mode).
- ``local_buffer_size`` is not needed (blocks land straight in the caller's
  buffers) and is ignored. ``protocol="rdma"`` moves blocks over RDMA (on
  the first of ``rdma_devices``) to daemons that serve it, with a package
  built with the ``rdma`` feature; otherwise, and on hosts without an RDMA
  NIC, over TCP.
- ``ReplicateConfig``: ``replica_num`` copies per block, each on a distinct
  host (at most 4; more is stored as 4, with a log line); without a config
  a put gets the meta service's default for the namespace. ``with_hard_pin``
  pins every copy against eviction; the other fields Mooncake has are
  accepted and have no effect here (``client/python/README.md`` says which
  and why). Setting a field Mooncake does not have raises
  ``AttributeError``, as there.
- ``register_buffer`` is enforced: ``get_into`` / ``put_from`` on memory
  outside a registered buffer answer ``-600`` and touch nothing (Mooncake's
  behaviour there is undefined). GPU memory can be registered where the
  CUDA driver is present (blocks then move through pinned staging,
  ``docs/gpu.md``); elsewhere a GPU pointer is refused with ``-600`` and a
  log line.
- Ranged reads (``batch_get_session_start``,
  ``batch_get_into_multi_buffer_ranges``, ``batch_get_session_end``, which
  SGLang's direct linker calls) read each object once, whole, and checked,
  into the client's memory, and copy slices from there
  (``mooncake/_sessions.py``).
- ``bind_to_numa_node(node)``, which LMCache calls before ``setup`` on GPU
  hosts, runs the calling thread on the node's CPUs and prefers its memory,
  as Mooncake's does (``mooncake/_numa.py``).
- Keys are opaque and name no parent. So that daemons can evict a request's
  blocks from the tail and apply 2Q's branch rule, a put names for each key
  the key before it in an earlier ``batch_is_exist`` of this store (vLLM,
  SGLang), or else, in ``batch_put_from`` and
  ``batch_put_from_multi_buffers``, the key before it in the same call
  (LMCache's chunks past a request's stored prefix); see
  ``client/src/lineage.rs``.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import mmap
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import mooncake_store
from mooncake_store import OBJECT_NOT_FOUND, INVALID_PARAMS, OK, RPC_FAIL

from mooncake._numa import bind_to_numa_node
from mooncake._sessions import ReadSessions

__all__ = [
    "BufferHandle",
    "MooncakeDistributedStore",
    "MooncakeHostMemAllocator",
    "ObjectDataType",
    "ReplicaDescriptor",
    "ReplicateConfig",
    "SoftPinAction",
    "bind_to_numa_node",
]

log = logging.getLogger("mooncake.store")


class SoftPinAction(enum.IntEnum):
    """What a put does to a key's soft pin (Mooncake's names)."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ObjectDataType(enum.IntEnum):
    """What an object holds (Mooncake's names and values), as a put's
    ``ReplicateConfig.data_type`` says; vLLM's encoder-cache connector puts
    ``TENSOR``. Accepted, and no effect here: every block is evicted by the
    daemon's one order."""

    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


@dataclass(slots=True)
class ReplicateConfig:
    """Mooncake's per-put options. ``replica_num`` (copies on distinct
    hosts) and ``with_hard_pin`` (pinned against eviction) have an effect
    here; see the module docs."""

    replica_num: int = 1
    with_soft_pin: bool = False
    with_hard_pin: bool = False
    soft_pin_action: SoftPinAction = SoftPinAction.PRESERVE
    soft_pin_ttl_ms: int = 0
    preferred_segment: str = ""
    preferred_segments: List[str] = field(default_factory=list)
    prefer_alloc_in_same_node: bool = False
    group_ids: List[str] = field(default_factory=list)
    data_type: ObjectDataType = ObjectDataType.UNKNOWN


MAX_REPLICAS = 4
# How long setup waits for a same-host daemon's pool to be mapped.
SAME_HOST_READY_S = 30.0


def _replicas(config: Optional[ReplicateConfig]) -> int:
    """Copies a put asks for: 0 (the namespace's default) without a
    config, else ``replica_num`` within 1 to ``MAX_REPLICAS``."""
    if config is None:
        return 0
    n = int(config.replica_num)
    if n > MAX_REPLICAS:
        log.warning("replica_num = %d: storing %d copies, the most a block has", n, MAX_REPLICAS)
    return min(max(n, 1), MAX_REPLICAS)


@dataclass(frozen=True)
class BufferDescriptor:
    """Where a replica's bytes are: its size and the daemon holding it."""

    size: int
    transport_endpoint: str


@dataclass(frozen=True)
class MemoryDescriptor:
    buffer_descriptor: BufferDescriptor


@dataclass(frozen=True)
class DiskDescriptor:
    """A copy on a daemon's NVMe drives: the daemon that serves it (in
    ``file_path``, where Mooncake names its file) and its size."""

    file_path: str
    object_size: int


@dataclass(frozen=True)
class ReplicaDescriptor:
    """One copy of a stored object, as ``batch_get_replica_desc`` lists it:
    a memory replica while its daemon holds it in DRAM, a disk replica once
    it was demoted to that daemon's NVMe drives only. Both are read the same
    way, through the daemon."""

    memory: Optional[MemoryDescriptor] = None
    disk: Optional[DiskDescriptor] = None
    status: str = "COMPLETE"

    def is_memory_replica(self) -> bool:
        return self.memory is not None

    def is_disk_replica(self) -> bool:
        return self.disk is not None

    def is_local_disk_replica(self) -> bool:
        return False

    def get_memory_descriptor(self) -> MemoryDescriptor:
        if self.memory is None:
            raise RuntimeError("not a memory replica")
        return self.memory

    def get_disk_descriptor(self) -> DiskDescriptor:
        if self.disk is None:
            raise RuntimeError("not a disk replica")
        return self.disk


def _replica(size: int, addr: str, tier: str) -> ReplicaDescriptor:
    if tier == "nvme":
        return ReplicaDescriptor(disk=DiskDescriptor(addr, size))
    return ReplicaDescriptor(memory=MemoryDescriptor(BufferDescriptor(size, addr)))


class BufferHandle(bytearray):
    """An object's bytes, as ``get_buffer`` returns them: a writable buffer
    (``memoryview``, ``numpy.frombuffer``, ``torch.frombuffer`` work on it)
    with Mooncake's ``size()`` and ``ptr()``."""

    def size(self) -> int:
        return len(self)

    def ptr(self) -> int:
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self)) if self else 0


class MooncakeHostMemAllocator:
    """Host memory for a serving engine's KV pool (SGLang's standalone
    mode): page-aligned, zeroed, and kept until ``free`` or this allocator
    is collected. Register it with ``register_buffer`` before use."""

    def __init__(self) -> None:
        self._maps: Dict[int, mmap.mmap] = {}

    def alloc(self, size: int) -> int:
        if size <= 0:
            raise ValueError(f"cannot allocate {size} bytes")
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(region))
        self._maps[ptr] = region
        return ptr

    def free(self, ptr: int) -> int:
        region = self._maps.pop(ptr, None)
        if region is None:
            return INVALID_PARAMS
        # Views made with from_buffer keep the map open until they go.
        try:
            region.close()
        except BufferError:
            self._maps[ptr] = region
            return INVALID_PARAMS
        return OK


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _byte_size(value: Any) -> int:
    """A size as Mooncake's configs write it: an int, or a string such as
    ``"4GB"``, ``"512 MiB"`` or ``"1073741824"`` (binary units). Raises
    ``ValueError`` for anything else (``"50%"``, a negative size)."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, float) and value.is_integer():
        size = int(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*", value.lower())
        if m is None or (m.group(3) is not None and m.group(2) == "" and m.group(3) == "ib"):
            raise ValueError(f"not a size: {value!r}")
        size = int(float(m.group(1)) * _UNITS[m.group(2)])
    else:
        raise ValueError(f"not a size: {value!r}")
    if size < 0:
        raise ValueError(f"not a size: {value!r}")
    return size


def _worst(codes: List[int]) -> int:
    return next((c for c in codes if c < 0), OK)


class MooncakeDistributedStore:
    """A client of the store, set up with ``setup()`` before use."""

    def __init__(self) -> None:
        self._client: Optional[mooncake_store.Client] = None
        self._daemon: Optional[mooncake_store.DaemonProcess] = None
        self._hostname = ""
        self._read_sessions: Optional[ReadSessions] = None

    # -- set-up ---------------------------------------------------------

    def setup(
        self,
        local_hostname: Any,
        metadata_server: str = "",
        global_segment_size: Any = 16 * 1024 * 1024,
        local_buffer_size: Any = 1024 * 1024 * 1024,
        protocol: str = "tcp",
        rdma_devices: str = "",
        master_server_addr: str = "127.0.0.1:7070",
        transfer_engine: Any = None,
        *,
        enable_client_http_server: bool = False,
        client_http_port: int = 0,
        enable_ssd_offload: bool = False,
        ssd_offload_path: Optional[str] = None,
        tenant_id: Optional[str] = None,
    ) -> int:
        """Connects to the store; 0 on success, a negative code otherwise.

        Takes Mooncake's positional arguments (the eighth, a transfer
        engine, is not needed here and is ignored) and the keywords SGLang
        passes, or a single dict with the same names (``master_server_address``
        and ``device_name`` are accepted as aliases). Sizes may be strings
        such as ``"4GB"``. ``tenant_id`` is the namespace keys live in.
        Returns once an embedded daemon (``global_segment_size`` > 0) is
        registered, so that the first put can be placed on it.
        """
        if isinstance(local_hostname, dict):
            cfg = dict(local_hostname)
            local_hostname = cfg.get("local_hostname", "localhost")
            metadata_server = cfg.get("metadata_server", "")
            global_segment_size = cfg.get("global_segment_size", global_segment_size)
            local_buffer_size = cfg.get("local_buffer_size", local_buffer_size)
            protocol = cfg.get("protocol", protocol)
            rdma_devices = cfg.get("rdma_devices", cfg.get("device_name", rdma_devices))
            master_server_addr = cfg.get(
                "master_server_addr", cfg.get("master_server_address", master_server_addr)
            )
            tenant_id = cfg.get("tenant_id", tenant_id)
            enable_ssd_offload = cfg.get("enable_ssd_offload", enable_ssd_offload)
        try:
            segment = _byte_size(global_segment_size)
            _byte_size(local_buffer_size)
        except ValueError as err:
            log.error("setup: %s", err)
            return INVALID_PARAMS
        if enable_ssd_offload:
            log.warning(
                "setup: enable_ssd_offload has no effect here; SSD offload is a "
                "daemon's NVMe tier (mooncake-store daemon --nvme PATH)"
            )
        if enable_client_http_server:
            log.info(
                "setup: no client HTTP server is started; metrics are on the daemons' "
                "and the meta service's /metrics"
            )
        del transfer_engine, client_http_port, ssd_offload_path
        return self._connect(local_hostname, metadata_server, segment, protocol,
                             rdma_devices, master_server_addr, tenant_id)

    def setup_dummy(self, mem_pool_size: Any, local_buffer_size: Any, server_address: str) -> int:
        """SGLang's standalone-storage mode: this process holds no store
        memory of its own and reaches the store at ``server_address`` (the
        meta service, ``host:port``). Its KV pool is registered with
        ``register_buffer`` as usual."""
        try:
            _byte_size(mem_pool_size)
            _byte_size(local_buffer_size)
        except ValueError as err:
            log.error("setup_dummy: %s", err)
            return INVALID_PARAMS
        return self._connect("localhost", "", 0, "tcp", "", server_address, None)

    def _connect(
        self,
        local_hostname: Any,
        metadata_server: str,
        global_segment_size: int,
        protocol: str,
        rdma_devices: str,
        master_server_addr: str,
        tenant_id: Optional[str],
    ) -> int:
        if self._client is not None:
            return OK
        etcd = None
        if metadata_server.startswith("etcd://"):
            etcd = [e for e in metadata_server[len("etcd://") :].split(",") if e]
        host = str(local_hostname).rsplit(":", 1)[0] if ":" in str(local_hostname) else str(local_hostname)
        if host in ("localhost", ""):
            host = "127.0.0.1"
        namespace = tenant_id or os.environ.get("MOONCAKE_NAMESPACE", "default")
        try:
            # The token, if the store requires one, comes from $MOONCAKE_TOKEN.
            device = next((d for d in str(rdma_devices).split(",") if d), None)
            client = mooncake_store.Client(
                master_server_addr,
                etcd=etcd,
                namespace=namespace,
                rdma=protocol == "rdma",
                rdma_device=device,
            )
        except (mooncake_store.StoreError, OSError) as err:
            log.error("setup: %s", err)
            return RPC_FAIL
        except ValueError as err:
            log.error("setup: %s", err)
            return INVALID_PARAMS
        # With a same-host daemon ($MOONCAKE_SHM_SOCKET), its pool is
        # mapped into this process now, not under the first puts and gets
        # (mapping a large pool takes seconds, on the core they run on).
        if os.environ.get("MOONCAKE_SHM_SOCKET") and not client.same_host_ready(SAME_HOST_READY_S):
            log.warning(
                "setup: the same-host daemon's pool (MOONCAKE_SHM_SOCKET) was not mapped within %.0f s;"
                " going on", SAME_HOST_READY_S,
            )
        if global_segment_size > 0:
            try:
                self._daemon = mooncake_store.DaemonProcess(
                    master_server_addr, global_segment_size, host
                )
            except RuntimeError as err:
                log.error("setup: %s", err)
                return RPC_FAIL
        self._client = client
        self._hostname = self._daemon.addr if self._daemon else str(local_hostname)
        return OK

    def close(self) -> int:
        if self._read_sessions is not None:
            self._read_sessions.close()
            self._read_sessions = None
        if self._daemon is not None:
            self._daemon.stop()
            self._daemon = None
        self._client = None
        return OK

    def get_hostname(self) -> str:
        return self._hostname

    @property
    def _c(self) -> mooncake_store.Client:
        if self._client is None:
            raise RuntimeError("MooncakeDistributedStore: call setup() first")
        return self._client

    # -- bytes in, bytes out --------------------------------------------

    def put(self, key: str, value: Any, config: Optional[ReplicateConfig] = None) -> int:
        return self.put_batch([key], [value], config)

    def put_parts(self, key: str, *parts: Any, config: Optional[ReplicateConfig] = None) -> int:
        return self.put(key, b"".join(bytes(p) for p in parts), config)

    def put_batch(
        self, keys: List[str], values: List[Any], config: Optional[ReplicateConfig] = None
    ) -> int:
        if len(keys) != len(values):
            return INVALID_PARAMS
        try:
            codes = self._c.put_batch(keys, values, replicas=_replicas(config))
        except (TypeError, ValueError, BufferError):
            return INVALID_PARAMS
        self._pin_if_asked(keys, codes, config)
        return _worst(codes)

    def get(self, key: str) -> bytes:
        """The value, or empty bytes if the key is not stored."""
        try:
            return self._c.get(key) or b""
        except (mooncake_store.StoreError, TypeError, ValueError):
            return b""

    def get_batch(self, keys: List[str]) -> List[bytes]:
        return [self.get(k) for k in keys]

    def get_buffer(self, key: str) -> Optional[BufferHandle]:
        """The value in a writable buffer, or ``None`` if not stored."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: List[str]) -> List[Optional[BufferHandle]]:
        """Each value in a writable buffer, ``None`` for a key not stored
        (or whose read failed: logged)."""
        try:
            sizes = self._c.sizes(keys)
        except (mooncake_store.StoreError, TypeError, ValueError) as err:
            log.error("batch_get_buffer: %s", err)
            return [None] * len(keys)
        wanted = [i for i, n in enumerate(sizes) if n is not None]
        buffers = [BufferHandle(sizes[i]) for i in wanted]
        out: List[Optional[BufferHandle]] = [None] * len(keys)
        if not wanted:
            return out
        try:
            read = self._c.get_into_batch([keys[i] for i in wanted], buffers)
        except (mooncake_store.StoreError, TypeError, ValueError) as err:
            log.error("batch_get_buffer: %s", err)
            return out
        for i, buf, n in zip(wanted, buffers, read):
            if n >= 0:
                del buf[n:]
                out[i] = buf
            elif n != OBJECT_NOT_FOUND:
                log.warning("batch_get_buffer: %s answered %d", keys[i], n)
        return out

    # -- existence, size, removal ---------------------------------------

    def is_exist(self, key: str) -> int:
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: List[str]) -> List[int]:
        """1 for each key stored, 0 for one not, -1 if the store could not
        be asked. As in Mooncake, each key found is leased: the daemons
        holding it keep it from eviction for their ``kv_lease_ttl``
        (default 5 s; Mooncake's ``default_kv_lease_ttl``), so that the
        load an engine plans on it finds it. A key evicted after the index
        answered is reported 0 (vLLM's selective lease looks for that)."""
        return self._exists(keys, lease=True)

    def batch_probe_key(self, keys: List[str]) -> List[int]:
        """``batch_is_exist`` without a lease, as Mooncake's newer releases
        have it (vLLM 0.34 probes with it when
        ``VLLM_MOONCAKE_STORE_SELECTIVE_LEASE`` is set, then leases only
        what it will load, with ``batch_is_exist``)."""
        return self._exists(keys, lease=False)

    def _exists(self, keys: List[str], lease: bool) -> List[int]:
        try:
            return [1 if e else 0 for e in self._c.exists(keys, lease=lease)]
        except (mooncake_store.StoreError, TypeError, ValueError):
            return [-1] * len(keys)

    def get_size(self, key: str) -> int:
        try:
            size = self._c.sizes([key])[0]
        except mooncake_store.StoreError:
            return RPC_FAIL
        return OBJECT_NOT_FOUND if size is None else size

    def remove(self, key: str, force: bool = False) -> int:
        """As ``batch_remove``, for one key."""
        return self.batch_remove([key], force)[0]

    def batch_remove(self, keys: List[str], force: bool = False) -> List[int]:
        """0 for each key removed, ``OBJECT_NOT_FOUND`` (-704) for one not
        stored. As in Mooncake, without ``force`` a key that a lease holds
        (found by ``batch_is_exist`` within the daemons' ``kv_lease_ttl``)
        stays, and is answered ``OBJECT_HAS_LEASE`` (-706)."""
        try:
            return self._c.remove_codes(keys, force=force)
        except mooncake_store.StoreError:
            return [RPC_FAIL] * len(keys)

    def remove_all(self, force: bool = False) -> int:
        """Removes every object of this client's namespace; how many, or -1.
        As in Mooncake, without ``force`` the objects a lease holds stay
        (and are not counted)."""
        try:
            return self._c.remove_all(force=force)
        except mooncake_store.StoreError as err:
            log.error("remove_all: %s", err)
            return -1

    def get_replica_desc(self, key: str) -> List[ReplicaDescriptor]:
        return self.batch_get_replica_desc([key]).get(key, [])

    def batch_get_replica_desc(self, keys: List[str]) -> Dict[str, List[ReplicaDescriptor]]:
        """The copies of each stored key, one descriptor per daemon holding
        one, by key; keys not stored are left out, as in Mooncake."""
        try:
            found = self._c.copies(keys)
        except (mooncake_store.StoreError, TypeError, ValueError) as err:
            log.error("batch_get_replica_desc: %s", err)
            return {}
        return {
            key: [_replica(size, addr, tier) for addr, tier in copies]
            for key, loc in zip(keys, found)
            if loc is not None
            for size, copies in [loc]
        }

    # -- zero copy through registered buffers ---------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        try:
            self._c.register_buffer(buffer_ptr, size)
        except (ValueError, OverflowError, TypeError) as err:
            log.error("register_buffer: %s", err)
            return INVALID_PARAMS
        return OK

    def unregister_buffer(self, buffer_ptr: int) -> int:
        return OK if self._c.unregister_buffer(buffer_ptr) else INVALID_PARAMS

    def put_from(
        self, key: str, buffer_ptr: int, size: int, config: Optional[ReplicateConfig] = None
    ) -> int:
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def batch_put_from(
        self,
        keys: List[str],
        buffer_ptrs: List[int],
        sizes: List[int],
        config: Optional[ReplicateConfig] = None,
    ) -> List[int]:
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        # In order: the engines put a request's blocks so (LMCache's chunks
        # past its stored prefix), and the daemons then evict them from the tail.
        codes = self._c.put_from_ptrs(
            keys, buffer_ptrs, sizes, replicas=_replicas(config), in_order=True
        )
        self._pin_if_asked(keys, codes, config)
        return codes

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Bytes read into the registered buffer, or a negative code."""
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(
        self, keys: List[str], buffer_ptrs: List[int], sizes: List[int]
    ) -> List[int]:
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        return self._c.get_into_ptrs(keys, buffer_ptrs, sizes)

    def batch_put_from_multi_buffers(
        self,
        keys: List[str],
        all_buffer_ptrs: List[List[int]],
        all_sizes: List[List[int]],
        config: Optional[ReplicateConfig] = None,
    ) -> List[int]:
        """Stores each key's object from several pieces of registered
        buffers (``all_buffer_ptrs[i]``, ``all_sizes[i]``, in order), such as
        a page's K and V; a status per key."""
        try:
            codes = self._c.put_from_ptr_lists(
                keys, all_buffer_ptrs, all_sizes, replicas=_replicas(config), in_order=True
            )
        except (TypeError, ValueError, OverflowError) as err:
            log.error("batch_put_from_multi_buffers: %s", err)
            return [INVALID_PARAMS] * len(keys)
        self._pin_if_asked(keys, codes, config)
        return codes

    def batch_get_into_multi_buffers(
        self,
        keys: List[str],
        all_buffer_ptrs: List[List[int]],
        all_sizes: List[List[int]],
        prefer_same_node: bool = False,
    ) -> List[int]:
        """Reads each key's object into several pieces of registered
        buffers, in order; per key the bytes read, or a negative code
        (``-704`` for a key not stored)."""
        try:
            return self._c.get_into_ptr_lists(keys, all_buffer_ptrs, all_sizes)
        except (TypeError, ValueError, OverflowError) as err:
            log.error("batch_get_into_multi_buffers: %s", err)
            return [INVALID_PARAMS] * len(keys)

    # -- slices of objects, in read sessions (SGLang's direct linker) ----

    def batch_get_session_start(self, keys: List[str]) -> List[int]:
        """Opens a read session on each key: its object is read once,
        whole, and checked; ``0`` per key, or a negative code (``-704`` not
        stored). See ``mooncake/_sessions.py``."""
        return self._sessions.start(list(keys))

    def batch_get_into_multi_buffer_ranges(
        self,
        keys: List[str],
        all_buffer_ptrs: List[List[int]],
        all_sizes: List[List[int]],
        all_src_offsets: List[List[int]],
    ) -> List[int]:
        """Copies slices of each key's object (``all_sizes[i][j]`` bytes
        from ``all_src_offsets[i][j]``) into registered buffers (host or
        GPU memory); per key the bytes copied, or a negative code."""
        try:
            return self._sessions.ranges(list(keys), all_buffer_ptrs, all_sizes, all_src_offsets)
        except (TypeError, ValueError, OverflowError) as err:
            log.error("batch_get_into_multi_buffer_ranges: %s", err)
            return [INVALID_PARAMS] * len(keys)

    def batch_get_session_end(self, keys: List[str]) -> int:
        """Closes a read session on each key; ``0``."""
        return self._sessions.end(list(keys))

    @property
    def _sessions(self) -> ReadSessions:
        if self._read_sessions is None:
            self._read_sessions = ReadSessions(self._c)
        return self._read_sessions

    def _pin_if_asked(
        self, keys: List[str], codes: List[int], config: Optional[ReplicateConfig]
    ) -> None:
        if config is not None and config.with_hard_pin:
            stored = [k for k, c in zip(keys, codes) if c == OK]
            if stored:
                self._c.pin(stored)
