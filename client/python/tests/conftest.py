"""A real store for the tests: the `mooncake-store` binary, started on free
loopback ports and stopped afterwards."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

import pytest

import mooncake_store

REPO = Path(__file__).resolve().parents[3]


def binary() -> str:
    if "MOONCAKE_BIN" in os.environ:
        return os.environ["MOONCAKE_BIN"]
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    for profile in ("debug", "release"):
        path = target / profile / "mooncake-store"
        if path.exists():
            return str(path)
    raise RuntimeError("build the CLI first (cargo build), or set MOONCAKE_BIN")


# Ports handed to the stores the tests start: below the kernel's ephemeral
# range (32768 and up), so that no outgoing connection takes one between
# its pick and the store's bind, at random, and free for TCP and UDP (QUIC)
# alike, as the Rust tests pick them (tools/tests/common/mod.rs).
TEST_PORTS = range(20_000, 32_000)


_GIVEN: set[int] = set()


def free_port() -> int:
    """A port free now and never handed out before in this process: a
    store's ports are all picked before any of its servers binds."""
    while True:
        port = random.choice(TEST_PORTS)
        if port in _GIVEN:
            continue
        with socket.socket() as tcp, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            try:
                tcp.bind(("127.0.0.1", port))
                udp.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port


class Process:
    """A store process, killed when the test is done with it."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen(
            [binary(), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def wait_for_port(addr: str, timeout: float = 10.0) -> None:
    host, port = addr.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nothing listens on {addr}")


def wait_for_daemon(meta: str, timeout: float = 15.0, **client_args) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            client = mooncake_store.Client(meta, timeout=1.0, **client_args)
            client.put("readiness-probe", b"x")
            client.remove(["readiness-probe"])
            return
        except mooncake_store.StoreError:
            time.sleep(0.05)
    raise RuntimeError(f"no store answered at {meta}")


@contextlib.contextmanager
def single_host_store(dram: str, *extra: str, client_args: Optional[dict] = None):
    """`mooncake-store up` on free ports with `extra` arguments; yields the
    meta address once its daemon stores blocks (for a client made with
    `client_args`), and stops it after."""
    meta = f"127.0.0.1:{free_port()}"
    proc = Process(
        "up",
        "--meta-listen", meta,
        "--listen", f"127.0.0.1:{free_port()}",
        "--admin", "",
        "--dram", dram,
        *extra,
    )
    try:
        wait_for_daemon(meta, **(client_args or {}))
        yield meta
    finally:
        proc.kill()


@pytest.fixture(scope="session")
def store() -> str:
    """The meta address of a single-host store with 512 MiB of DRAM."""
    with single_host_store("512MiB") as meta:
        yield meta


@pytest.fixture
def client(store: str, request: pytest.FixtureRequest) -> mooncake_store.Client:
    """A client in a namespace of its own (one per test)."""
    name = "t/" + request.node.name.replace("[", ".").replace("]", "")[:100]
    c = mooncake_store.Client(store, namespace=name)
    yield c
    c.remove_all()
