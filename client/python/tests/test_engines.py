"""`mooncake.store` as the serving engines' Mooncake backends call it: the
calls, argument shapes, key formats and buffer layouts of SGLang HiCache
(`sglang/srt/mem_cache/storage/mooncake_store/mooncake_store.py`), LMCache
(`lmcache/v1/storage_backend/connector/mooncakestore_connector.py`) and
vLLM's `MooncakeStoreConnector`, against a real store. The engines
themselves are not imported (they need torch and a GPU); each test says
which of their calls it makes."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from mooncake.store import (
    MooncakeDistributedStore,
    MooncakeHostMemAllocator,
    ReplicateConfig,
    SoftPinAction,
)

from conftest import Process, free_port, single_host_store, wait_for_port

OBJECT_NOT_FOUND = -704
INVALID_PARAMS = -600
PAGES = 64
# A page of one tensor-parallel rank: 16 tokens x 8 heads x 128 dims, fp16.
PAGE_BYTES = 16 * 8 * 128 * 2


def sglang_setup(meta: str, segment=0, **kwargs) -> MooncakeDistributedStore:
    """SGLang's call: seven positional arguments, the transfer engine
    (None), and the keywords it passes when set."""
    s = MooncakeDistributedStore()
    ret = s.setup("localhost", "P2PHANDSHAKE", segment, 16 * 1024 * 1024, "tcp", "",
                  meta, None, **kwargs)
    assert ret == 0
    return s


@pytest.fixture
def sglang(store):
    s = sglang_setup(store, tenant_id="t/engines")
    yield s
    s.remove_all(force=True)
    s.close()


def page_keys(prefix: str, n: int = PAGES, rank: int = 0) -> list[list[str]]:
    """SGLang's MHA keys: `{page hash}_{tp rank}_k` and `_v` per page."""
    return [[f"{prefix}{i:040x}_{rank}_k", f"{prefix}{i:040x}_{rank}_v"] for i in range(n)]


class HostPool:
    """A host KV pool laid out as SGLang's `page_first` MHA pool: K and V in
    separate buffers, a page at a stride; registered with the store."""

    def __init__(self, store: MooncakeDistributedStore, pages: int, seed: int | None):
        rng = np.random.default_rng(seed)
        shape = (2, pages, PAGE_BYTES)
        self.kv = rng.integers(0, 255, shape, dtype=np.uint8) if seed is not None else np.zeros(shape, np.uint8)
        self.base = self.kv.ctypes.data
        assert store.register_buffer(self.base, self.kv.nbytes) == 0

    def k(self, page: int) -> int:
        return self.base + page * PAGE_BYTES

    def v(self, page: int) -> int:
        return self.kv[1].ctypes.data + page * PAGE_BYTES


def test_sglang_setup_forms_and_sizes(store):
    # The keywords SGLang adds (metrics server, SSD offload, a tenant).
    s = sglang_setup(store, enable_client_http_server=True, client_http_port=9999,
                     enable_ssd_offload=False, ssd_offload_path="/tmp/x", tenant_id="t/x")
    assert s.close() == 0
    # Sizes as strings, positional (LMCache's JSON) and in a dict.
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "", "0GB", "16MB", "tcp", "", store) == 0
    s.close()
    s = MooncakeDistributedStore()
    assert s.setup({"local_hostname": "localhost", "global_segment_size": "0",
                    "local_buffer_size": "1 GiB", "master_server_address": store}) == 0
    s.close()
    # A size Mooncake refuses is a code, not an exception.
    assert MooncakeDistributedStore().setup("localhost", "", "50%", 0, "tcp", "", store) == INVALID_PARAMS
    assert MooncakeDistributedStore().setup("localhost", "", 0, "lots", "tcp", "", store) == INVALID_PARAMS


def test_sglang_warmup(sglang):
    key, value = "sglang_mooncake_store_warmup_key0123", bytes(4 * 1024)
    assert sglang.put(key, value) == 0
    assert sglang.is_exist(key) == 1
    assert sglang.get(key) == value


