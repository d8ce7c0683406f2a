"""A store of a driver's own: `mooncake-store up` from MOONCAKE_BIN, on
free loopback ports, with the memory and the config a case needs (a small
pool that fills, a lease time, a drive), stopped and its files removed
when the case is done; and how a case waits for what the store holds to
change."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import mooncake_store

START_S = 30.0


_GIVEN: set[int] = set()


def free_port() -> int:
    """A port free now, and not one handed out before in this process (a
    store's two ports are picked before it binds either)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


@contextlib.contextmanager
def small_store(dram: str, config: str, drive: str | None = None):
    """`dram` of memory and `config` as its TOML (its last table
    `[daemon]`), with a drive file of `drive` bytes ("64MiB") if given;
    yields its meta address once its daemon stores blocks."""
    meta = f"127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory(prefix="mooncake-own-store-") as folder:
        if drive is not None:
            config += f'nvme = ["{Path(folder, "drive.bin")}:{drive}"]\n'
        toml = Path(folder, "store.toml")
        toml.write_text(config)
        proc = subprocess.Popen(
            [os.environ["MOONCAKE_BIN"], "up", "--meta-listen", meta, "--listen", f"127.0.0.1:{free_port()}",
             "--admin", "", "--dram", dram, "--config", str(toml)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + START_S
            while True:
                try:
                    probe = mooncake_store.Client(meta, namespace="probe", timeout=1.0)
                    probe.put("readiness", b"x")
                    probe.remove(["readiness"])
                    break
                except mooncake_store.StoreError:
                    assert time.monotonic() < deadline and proc.poll() is None, "the driver's own store did not start"
                    time.sleep(0.1)
            yield meta
        finally:
            proc.kill()
            proc.wait(timeout=10)


def replica_kinds(store, keys: list[str]) -> set[str]:
    """How each of `keys` (stored) lies now, as Mooncake's replica
    descriptors say it (vLLM's load summary reads them): "memory", or
    "disk" where only a daemon's drive holds it. `store`: a
    `MooncakeDistributedStore`."""
    descs = store.batch_get_replica_desc(keys)
    return {"disk" if descs[k][0].is_disk_replica() else "memory" for k in keys}


def eventually(check, what: str, within: float = 60.0) -> None:
    """Waits until `check()` holds (the daemons report tier moves with
    their heartbeats); fails with `what` past `within` seconds."""
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
