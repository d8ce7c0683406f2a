"""KV blocks put from and read into CUDA memory through both Python APIs,
the way the engines call them: vLLM's Mooncake store connector registers
its GPU KV-cache tensors (`register_buffer`) and moves a block's K and V
as pieces (`batch_*_multi_buffers`); the native API takes CUDA tensors.
Each test runs through the same-host shared pool and over TCP, and checks
the bytes on the GPU against what was put.

Needs PyTorch with a CUDA GPU; skipped elsewhere (`tools/gpu-check.sh`
runs it on a GPU host). Without a GPU, `test_client.py` checks that CUDA
memory is refused in one line."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

import mooncake_store  # noqa: E402
from mooncake.store import MooncakeDistributedStore  # noqa: E402

from conftest import single_host_store  # noqa: E402

OBJECT_NOT_FOUND = -704
INVALID_PARAMS = -600
BLOCK = 256 << 10  # bytes of K (and of V) per block
BLOCKS = 48


@pytest.fixture(scope="module", params=["shm", "tcp"])
def store(request, tmp_path_factory):
    """(meta address, the same-host daemon's socket or None)."""
    sock = str(tmp_path_factory.mktemp("gpu") / "daemon.sock")
    with single_host_store("1GiB", "--shm-socket", sock) as meta:
        yield meta, (sock if request.param == "shm" else None)


@pytest.fixture
def compat(store, monkeypatch, request):
    meta, sock = store
    if sock:
        monkeypatch.setenv("MOONCAKE_SHM_SOCKET", sock)
    else:
        monkeypatch.delenv("MOONCAKE_SHM_SOCKET", raising=False)
    monkeypatch.setenv("MOONCAKE_NAMESPACE", "gpu/" + request.node.name[:80])
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "", 0, 0, "tcp", "", meta) == 0
    if sock:
        assert s._c.same_host_ready(30.0)
    yield s
    s.remove_all(force=True)
    s.close()


def kv_cache(seed):
    """A vLLM-like KV cache on the GPU: [2 (K, V), blocks, bytes]."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (2, BLOCKS, BLOCK), dtype=torch.uint8, device="cuda", generator=g)


def pieces(kv, blocks):
    """Per block: the addresses and sizes of its K and V."""
    ptrs = [[kv[0, i].data_ptr(), kv[1, i].data_ptr()] for i in blocks]
    return ptrs, [[BLOCK, BLOCK] for _ in blocks]


def test_vllm_style_kv_blocks_go_from_gpu_memory_to_the_store_and_back(compat):
    src, dst = kv_cache(1), torch.zeros((2, BLOCKS, BLOCK), dtype=torch.uint8, device="cuda")
    for kv in (src, dst):
        assert compat.register_buffer(kv.data_ptr(), kv.numel()) == 0
    torch.cuda.synchronize()
    keys = [f"model@tp_rank:0@{i:064x}" for i in range(BLOCKS)]
    ptrs, sizes = pieces(src, range(BLOCKS))
    assert compat.batch_put_from_multi_buffers(keys, ptrs, sizes) == [0] * BLOCKS
    assert compat.get_size(keys[0]) == 2 * BLOCK

    # Read back the other way round (V's block first), plus a miss.
    order = list(reversed(range(BLOCKS)))
    dptrs, dsizes = pieces(dst, order)
    got = compat.batch_get_into_multi_buffers(
        [keys[i] for i in order] + ["missing"], dptrs + [[dst[0, 0].data_ptr()]],
        dsizes + [[BLOCK]],
    )
    assert got[:-1] == [2 * BLOCK] * BLOCKS and got[-1] == OBJECT_NOT_FOUND
    assert torch.equal(dst, src)


def test_single_and_batched_pointer_calls_on_gpu_memory(compat):
    src, dst = kv_cache(2), torch.zeros((2, BLOCKS, BLOCK), dtype=torch.uint8, device="cuda")
    for kv in (src, dst):
        assert compat.register_buffer(kv.data_ptr(), kv.numel()) == 0
    # Odd sizes, so that nothing lines up with a page or a staging chunk.
    n = 8
    lens = [1, 4095, BLOCK - 3, BLOCK, 3, 65_537, 17, BLOCK // 2 + 1]
    ptrs = [src[0, i].data_ptr() for i in range(n)]
    keys = [f"odd/{i}" for i in range(n)]
    assert compat.put_from(keys[0], ptrs[0], lens[0]) == 0
    assert compat.batch_put_from(keys[1:], ptrs[1:], lens[1:]) == [0] * (n - 1)
    dptrs = [dst[1, i].data_ptr() for i in range(n)]
    assert compat.get_into(keys[0], dptrs[0], lens[0]) == lens[0]
    assert compat.batch_get_into(keys[1:], dptrs[1:], lens[1:]) == lens[1:]
    for i, size in enumerate(lens):
        assert torch.equal(dst[1, i, :size], src[0, i, :size]), f"block {i}"
        assert not dst[1, i, size:].any(), f"block {i}: bytes past its end were written"
    # A destination smaller than the block is refused and left untouched.
    assert compat.get_into(keys[3], dst[0, 0].data_ptr(), BLOCK - 1) < 0
    assert not dst[0].any()


def test_a_block_with_pieces_in_host_and_gpu_memory_is_refused_and_writes_nothing(compat):
    src = kv_cache(3)
    host = torch.zeros(BLOCK, dtype=torch.uint8).pin_memory()
    dst = torch.zeros((2, 2, BLOCK), dtype=torch.uint8, device="cuda")
    for ptr, n in ((src.data_ptr(), src.numel()), (host.data_ptr(), BLOCK),
                   (dst.data_ptr(), dst.numel())):
        assert compat.register_buffer(ptr, n) == 0
    assert compat.batch_put_from_multi_buffers(
        ["mixed", "gpu"], [[src[0, 0].data_ptr(), host.data_ptr()], [src[0, 1].data_ptr()]],
        [[BLOCK, BLOCK], [BLOCK]],
    ) == [INVALID_PARAMS, 0]
    assert compat.is_exist("mixed") == 0
    got = compat.batch_get_into_multi_buffers(
        ["gpu", "gpu"], [[dst[0, 0].data_ptr()], [dst[1, 0].data_ptr() + BLOCK // 2, host.data_ptr()]],
        [[BLOCK], [BLOCK // 2, BLOCK // 2]],
    )
    assert got == [BLOCK, INVALID_PARAMS]
    assert torch.equal(dst[0, 0], src[0, 1])
    assert not dst[1].any() and not host.any()


def test_native_api_takes_cuda_tensors(store, request):
    meta, sock = store
    client = mooncake_store.Client(meta, namespace="gpu/" + request.node.name[:80], shm_socket=sock)
    if sock:
        assert client.same_host_ready(30.0)
    src = kv_cache(4)
    client.put("one", src[0, 0])
    keys = [f"b{i}" for i in range(BLOCKS)]
    assert client.put_batch(keys, [src[1, i] for i in range(BLOCKS)]) == [0] * BLOCKS
    dst = torch.zeros((BLOCKS, BLOCK), dtype=torch.uint8, device="cuda")
    assert client.get_into("one", dst[0]) == BLOCK
    assert torch.equal(dst[0], src[0, 0])
    assert client.get_into_batch(keys, [dst[i] for i in range(BLOCKS)]) == [BLOCK] * BLOCKS
    assert torch.equal(dst, src[1])
    assert client.get("one") == bytes(src[0, 0].cpu().numpy())
    client.remove_all()