def test_sglang_mha_pages_round_trip_through_batch_put_from_and_get_into(sglang):
    src = HostPool(sglang, PAGES, seed=1)
    keys = [k for pair in page_keys("mha") for k in pair]
    ptrs = [p for i in range(PAGES) for p in (src.k(i), src.v(i))]
    sizes = [PAGE_BYTES] * len(keys)
    # batch_set_v1: only the pages not stored yet are put.
    assert sglang.batch_is_exist(keys) == [0] * len(keys)
    assert sglang.batch_put_from(keys, ptrs, sizes) == [0] * len(keys)
    assert sglang.batch_is_exist(keys) == [1] * len(keys)
    # batch_get_v1, into another pool.
    dst = HostPool(sglang, PAGES, seed=None)
    dptrs = [p for i in range(PAGES) for p in (dst.k(i), dst.v(i))]
    assert sglang.batch_get_into(keys, dptrs, sizes) == [PAGE_BYTES] * len(keys)
    assert np.array_equal(dst.kv, src.kv)


def test_sglang_multi_buffer_pages_gather_and_scatter(sglang):
    """MLA / hybrid pools: one object per page made of several pieces
    (`batch_put_from_multi_buffers`), here K and V of a page, and the
    layer-first layout's per-layer slices."""
    layers, per_layer = 4, PAGE_BYTES // 4
    src = HostPool(sglang, PAGES, seed=2)
    keys = [f"mla{i:040x}__k" for i in range(PAGES)]

    def pieces(pool: HostPool):
        # Per page: K's layer slices, then V's: 2 x 4 pieces.
        ptrs = [[base + l * per_layer for base in (pool.k(i), pool.v(i)) for l in range(layers)]
                for i in range(PAGES)]
        return ptrs, [[per_layer] * (2 * layers) for _ in range(PAGES)]

    ptrs, sizes = pieces(src)
    assert sglang.batch_put_from_multi_buffers(keys, ptrs, sizes, ReplicateConfig()) == [0] * PAGES
    assert sglang.get_size(keys[0]) == 2 * PAGE_BYTES
    dst = HostPool(sglang, PAGES, seed=None)
    dptrs, dsizes = pieces(dst)
    spare = HostPool(sglang, 1, seed=None)
    got = sglang.batch_get_into_multi_buffers(keys + ["mla-missing"], dptrs + [[spare.k(0)]],
                                              dsizes + [[PAGE_BYTES]])
    assert got == [2 * PAGE_BYTES] * PAGES + [OBJECT_NOT_FOUND]
    assert np.array_equal(dst.kv, src.kv)
    assert not spare.kv.any(), "a miss writes nothing"


def test_multi_buffer_pieces_outside_registered_memory_or_overlapping_touch_nothing(sglang):
    src = HostPool(sglang, 2, seed=3)
    assert sglang.batch_put_from_multi_buffers(["a", "b"], [[src.k(0), src.v(0)], [src.k(1)]],
                                               [[PAGE_BYTES, PAGE_BYTES], [PAGE_BYTES]]) == [0, 0]
    stray = np.zeros(PAGE_BYTES, np.uint8)  # not registered
    dst = HostPool(sglang, 2, seed=None)
    got = sglang.batch_get_into_multi_buffers(
        ["a", "b", "a"],
        [[dst.k(0), stray.ctypes.data], [dst.k(1)], [dst.v(1), dst.v(1)]],
        [[PAGE_BYTES, PAGE_BYTES], [PAGE_BYTES], [PAGE_BYTES, PAGE_BYTES]],
    )
    assert got == [INVALID_PARAMS, PAGE_BYTES, INVALID_PARAMS]
    assert not stray.any() and not dst.kv[0, 0].any() and not dst.kv[1, 1].any()
    assert np.array_equal(dst.kv[0, 1], src.kv[0, 1])
    # Mismatched shapes are a code per key, not an exception.
    assert sglang.batch_put_from_multi_buffers(["c"], [[src.k(0)]], [[1, 2]]) == [INVALID_PARAMS]


