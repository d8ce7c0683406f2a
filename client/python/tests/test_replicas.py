"""Copies on several hosts through the Python SDK and the compatible API:
a meta service and three daemons, each on a `--node` of its own."""

from __future__ import annotations

import time

import pytest

import mooncake_store
from mooncake.store import MooncakeDistributedStore, ReplicateConfig

from conftest import Process, free_port, wait_for_daemon, wait_for_port


@pytest.fixture
def three_hosts():
    """The meta address, and the daemons by data address."""
    meta = f"127.0.0.1:{free_port()}"
    procs = [Process("meta", "--listen", meta, "--admin", "")]
    daemons = {}
    try:
        wait_for_port(meta)
        for node in ["gpu-1", "gpu-2", "gpu-3"]:
            addr = f"127.0.0.1:{free_port()}"
            daemons[addr] = Process(
                "daemon", "--meta", meta, "--listen", addr, "--admin", "",
                "--dram", "16MiB", "--node", node,
            )
            procs.append(daemons[addr])
        wait_for_daemon(meta)
        # Every daemon registered: a block asked on three hosts gets three.
        probe = mooncake_store.Client(meta, namespace="t/probe")
        deadline = time.monotonic() + 15
        while True:
            probe.put("probe", b"p", replicas=3)
            (_, addrs), = probe.locations(["probe"])
            probe.remove(["probe"])
            if len(addrs) == 3:
                break
            assert time.monotonic() < deadline, "three daemons registered"
            time.sleep(0.05)
        yield meta, daemons
    finally:
        for p in procs:
            p.kill()


def test_put_with_replicas_stores_copies_that_outlive_a_host(three_hosts):
    meta, daemons = three_hosts
    c = mooncake_store.Client(meta, namespace="t/replicas")
    c.put("two", b"2" * 1000, replicas=2)
    assert c.put_batch(["three-a", "three-b"], [b"a" * 10, b"b" * 10], replicas=3) == [0, 0]
    (size, addrs), = c.locations(["two"])
    assert size == 1000 and len(set(addrs)) == 2
    assert [len(set(loc[1])) for loc in c.locations(["three-a", "three-b"])] == [3, 3]
    # Lose a host holding a copy: the other copy answers.
    daemons[addrs[0]].kill()
    assert c.get("two") == b"2" * 1000
    with pytest.raises(ValueError):
        c.put("five", b"5", replicas=5)


def test_replicate_config_replica_num_is_applied_and_replica_descriptors_list_every_copy(three_hosts):
    meta, _ = three_hosts
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", meta) == 0
    try:
        config = ReplicateConfig()
        config.replica_num = 2
        assert s.put("vllm-two", b"x" * 100, config) == 0
        config.replica_num = 9  # more than hosts and than a block's copies
        assert s.put("vllm-many", b"y" * 100, config) == 0
        assert s.put("vllm-default", b"z" * 100) == 0
        descs = s.batch_get_replica_desc(["vllm-two", "vllm-many", "vllm-default"])
        endpoints = {
            key: {d.get_memory_descriptor().buffer_descriptor.transport_endpoint for d in ds}
            for key, ds in descs.items()
        }
        assert {k: len(v) for k, v in endpoints.items()} == {
            "vllm-two": 2,
            "vllm-many": 3,
            "vllm-default": 1,
        }
        assert all(d.is_memory_replica() for ds in descs.values() for d in ds)
        assert s.remove("vllm-many") == 0
        assert s.get_replica_desc("vllm-many") == []
    finally:
        s.close()
