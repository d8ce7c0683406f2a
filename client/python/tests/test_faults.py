"""A daemon killed in the middle of a run: calls answer with codes or
exceptions within their deadline, the interpreter never crashes, and no
call returns wrong bytes."""

from __future__ import annotations

import time

import mooncake_store
from mooncake_store import OBJECT_NOT_FOUND, RPC_FAIL

from conftest import Process, free_port, single_host_store, wait_for_daemon


def test_a_daemon_killed_mid_run_costs_errors_never_the_interpreter():
    meta = f"127.0.0.1:{free_port()}"
    meta_proc = Process("meta", "--listen", meta, "--admin", "")
    daemon = Process(
        "daemon", "--meta", meta, "--listen", f"127.0.0.1:{free_port()}",
        "--admin", "", "--dram", "64MiB",
    )
    try:
        wait_for_daemon(meta)
        client = mooncake_store.Client(meta, namespace="t/faults", timeout=1.0)
        keys = [f"f{i}" for i in range(64)]
        values = [bytes([i]) * 65536 for i in range(64)]
        assert client.put_batch(keys, values) == [0] * 64

        outcomes = {"hit": 0, "miss": 0, "failed": 0, "raised": 0}
        slowest = 0.0
        killed_at = None
        for round_ in range(40):
            if round_ == 10:
                daemon.kill()
                killed_at = round_
            bufs = [bytearray(65536) for _ in keys]
            started = time.monotonic()
            try:
                got = client.get_into_batch(keys, bufs)
            except mooncake_store.StoreError:
                outcomes["raised"] += 1
                continue
            finally:
                slowest = max(slowest, time.monotonic() - started)
            for n, buf, value in zip(got, bufs, values):
                if n >= 0:
                    assert bytes(buf[:n]) == value, "wrong bytes returned"
                    outcomes["hit"] += 1
                elif n == OBJECT_NOT_FOUND:
                    outcomes["miss"] += 1
                else:
                    assert n == RPC_FAIL, n
                    outcomes["failed"] += 1
        assert killed_at == 10
        assert outcomes["hit"] >= 10 * 64, outcomes
        assert outcomes["failed"] + outcomes["miss"] + outcomes["raised"] > 0, outcomes
        assert slowest < 3.0, f"a call took {slowest:.2f} s with a 1 s deadline"
        # The client keeps working against the meta service.
        assert client.exists(["never"]) == [False]
    finally:
        daemon.kill()
        meta_proc.kill()


def test_same_host_reads_through_shared_memory(tmp_path):
    meta = f"127.0.0.1:{free_port()}"
    sock = tmp_path / "daemon.sock"
    proc = Process(
        "up", "--meta-listen", meta, "--listen", f"127.0.0.1:{free_port()}",
        "--admin", "", "--dram", "64MiB", "--shm-socket", str(sock),
    )
    try:
        wait_for_daemon(meta)
        client = mooncake_store.Client(meta, namespace="t/shm", shm_socket=str(sock))
        assert client.same_host_ready(timeout=10.0)
        values = [bytes([i]) * (100_000 + i) for i in range(16)]
        keys = [f"s{i}" for i in range(16)]
        assert client.put_batch(keys, values) == [0] * 16
        bufs = [bytearray(200_000) for _ in keys]
        assert client.get_into_batch(keys, bufs) == [len(v) for v in values]
        assert all(bytes(b[: len(v)]) == v for b, v in zip(bufs, values))
        assert client.shm_reads == 16
        assert client.shm_index_reads == 16, "found through the daemon's index"
        pages = client.same_host_pages()
        assert pages.startswith(("4KiB", "2MiB")), pages
        elsewhere = mooncake_store.Client(meta, namespace="t/shm")
        assert not elsewhere.same_host_ready(timeout=0.1), "no socket configured"
        assert elsewhere.same_host_pages() is None
    finally:
        proc.kill()


def test_the_compatible_setup_maps_the_same_host_pool_before_it_returns(tmp_path, monkeypatch):
    # An engine's first puts and gets must not share a core with mapping
    # the daemon's pool: setup() waits for it ($MOONCAKE_SHM_SOCKET).
    from mooncake.store import MooncakeDistributedStore

    sock = tmp_path / "daemon.sock"
    with single_host_store("256MiB", "--shm-socket", str(sock)) as meta:
        monkeypatch.setenv("MOONCAKE_SHM_SOCKET", str(sock))
        s = MooncakeDistributedStore()
        assert s.setup("localhost", "", 0, 0, "tcp", "", meta) == 0
        # No time given: true only if this process's view is mapped already.
        assert s._c.same_host_ready(timeout=0.0)
        assert s.put("k", b"v" * 100_000) == 0 and s.get("k") == b"v" * 100_000
        assert s._c.shm_reads == 1
        s.close()