def test_a_multi_buffer_object_is_its_pieces_joined_whatever_the_cut(sglang):
    """Written from 8 uneven pieces, an object reads back into K and V
    halves, into one buffer, and into pieces cut elsewhere, byte for byte;
    into pieces too small for it, it is refused and nothing is written."""
    src = HostPool(sglang, 2, seed=4)
    cuts = [0, 1, 4096, 4097, 30_000, PAGE_BYTES, PAGE_BYTES + 1, 2 * PAGE_BYTES - 7]
    k, v = src.k(0), src.v(0)
    # Page 0's K and V as one object, cut into 8 pieces at uneven offsets
    # (the cut at PAGE_BYTES keeps each piece inside K or inside V).
    joined = np.concatenate([src.kv[0, 0], src.kv[1, 0]])
    at = lambda off: k + off if off < PAGE_BYTES else v + (off - PAGE_BYTES)
    bounds = sorted(set(cuts + [2 * PAGE_BYTES]))
    ptrs = [at(a) for a, b in zip(bounds, bounds[1:])]
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert sum(sizes) == 2 * PAGE_BYTES and len(ptrs) == 8, sizes
    assert sglang.batch_put_from_multi_buffers(["cut"], [ptrs], [sizes]) == [0]

    dst = HostPool(sglang, 2, seed=None)
    assert sglang.batch_get_into_multi_buffers(["cut"], [[dst.k(0), dst.v(0)]],
                                               [[PAGE_BYTES, PAGE_BYTES]]) == [2 * PAGE_BYTES]
    assert np.array_equal(np.concatenate([dst.kv[0, 0], dst.kv[1, 0]]), joined)
    # One buffer: K of pages 0 and 1 of a fresh pool, which are adjacent.
    whole = HostPool(sglang, 2, seed=None)
    assert sglang.batch_get_into(["cut"], [whole.k(0)], [2 * PAGE_BYTES]) == [2 * PAGE_BYTES]
    assert np.array_equal(whole.kv[0].reshape(-1), joined)
    # Three pieces cut elsewhere, the last with room to spare.
    other = HostPool(sglang, 2, seed=None)
    got = sglang.batch_get_into_multi_buffers(
        ["cut"], [[other.k(0), other.v(0), other.k(1)]], [[1000, PAGE_BYTES, PAGE_BYTES]])
    assert got == [2 * PAGE_BYTES]
    tail = 2 * PAGE_BYTES - 1000 - PAGE_BYTES
    assert np.array_equal(other.kv[0, 0, :1000], joined[:1000])
    assert np.array_equal(other.kv[1, 0], joined[1000 : 1000 + PAGE_BYTES])
    assert np.array_equal(other.kv[0, 1, :tail], joined[1000 + PAGE_BYTES :])
    assert not other.kv[0, 1, tail:].any(), "written past the object's end"
    # Too small: refused with a negative code, nothing written.
    small = HostPool(sglang, 1, seed=None)
    got = sglang.batch_get_into_multi_buffers(["cut"], [[small.k(0), small.v(0)]],
                                              [[PAGE_BYTES, PAGE_BYTES - 1]])
    assert got[0] < 0 and not small.kv.any()


LAYERS = 4
LAYER_BYTES = 1024  # one layer of one page: K and V of a page's tokens


