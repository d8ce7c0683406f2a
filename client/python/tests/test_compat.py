"""`mooncake.store.MooncakeDistributedStore` used as Mooncake's public
documentation (docs/source/python-api-reference/mooncake-store.md in the
Mooncake project) describes it: the same calls, the same return values."""

from __future__ import annotations

import contextlib
import json
import os
import threading

import numpy as np
import pytest

from mooncake._numa import node_cpus, parse_cpu_list, preferred_node
from mooncake.store import (
    MooncakeDistributedStore,
    ObjectDataType,
    ReplicateConfig,
    bind_to_numa_node,
)

from conftest import Process, free_port, single_host_store, wait_for_daemon, wait_for_port

OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706


@pytest.fixture
def store(store):  # noqa: F811 - the session store's meta address
    s = MooncakeDistributedStore()
    # The documented positional form; a segment size of 0 contributes no
    # memory (the store's daemon holds the blocks).
    assert s.setup("localhost", "http://localhost:8080/metadata", 0, 128 * 1024 * 1024,
                   "tcp", "", store) == 0
    yield s
    s.remove_all(force=True)
    assert s.close() == 0


def test_hello_world(store):
    assert store.put("hello_key", b"Hello, Mooncake Store!") == 0
    assert store.get("hello_key").decode() == "Hello, Mooncake Store!"


def test_get_put_with_numpy_arrays(store):
    store.put("config", b'{"model": "llama-7b", "temperature": 0.7}')
    weights = np.random.randn(1000, 1000).astype(np.float32)
    store.put("weights", weights.tobytes())
    config = json.loads(store.get("config").decode())
    back = np.frombuffer(store.get("weights"), dtype=np.float32).reshape(1000, 1000)
    assert config["model"] == "llama-7b"
    assert np.array_equal(back, weights)
    assert store.is_exist("config") == 1
    assert store.is_exist("nothing-here") == 0


def test_zero_copy_workflow(store):
    original = np.random.randn(1000, 1000).astype(np.float32)
    ptr, size = original.ctypes.data, original.nbytes
    assert store.register_buffer(ptr, size) == 0
    assert store.put_from("large_tensor", ptr, size) == 0
    retrieved = np.empty((1000, 1000), dtype=np.float32)
    recv_ptr = retrieved.ctypes.data
    assert store.register_buffer(recv_ptr, retrieved.nbytes) == 0
    assert store.get_into("large_tensor", recv_ptr, retrieved.nbytes) == size
    assert np.array_equal(original, retrieved)
    assert store.unregister_buffer(ptr) == 0
    assert store.unregister_buffer(recv_ptr) == 0


def test_batch_zero_copy_as_kv_connectors_use_it(store):
    block, n = 256 << 10, 16
    arena = np.random.default_rng(1).integers(0, 255, n * block, dtype=np.uint8)
    base = arena.ctypes.data
    assert store.register_buffer(base, arena.nbytes) == 0
    keys = [f"layer0/block{i}" for i in range(n)]
    ptrs = [base + i * block for i in range(n)]
    assert store.batch_put_from(keys, ptrs, [block] * n) == [0] * n
    expected = arena.copy()
    arena[:] = 0
    spare = np.zeros(block, dtype=np.uint8)
    assert store.register_buffer(spare.ctypes.data, block) == 0
    got = store.batch_get_into(
        keys + ["missing"], ptrs + [spare.ctypes.data], [block] * (n + 1)
    )
    assert got == [block] * n + [OBJECT_NOT_FOUND]
    assert np.array_equal(arena, expected)
    assert not spare.any(), "a miss writes nothing"
    assert store.unregister_buffer(base) == 0


def test_batch_operations_existence_size_and_removal(store):
    keys = ["key1", "key2", "key3"]
    values = [b"value1", b"value2", b"value3"]
    assert store.put_batch(keys, values) == 0
    assert store.get_batch(keys) == values
    assert store.batch_is_exist(keys + ["key4"]) == [1, 1, 1, 0]
    assert store.batch_probe_key(["key4", "key2"]) == [0, 1]
    assert store.get_size("key1") == 6
    assert store.get_size("key4") < 0
    assert store.get("key4") == b""
    # Forced: batch_is_exist leased them (test_a_lease_refuses_...).
    assert store.remove("key1", force=True) == 0
    assert store.remove("key1", force=True) == OBJECT_NOT_FOUND
    assert store.batch_remove(["key2", "key9"], force=True) == [0, OBJECT_NOT_FOUND]
    assert store.put_parts("greeting", b"Hello, ", b"World!") == 0
    assert store.get("greeting") == b"Hello, World!"
    assert store.remove_all(force=True) == 2  # key3 and greeting


