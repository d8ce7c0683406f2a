"""Mooncake Store from Python: the KV cache store for LLM serving.

``Client`` talks to a running store (``mooncake-store up``, or a cluster
through etcd). Single-key calls raise on failure and answer ``None`` for a
miss; batch calls cross into Rust once per batch and answer one status per
key (bytes read, or a negative code such as ``OBJECT_NOT_FOUND``). Network
calls release the GIL. ``AsyncClient`` offers the same calls as coroutines.

For code written against ``mooncake.store.MooncakeDistributedStore``, the
``mooncake.store`` module of this package provides a compatible class.
"""

from ._native import (
    INTERNAL_ERROR,
    INVALID_KEY,
    ILLEGAL_CLIENT,
    INVALID_PARAMS,
    NO_AVAILABLE_HANDLE,
    OBJECT_HAS_LEASE,
    OBJECT_NOT_FOUND,
    OK,
    RPC_FAIL,
    TRANSFER_FAIL,
    WRITE_FAIL,
    Client,
    StoreError,
    StoreUnavailable,
    block_hashes,
    opaque_hash,
)
from .aio import AsyncClient
from .daemon import DaemonProcess

__all__ = [
    "AsyncClient",
    "Client",
    "DaemonProcess",
    "StoreError",
    "StoreUnavailable",
    "block_hashes",
    "opaque_hash",
    "OK",
    "INTERNAL_ERROR",
    "NO_AVAILABLE_HANDLE",
    "INVALID_KEY",
    "WRITE_FAIL",
    "INVALID_PARAMS",
    "ILLEGAL_CLIENT",
    "OBJECT_NOT_FOUND",
    "OBJECT_HAS_LEASE",
    "TRANSFER_FAIL",
    "RPC_FAIL",
]
