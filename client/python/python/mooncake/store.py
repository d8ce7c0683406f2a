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
- ``ReplicateConfig``: one copy per block; ``with_hard_pin`` pins the block
  against eviction; the other fields are accepted and ignored.
- ``register_buffer`` is enforced: ``get_into`` / ``put_from`` on memory
  outside a registered buffer answer ``-600`` and touch nothing (Mooncake's
  behaviour there is undefined).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List, Optional

import mooncake_store
from mooncake_store import OBJECT_NOT_FOUND, INVALID_PARAMS, OK, RPC_FAIL

__all__ = ["MooncakeDistributedStore", "ReplicateConfig"]


@dataclass
class ReplicateConfig:
    replica_num: int = 1
    with_soft_pin: bool = False
    with_hard_pin: bool = False
    preferred_segment: str = ""
    prefer_alloc_in_same_node: bool = False


def _worst(codes: List[int]) -> int:
    return next((c for c in codes if c < 0), OK)


class MooncakeDistributedStore:
    """A client of the store, set up with ``setup()`` before use."""

    def __init__(self) -> None:
        self._client: Optional[mooncake_store.Client] = None
        self._daemon: Optional[mooncake_store.EmbeddedDaemon] = None
        self._hostname = ""

    # -- set-up ---------------------------------------------------------

    def setup(
        self,
        local_hostname: Any,
        metadata_server: str = "",
        global_segment_size: int = 16 * 1024 * 1024,
        local_buffer_size: int = 1024 * 1024 * 1024,
        protocol: str = "tcp",
        rdma_devices: str = "",
        master_server_addr: str = "127.0.0.1:7070",
    ) -> int:
        """Connects to the store; 0 on success, a negative code otherwise.

        Takes the seven positional arguments of Mooncake's ``setup``, or a
        single dict with the same names (``master_server_address`` and
        ``device_name`` are accepted as aliases).
        """
        if isinstance(local_hostname, dict):
            cfg = dict(local_hostname)
            local_hostname = cfg.get("local_hostname", "localhost")
            metadata_server = cfg.get("metadata_server", "")
            global_segment_size = int(cfg.get("global_segment_size", global_segment_size))
            protocol = cfg.get("protocol", protocol)
            rdma_devices = cfg.get("rdma_devices", cfg.get("device_name", rdma_devices))
            master_server_addr = cfg.get(
                "master_server_addr", cfg.get("master_server_address", master_server_addr)
            )
        if self._client is not None:
            return OK
        etcd = None
        if metadata_server.startswith("etcd://"):
            etcd = [e for e in metadata_server[len("etcd://") :].split(",") if e]
        host = str(local_hostname).rsplit(":", 1)[0] if ":" in str(local_hostname) else str(local_hostname)
        if host in ("localhost", ""):
            host = "127.0.0.1"
        namespace = os.environ.get("MOONCAKE_NAMESPACE", "default")
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
        except (mooncake_store.StoreError, OSError):
            return RPC_FAIL
        except ValueError:
            return INVALID_PARAMS
        if global_segment_size > 0:
            try:
                self._daemon = mooncake_store.EmbeddedDaemon(
                    master_server_addr, int(global_segment_size), host
                )
            except RuntimeError:
                return INVALID_PARAMS
        self._client = client
        self._hostname = self._daemon.addr if self._daemon else str(local_hostname)
        return OK

    def close(self) -> int:
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
            codes = self._c.put_batch(keys, values)
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

    # -- existence, size, removal ---------------------------------------

    def is_exist(self, key: str) -> int:
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: List[str]) -> List[int]:
        try:
            return [1 if e else 0 for e in self._c.exists(keys)]
        except (mooncake_store.StoreError, TypeError, ValueError):
            return [-1] * len(keys)

    def get_size(self, key: str) -> int:
        try:
            size = self._c.sizes([key])[0]
        except mooncake_store.StoreError:
            return RPC_FAIL
        return OBJECT_NOT_FOUND if size is None else size

    def remove(self, key: str) -> int:
        return self.batch_remove([key])[0]

    def batch_remove(self, keys: List[str], force: bool = False) -> List[int]:
        try:
            return [OK if r else OBJECT_NOT_FOUND for r in self._c.remove(keys)]
        except mooncake_store.StoreError:
            return [RPC_FAIL] * len(keys)

    def remove_all(self) -> int:
        try:
            return self._c.remove_all()
        except mooncake_store.StoreError:
            return -1

    # -- zero copy through registered buffers ---------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        try:
            self._c.register_buffer(buffer_ptr, size)
        except ValueError:
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
        codes = self._c.put_from_ptrs(keys, buffer_ptrs, sizes)
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

    def _pin_if_asked(
        self, keys: List[str], codes: List[int], config: Optional[ReplicateConfig]
    ) -> None:
        if config is not None and config.with_hard_pin:
            stored = [k for k, c in zip(keys, codes) if c == OK]
            if stored:
                self._c.pin(stored)