def test_sglang_direct_linker_loads_each_layers_slice_of_each_page(sglang):
    # SGLang's direct linker: page objects whose layers lie one after the
    # other, loaded a layer at a time into a layer-first pool between
    # batch_get_session_start and batch_get_session_end.
    pages = 6
    rng = np.random.default_rng(7)
    objects = rng.integers(0, 255, (pages, LAYERS * LAYER_BYTES), dtype=np.uint8)
    keys = [f"direct-{i:040x}_cp0_pp0" for i in range(pages)]
    assert sglang.register_buffer(objects.ctypes.data, objects.nbytes) == 0
    assert sglang.batch_put_from(keys, [objects[i].ctypes.data for i in range(pages)],
                                 [objects.shape[1]] * pages) == [0] * pages
    pool = np.zeros((LAYERS, pages, LAYER_BYTES), dtype=np.uint8)
    assert sglang.register_buffer(pool.ctypes.data, pool.nbytes) == 0

    assert sglang.batch_get_session_start(keys) == [0] * pages
    # Evicted or removed meanwhile: the session still holds what it read.
    sglang.batch_remove(keys[:2])
    for layer in range(LAYERS):
        ptrs = [[pool[layer, i].ctypes.data] for i in range(pages)]
        got = sglang.batch_get_into_multi_buffer_ranges(
            keys, ptrs, [[LAYER_BYTES]] * pages, [[layer * LAYER_BYTES]] * pages)
        assert got == [LAYER_BYTES] * pages, layer
    assert sglang.batch_get_session_end(keys) == 0
    for layer in range(LAYERS):
        assert np.array_equal(pool[layer], objects[:, layer * LAYER_BYTES:(layer + 1) * LAYER_BYTES])

    # Once the sessions ended, what was removed is gone; what is stored is
    # read whole for a call made outside any session.
    pool[:] = 0
    got = sglang.batch_get_into_multi_buffer_ranges(
        keys[1:3], [[pool[0, 1].ctypes.data], [pool[0, 2].ctypes.data]],
        [[LAYER_BYTES]] * 2, [[LAYER_BYTES]] * 2)
    assert got == [OBJECT_NOT_FOUND, LAYER_BYTES]
    assert np.array_equal(pool[0, 2], objects[2, LAYER_BYTES:2 * LAYER_BYTES])
    assert not pool[0, 1].any()


def test_ranged_reads_refuse_what_lies_outside_the_object_or_registered_memory(sglang):
    obj = np.arange(4096, dtype=np.uint32).view(np.uint8)
    assert sglang.put("ranged", obj.tobytes()) == 0
    dst = np.zeros(4 * 4096, dtype=np.uint8)
    assert sglang.register_buffer(dst.ctypes.data, dst.nbytes) == 0
    unregistered = np.zeros(4096, dtype=np.uint8)
    assert sglang.batch_get_session_start(["ranged", "ranged", "never-stored"]) == [0, 0, OBJECT_NOT_FOUND]
    base = dst.ctypes.data
    got = sglang.batch_get_into_multi_buffer_ranges(
        ["ranged", "ranged", "ranged", "ranged"],
        [[base], [base + 8192], [unregistered.ctypes.data], [base + 12288, base + 12300]],
        [[100], [4096], [16], [12, 20]],
        [[obj.nbytes - 100], [obj.nbytes - 4095], [0], [0, 40]],
    )
    # The end of the object; past its end; outside registered memory;
    # two slices into one destination each.
    assert got == [100, INVALID_PARAMS, INVALID_PARAMS, 32]
    assert np.array_equal(dst[:100], obj[-100:])
    assert not dst[8192:12288].any()
    assert np.array_equal(dst[12288:12300], obj[:12]) and np.array_equal(dst[12300:12320], obj[40:60])
    # Opened twice: held until the second end.
    assert sglang.batch_get_session_end(["ranged"]) == 0
    sglang.remove("ranged")
    assert sglang.batch_get_into_multi_buffer_ranges(["ranged"], [[base]], [[8]], [[0]]) == [8]
    assert sglang.batch_get_session_end(["ranged", "never-stored"]) == 0
    assert sglang.batch_get_into_multi_buffer_ranges(["ranged"], [[base]], [[8]], [[0]]) == [OBJECT_NOT_FOUND]
    assert sglang.batch_get_into_multi_buffer_ranges(["ranged"], [[base]], [[8], [8]], [[0]]) == [INVALID_PARAMS]


def test_read_sessions_hold_at_most_their_memory(store, monkeypatch):
    monkeypatch.setenv("MOONCAKE_READ_SESSION_BYTES", str(3 * 4096))
    s = sglang_setup(store, tenant_id="t/sessions")
    try:
        keys = [f"held-{i}" for i in range(4)]
        assert s.put_batch(keys, [bytes([i]) * 4096 for i in range(4)]) == 0
        assert s.batch_get_session_start(keys) == [0, 0, 0, -200]
        # A start's memory goes back once all its sessions ended.
        assert s.batch_get_session_end(keys[:3]) == 0
        assert s.batch_get_session_start(keys[3:]) == [0]
        assert s.batch_get_session_end(keys[3:]) == 0
    finally:
        s.remove_all(force=True)
        s.close()