@contextlib.contextmanager
def leasing_ten_minutes(tmp_path, dram: str):
    """A client of a store of its own (`dram` of pool) whose leases last 10
    minutes, so that no lease ends during a test."""
    config = tmp_path / "store.toml"
    config.write_text('[daemon]\nkv_lease_ttl = "10m"\n')
    with single_host_store(dram, "--config", str(config)) as meta:
        s = MooncakeDistributedStore()
        assert s.setup("localhost", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", meta) == 0
        yield s
        assert s.close() == 0


def test_a_lease_refuses_a_removal_without_force_as_in_mooncake(tmp_path):
    # Mooncake's master refuses Remove while a lease (granted by ExistKey,
    # batch_is_exist) has not run out (OBJECT_HAS_LEASE), and RemoveAll
    # skips such objects; force removes them.
    with leasing_ten_minutes(tmp_path, "64MiB") as s:
        for name in ("leased", "probed", "other", "spare"):
            assert s.put(name, name.encode() * 100) == 0
        assert s.batch_is_exist(["leased"]) == [1]
        assert s.batch_probe_key(["probed"]) == [1]
        assert s.remove("leased") == OBJECT_HAS_LEASE
        assert s.batch_remove(["leased", "probed", "nothing"]) == [OBJECT_HAS_LEASE, 0, OBJECT_NOT_FOUND]
        assert s.get("leased") == b"leased" * 100, "refused, yet gone"
        assert s.remove_all() == 2  # other and spare
        assert s.batch_probe_key(["leased", "other"]) == [1, 0]
        assert s.remove("leased", force=True) == 0
        assert s.get("leased") == b""
        assert s.put("leased", b"again") == 0 and s.is_exist("leased") == 1
        assert s.remove_all(force=True) == 1


def test_batch_is_exist_leases_what_it_finds_and_batch_probe_key_does_not(tmp_path):
    # As in Mooncake: what a lookup finds stays until the engine loads it
    # (for the daemon's kv_lease_ttl, Mooncake's default_kv_lease_ttl),
    # however many puts come in between; a probe leases nothing.
    with leasing_ten_minutes(tmp_path, "4MiB") as s:
        block = 256 << 10
        for name in ("leased", "probed", "unasked"):
            assert s.put(name, name[0].encode() * block) == 0
        assert s.batch_is_exist(["leased", "nothing"]) == [1, 0]
        assert s.batch_probe_key(["probed"]) == [1]
        # Four pools' worth of newer blocks, none read again.
        for i in range(64):
            assert s.put(f"filler-{i}", b"f" * block) == 0
        assert s.get("leased") == b"l" * block
        # Evicted: the daemons say so, whatever the index has heard yet.
        assert s.batch_is_exist(["probed", "unasked", "leased"]) == [0, 0, 1]
        assert s.get("probed") == b""


def test_replicate_config_is_accepted_and_hard_pin_pins(store):
    config = ReplicateConfig()
    config.replica_num = 2
    config.with_hard_pin = True
    assert store.put("important_data", b"Critical information", config) == 0
    assert store.get("important_data") == b"Critical information"


def test_a_put_may_say_what_its_object_holds_as_vllms_encoder_cache_does(store):
    # Mooncake's values, which its master keeps per object.
    assert [int(t) for t in (ObjectDataType.UNKNOWN, ObjectDataType.KVCACHE,
                             ObjectDataType.TENSOR, ObjectDataType.GENERAL)] == [0, 1, 2, 9]
    config = ReplicateConfig()
    assert config.data_type == ObjectDataType.UNKNOWN
    config.data_type = ObjectDataType.TENSOR
    assert store.put("an_embedding", b"\x01" * 4096, config) == 0
    assert store.get("an_embedding") == b"\x01" * 4096
    with pytest.raises(AttributeError):
        config.no_such_field = 1


def in_thread(fn):
    """What ``fn`` returns when run on a thread of its own, so that the
    binding it makes ends with that thread."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_binding_to_a_numa_node_runs_the_thread_there_and_prefers_its_memory():
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    with pytest.raises(ValueError):
        parse_cpu_list("3-1")
    cpus = node_cpus(0)
    assert cpus, "every Linux machine has node 0"

    def bound():
        bind_to_numa_node(0)
        return os.sched_getaffinity(0), preferred_node()

    assert in_thread(bound) == (cpus, 0)


def test_binding_to_a_node_the_machine_lacks_changes_nothing(caplog):
    def bound():
        before = os.sched_getaffinity(0), preferred_node()
        bind_to_numa_node(4095)
        return before, (os.sched_getaffinity(0), preferred_node())

    before, after = in_thread(bound)
    assert before == after
    assert "no NUMA node 4095" in caplog.text


def test_setup_with_a_dict_and_a_contributed_segment():
    # A meta service alone: the client contributes its segment (an
    # embedded daemon of global_segment_size), and blocks land there.
    meta = f"127.0.0.1:{free_port()}"
    proc = Process("meta", "--listen", meta, "--admin", "")
    try:
        wait_for_port(meta)
        s = MooncakeDistributedStore()
        assert s.setup({
            "local_hostname": "localhost",
            "metadata_server": "P2PHANDSHAKE",
            "global_segment_size": 64 * 1024 * 1024,
            "local_buffer_size": 0,
            "protocol": "tcp",
            "device_name": "",
            "master_server_address": meta,
        }) == 0
        assert s.get_hostname().startswith("127.0.0.1:")
        wait_for_daemon(meta)
        assert s.put("mine", b"in my own segment") == 0
        assert s.get("mine") == b"in my own segment"
        assert s.close() == 0
    finally:
        proc.kill()


def test_calls_before_setup_fail_loudly_and_bad_setup_returns_a_code():
    s = MooncakeDistributedStore()
    with pytest.raises(RuntimeError, match="setup"):
        s.put("k", b"v")
    assert s.setup("localhost", "", 0, 0, "tcp", "", f"127.0.0.1:{free_port()}") < 0
