"""The native API against a real store: bytes in, the same bytes out."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

import mooncake_store
from mooncake_store import OBJECT_NOT_FOUND, INVALID_PARAMS

REPO_VECTORS = [
    "bdf2fd341809efae94ae22d1233ca3ac4b0492bd8005a073b8c0cb47db1f741c",
    "01f8357aa6686646a99da02ac8c1c213946adbc69efcf6d9d796f0fb9a96dd01",
]


def test_block_hashes_match_the_documented_vectors():
    hashes = mooncake_store.block_hashes([0, 1, 2, 3, 4, 5, 6, 7], 4)
    assert [h.hex() for h in hashes] == REPO_VECTORS
    # A trailing partial block has no key.
    assert len(mooncake_store.block_hashes(list(range(10)), 4)) == 2
    assert (
        mooncake_store.opaque_hash("vllm-block-42").hex()
        == "afa690cd3257f3991b5b85a995552f0fed3b013c8877209c32ccccf2b2c8b5d6"
    )


def test_round_trips_of_random_sizes_are_byte_for_byte(client):
    rng = random.Random(7)
    sizes = [1, 255, 4096, 65_537] + [rng.randrange(1, 4 << 20) for _ in range(40)]
    values = {f"k{i}": rng.randbytes(n) for i, n in enumerate(sizes)}
    for key, value in values.items():
        client.put(key, value)
    for key, value in values.items():
        assert client.get(key) == value
        buf = bytearray(len(value) + 10)
        assert client.get_into(key, buf) == len(value)
        assert bytes(buf[: len(value)]) == value


def test_any_buffer_goes_in_and_comes_back(client):
    array = np.arange(100_000, dtype=np.float32)
    client.put("array", array)
    client.put("view", memoryview(b"abcdef")[2:])
    client.put("bytearray", bytearray(b"xyz"))
    out = np.zeros_like(array)
    assert client.get_into("array", out) == array.nbytes
    assert np.array_equal(out, array)
    assert client.get("view") == b"cdef"
    assert client.get("bytearray") == b"xyz"


def test_block_hash_keys_and_prefix_match(client):
    hashes = mooncake_store.block_hashes(list(range(64)), 16)
    for h in hashes[:3]:
        client.put(h, b"kv" + h)
    assert client.match_prefix(hashes) == 3
    assert client.exists(hashes) == [True, True, True, False]
    assert client.sizes(hashes[:1] + hashes[3:]) == [34, None]


def test_a_batch_of_128_keys_crosses_once_and_reports_per_key(client):
    keys = [f"b{i}" for i in range(128)]
    values = [bytes([i]) * (1000 + i) for i in range(128)]
    assert client.put_batch(keys, values) == [0] * 128
    bufs = [bytearray(2000) for _ in range(128)]
    got = client.get_into_batch(keys + ["absent"], bufs + [bytearray(10)])
    assert got[:128] == [len(v) for v in values]
    assert got[128] == OBJECT_NOT_FOUND
    assert all(bytes(b[: len(v)]) == v for b, v in zip(bufs, values))


def test_get_into_a_registered_buffer_lands_at_the_registered_address(client):
    block = 256 << 10
    values = [np.random.default_rng(i).integers(0, 255, block, dtype=np.uint8) for i in range(8)]
    keys = [f"r{i}" for i in range(8)]
    assert client.put_batch(keys, values) == [0] * 8
    arena = np.zeros(8 * block, dtype=np.uint8)
    base = arena.ctypes.data
    client.register_buffer(base, arena.nbytes)
    ptrs = [base + i * block for i in range(8)]
    assert client.get_into_ptrs(keys, ptrs, [block] * 8) == [block] * 8
    # The bytes are in the arena itself: no copy was handed back.
    for i, v in enumerate(values):
        assert np.array_equal(arena[i * block : (i + 1) * block], v)
    # Outside the registered range nothing is read or written.
    outside = np.zeros(block, dtype=np.uint8)
    assert client.get_into_ptrs(keys[:1], [outside.ctypes.data], [block]) == [INVALID_PARAMS]
    assert not outside.any()
    assert client.get_into_ptrs(keys[:1], [base + 7 * block + 1], [block]) == [INVALID_PARAMS]
    # And back out of the arena with put_from_ptrs.
    assert client.put_from_ptrs(["copy"], [base], [block]) == [0]
    assert client.get("copy") == values[0].tobytes()
    assert client.unregister_buffer(base)
    assert client.get_into_ptrs(keys[:1], [base], [block]) == [INVALID_PARAMS]


def test_threads_share_one_client(client):
    errors = []

    def worker(t: int) -> None:
        try:
            for i in range(50):
                key = f"t{t}-{i}"
                value = bytes([t, i]) * 5000
                client.put(key, value)
                assert client.get(key) == value
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert all(not t.is_alive() for t in threads)


def test_misses_are_none_and_codes(client):
    assert client.get("never-stored") is None
    assert client.get_into("never-stored", bytearray(10)) is None
    assert client.exists(["never-stored"]) == [False]
    assert client.remove(["never-stored"]) == [False]
    assert client.pin(["never-stored"]) == [OBJECT_NOT_FOUND]


def test_bad_arguments_are_clear_errors(client):
    client.put("small", b"0123456789")
    with pytest.raises(TypeError):
        client.put(42, b"x")
    with pytest.raises(ValueError, match="32-byte"):
        client.put(b"short", b"x")
    with pytest.raises(ValueError, match="larger than"):
        client.get_into("small", bytearray(4))
    with pytest.raises(BufferError):
        client.get_into("small", b"read-only bytes")
    with pytest.raises(ValueError, match="keys but"):
        client.put_batch(["a", "b"], [b"x"])
    with pytest.raises(ValueError):
        mooncake_store.Client("127.0.0.1:1", namespace="bad namespace!")
    shared = bytearray(100)
    view = memoryview(shared)
    assert client.get_into_batch(["small"] * 3, [view[0:20], view[10:30], view[40:60]]) == [
        INVALID_PARAMS,
        INVALID_PARAMS,
        10,
    ], "overlapping destinations are refused, the others served"


def test_an_unreachable_store_raises_store_unavailable():
    with pytest.raises(mooncake_store.StoreUnavailable):
        mooncake_store.Client("127.0.0.1:1", timeout=0.5)


def test_namespaces_keep_keys_apart(client):
    other = client.with_namespace(client.namespace + "-other")
    client.put("same", b"mine")
    assert other.get("same") is None
    other.put("same", b"theirs")
    assert client.get("same") == b"mine"
    other.remove_all()


def test_async_client(store):
    import asyncio

    async def main():
        c = await mooncake_store.AsyncClient.connect(store, namespace="t/async")
        await c.put("a", b"async bytes")
        got = await asyncio.gather(*(c.get("a") for _ in range(16)))
        assert got == [b"async bytes"] * 16
        assert await c.remove_all() == 1

    asyncio.run(main())


def test_rdma_asked_for_where_no_daemon_serves_it_moves_blocks_over_tcp(store):
    # Neither this host nor its daemon has RDMA: the client says so in its
    # fallback count, not in errors, and blocks (from a registered buffer
    # too) come back byte for byte.
    from mooncake.store import MooncakeDistributedStore

    c = mooncake_store.Client(store, namespace="t/rdma", rdma=True, rdma_device="mlx5_0")
    buf = np.arange(1 << 16, dtype=np.uint8)
    c.register_buffer(buf.ctypes.data, buf.nbytes)
    assert c.put_from_ptrs(["r"], [buf.ctypes.data], [buf.nbytes]) == [0]
    out = np.zeros_like(buf)
    c.register_buffer(out.ctypes.data, out.nbytes)
    assert c.get_into_ptrs(["r"], [out.ctypes.data], [out.nbytes]) == [buf.nbytes]
    assert np.array_equal(out, buf)
    assert c.unregister_buffer(buf.ctypes.data) and c.unregister_buffer(out.ctypes.data)
    c.remove_all()

    s = MooncakeDistributedStore()
    assert s.setup("localhost", "", 0, 0, "rdma", "mlx5_0", store) == 0
    assert s.put("over-rdma-or-tcp", b"either way") == 0
    assert s.get("over-rdma-or-tcp") == b"either way"
    s.remove_all()
    assert s.close() == 0


class _CudaTensorLike:
    """What the client reads of a torch tensor on a GPU: an address it
    must never read as host memory (here an unmapped one)."""

    is_cuda = True

    def is_contiguous(self):
        return True

    def data_ptr(self):
        return 0x7F00_0000_0000 - (1 << 30)

    def numel(self):
        return 4096

    def element_size(self):
        return 2


def test_gpu_memory_is_refused_in_one_line_where_no_gpu_claims_it(client):
    # On a host without the CUDA driver (or where it does not know the
    # address) a device pointer is refused, never read; the store keeps
    # serving.
    client.put("gpu-refusal", b"x" * 16)
    with pytest.raises(ValueError, match="GPU") as refused:
        client.get_into("gpu-refusal", _CudaTensorLike())
    assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="GPU"):
        client.put("gpu-refusal-2", _CudaTensorLike())
    with pytest.raises(ValueError, match="GPU"):
        client.register_buffer(_CudaTensorLike().data_ptr(), 1 << 20)
    assert client.get("gpu-refusal") == b"x" * 16
    assert not client.exists(["gpu-refusal-2"])[0]