def test_sglang_standalone_storage_with_the_host_allocator(store):
    allocator = MooncakeHostMemAllocator()
    size = PAGES * PAGE_BYTES
    ptr = allocator.alloc(size)
    view = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * size).from_address(ptr))
    view[:] = np.random.default_rng(4).integers(0, 255, size, dtype=np.uint8)
    s = MooncakeDistributedStore()
    assert s.setup_dummy(size, 16 * 1024 * 1024, store) == 0
    assert s.register_buffer(ptr, size) == 0
    keys = [f"standalone{i}" for i in range(PAGES)]
    ptrs = [ptr + i * PAGE_BYTES for i in range(PAGES)]
    assert s.batch_put_from(keys, ptrs, [PAGE_BYTES] * PAGES) == [0] * PAGES
    expected = view.copy()
    view[:] = 0
    assert s.batch_get_into(keys, ptrs, [PAGE_BYTES] * PAGES) == [PAGE_BYTES] * PAGES
    assert np.array_equal(view, expected)
    assert s.unregister_buffer(ptr) == 0
    assert s.remove_all() == PAGES
    s.close()
    del view
    assert allocator.free(ptr) == 0


def test_lmcache_chunks_with_metadata_through_put_parts_and_batch_get_buffer(sglang):
    # save_chunk_meta on: 28 bytes of metadata, then the chunk's bytes.
    meta = bytes(range(28))
    chunks = [np.random.default_rng(i).integers(0, 255, 64 << 10, dtype=np.uint8) for i in range(8)]
    keys = [f"vllm@model@1@0@{i:064x}" for i in range(8)]
    for key, chunk in zip(keys, chunks):
        assert sglang.put_parts(key, meta, chunk.tobytes()) == 0
    buffers = sglang.batch_get_buffer(keys + ["vllm@model@1@0@missing"])
    assert buffers[-1] is None
    for buf, chunk in zip(buffers, chunks):
        view = memoryview(buf)
        assert bytes(view[:28]) == meta and len(view) == 28 + chunk.nbytes
        assert np.array_equal(np.frombuffer(buf, dtype=np.uint8, offset=28), chunk)
        assert buf.size() == len(buf) and buf.ptr() != 0
    assert sglang.get_buffer("vllm@model@1@0@missing") is None


def test_vllm_replica_descriptors_and_remove_all_force(sglang):
    assert sglang.put("vllm-a", b"a" * 100) == 0
    descs = sglang.batch_get_replica_desc(["vllm-a", "vllm-missing"])
    assert list(descs) == ["vllm-a"], "keys not stored are left out"
    (desc,) = descs["vllm-a"]
    assert desc.is_memory_replica() and not desc.is_disk_replica()
    assert desc.get_memory_descriptor().buffer_descriptor.size == 100
    assert sglang.get_replica_desc("vllm-missing") == []
    assert sglang.remove_all(force=True) == 1


def test_vllm_sees_blocks_demoted_to_nvme_as_disk_replicas(tmp_path):
    """vLLM's connector sorts its loads into memory and disk keys by
    `is_memory_replica` / `is_disk_replica` of the first descriptor: a copy
    demoted to the daemon's NVMe drive is a disk replica there, and still
    reads back."""
    drive = tmp_path / "nvme.bin"
    with single_host_store("4MiB", "--nvme", f"{drive}:64MiB") as meta:
        s = sglang_setup(meta)
        try:
            value = bytes(range(256)) * 256  # 64 KiB
            keys = [f"vllm-tier-{i}" for i in range(120)]
            for k in keys:
                assert s.put(k, value) == 0
            # The daemon reports a demotion with its next heartbeat.
            deadline = time.monotonic() + 15
            while True:
                first = s.batch_get_replica_desc([keys[0]])[keys[0]][0]
                if first.is_disk_replica() or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert first.is_disk_replica() and not first.is_memory_replica()
            assert first.get_disk_descriptor().object_size == len(value)
            with pytest.raises(RuntimeError):
                first.get_memory_descriptor()
            (last,) = s.get_replica_desc(keys[-1])
            assert last.is_memory_replica() and not last.is_disk_replica()
            assert s.get(keys[0]) == value
        finally:
            s.close()


