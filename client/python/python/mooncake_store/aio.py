"""``AsyncClient``: the ``Client`` calls as coroutines, for asyncio servers.

Each call runs on a thread of the event loop's default executor; the native
call releases the GIL there, so the loop keeps serving while blocks move.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from ._native import Client

_CALLS = (
    "put",
    "get",
    "get_into",
    "put_batch",
    "put_chain",
    "get_into_batch",
    "get_into_ptrs",
    "put_from_ptrs",
    "match_prefix",
    "exists",
    "sizes",
    "pin",
    "remove",
    "remove_codes",
    "remove_all",
)


class AsyncClient:
    """A ``Client`` whose network calls are awaitable.

    ``await AsyncClient.connect(meta)`` takes the same arguments as
    ``Client``; ``register_buffer`` and ``unregister_buffer`` stay plain
    calls (they do not touch the network).
    """

    def __init__(self, client: Client):
        self.client = client

    @classmethod
    async def connect(cls, *args: Any, **kwargs: Any) -> "AsyncClient":
        loop = asyncio.get_running_loop()
        client = await loop.run_in_executor(None, functools.partial(Client, *args, **kwargs))
        return cls(client)

    def register_buffer(self, ptr: int, size: int) -> None:
        self.client.register_buffer(ptr, size)

    def unregister_buffer(self, ptr: int) -> bool:
        return self.client.unregister_buffer(ptr)

    def __getattr__(self, name: str) -> Any:
        if name not in _CALLS:
            raise AttributeError(name)
        call = getattr(self.client, name)

        async def run(*args: Any, **kwargs: Any) -> Any:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, functools.partial(call, *args, **kwargs))

        run.__name__ = name
        run.__doc__ = call.__doc__
        return run