def test_replicate_config_has_the_fields_engines_set():
    config = ReplicateConfig()
    config.replica_num = 1
    config.preferred_segment = "127.0.0.1:1234"
    config.group_ids = ["sglang-hicache:a", "sglang-hicache:a"]
    config.soft_pin_action = SoftPinAction.ENABLE
    config.soft_pin_ttl_ms = 1000
    assert hasattr(ReplicateConfig, "group_ids")
    with pytest.raises(AttributeError):
        config.no_such_field = 1


def test_a_device_pointer_is_refused_at_registration(sglang):
    # A CUDA UVA address range is reserved in the process, not readable
    # host memory; any unmapped range is refused the same way.
    assert sglang.register_buffer(0x7F00_0000_0000 - (1 << 30), 1 << 20) == INVALID_PARAMS
    assert sglang.register_buffer(0, 4096) == INVALID_PARAMS


def test_engine_threads_put_and_get_at_once(sglang):
    pools = [HostPool(sglang, 16, seed=10 + t) for t in range(4)]
    failures = []

    def worker(t: int):
        pool = pools[t]
        keys = [f"thread{t}-{i}" for i in range(16)]
        ptrs = [[pool.k(i), pool.v(i)] for i in range(16)]
        sizes = [[PAGE_BYTES, PAGE_BYTES]] * 16
        for _ in range(3):
            if sglang.batch_put_from_multi_buffers(keys, ptrs, sizes) != [0] * 16:
                failures.append(("put", t))
            expected = pool.kv.copy()
            pool.kv[:] = 0
            if sglang.batch_get_into_multi_buffers(keys, ptrs, sizes) != [2 * PAGE_BYTES] * 16:
                failures.append(("get", t))
            if not np.array_equal(pool.kv, expected):
                failures.append(("bytes", t))
            pool.kv[:] = expected

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not failures


def test_a_closed_clients_daemon_leaves_at_once():
    """A worker restart: the embedded daemon of a closed store leaves the
    meta service, so nothing is placed on it and its keys are not reported
    as stored (SGLang would skip storing them again)."""
    meta = f"127.0.0.1:{free_port()}"
    proc = Process("meta", "--listen", meta, "--admin", "")
    try:
        wait_for_port(meta)
        first = sglang_setup(meta, segment=64 * 1024 * 1024)
        # setup returns once its daemon is registered: the first put lands.
        assert first.put("before-restart", b"x" * 1000) == 0
        assert first.close() == 0
        second = sglang_setup(meta, segment=64 * 1024 * 1024)
        assert second.is_exist("before-restart") == 0
        keys = [f"after{i}" for i in range(200)]
        assert second.put_batch(keys, [b"y" * 1000] * 200) == 0
        assert second.batch_is_exist(keys) == [1] * 200
        assert second.close() == 0
    finally:
        proc.kill()


def _gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie no one reaped yet counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_killed_workers_daemon_stops_with_it():
    """A worker killed outright (SIGKILL, an OOM kill) cannot stop its
    daemon; the daemon sees its standard input close and stops by itself,
    so no orphan keeps memory and a place in the cluster."""
    import subprocess
    import sys

    from conftest import binary

    meta = f"127.0.0.1:{free_port()}"
    proc = Process("meta", "--listen", meta, "--admin", "")
    worker = None
    try:
        wait_for_port(meta)
        script = (
            "import time\n"
            "from mooncake.store import MooncakeDistributedStore\n"
            "s = MooncakeDistributedStore()\n"
            f"assert s.setup('localhost', 'P2PHANDSHAKE', 64 << 20, 0, 'tcp', '', '{meta}') == 0\n"
            "print(s._daemon._proc.pid, flush=True)\n"
            "time.sleep(600)\n"
        )
        env = dict(os.environ, MOONCAKE_BIN=binary())
        worker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, text=True)
        daemon = int(worker.stdout.readline())
        assert not _gone(daemon)
        worker.kill()
        worker.wait(timeout=10)
        deadline = time.monotonic() + 30
        while not _gone(daemon) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(daemon), "the daemon outlived its worker"
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
        proc.kill()
