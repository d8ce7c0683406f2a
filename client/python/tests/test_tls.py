"""TLS on every TCP port, from Python: the right certificates round-trip
bytes; a plain client and a client without a certificate get an error that
says why, never a miss; and an engine's Mooncake backend runs unchanged,
its certificates taken from the environment."""

from __future__ import annotations

import contextlib
import subprocess

import pytest

import mooncake_store
from mooncake.store import MooncakeDistributedStore

from conftest import binary, single_host_store


@contextlib.contextmanager
def tls_store(tmp_path, dram: str):
    """A single-host store with mutual TLS on every port and a development
    CA; yields its meta address, the certificates' folder and a client's
    TLS arguments."""
    certs = tmp_path / "certs"
    subprocess.run([binary(), "certs", "--out", str(certs)], check=True, capture_output=True)
    ca = str(certs / "ca.pem")
    tls = {
        "tls_ca": ca,
        "tls_cert": str(certs / "client.pem"),
        "tls_key": str(certs / "client.key"),
    }
    with single_host_store(
        dram,
        "--tls",
        "--tls-cert", str(certs / "daemon.pem"),
        "--tls-key", str(certs / "daemon.key"),
        "--tls-client-ca", ca,
        "--peer-ca", ca,
        client_args=tls,
    ) as meta:
        yield meta, certs, tls


def test_tls_round_trips_and_refuses_plain_clients_and_strangers(tmp_path, monkeypatch):
    with tls_store(tmp_path, "64MiB") as (meta, certs, tls):
        ca = tls["tls_ca"]
        client = mooncake_store.Client(meta, namespace="t/tls", **tls)
        value = bytes(range(256)) * 1024
        client.put("s1", value)
        assert client.get("s1") == value

        # A client that speaks plain TCP is told what the port wants.
        with pytest.raises(mooncake_store.StoreError, match="speaks TLS only"):
            mooncake_store.Client(meta, namespace="t/tls", timeout=2.0)
        # Without a client certificate (mutual TLS) it is refused.
        with pytest.raises(mooncake_store.StoreError, match="refused the connection"):
            mooncake_store.Client(meta, namespace="t/tls", timeout=2.0, tls_ca=ca)
        with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
            mooncake_store.Client(meta, tls_ca=ca, tls_cert="x.pem")
        with pytest.raises(ValueError, match="no-such.pem"):
            mooncake_store.Client(meta, tls_ca=str(tmp_path / "no-such.pem"))

        # An engine's Mooncake backend, unchanged: the certificates come
        # from the environment.
        monkeypatch.setenv("MOONCAKE_TLS_CA", tls["tls_ca"])
        monkeypatch.setenv("MOONCAKE_TLS_CERT", tls["tls_cert"])
        monkeypatch.setenv("MOONCAKE_TLS_KEY", tls["tls_key"])
        store = MooncakeDistributedStore()
        assert store.setup("localhost", "P2PHANDSHAKE", 0, 16 * 1024 * 1024, "tcp", "", meta) == 0
        assert store.put("engine-key", value) == 0
        assert store.get("engine-key") == value
        assert store.close() == 0


def test_the_daemon_an_engine_starts_beside_itself_speaks_tls_on_a_tls_cluster(tmp_path, monkeypatch):
    """An engine that contributes memory (`global_segment_size` > 0) on a
    TLS cluster: the daemon it starts gets its certificate from the
    environment and joins; without one, setup says what is missing."""
    with tls_store(tmp_path, "16MiB") as (meta, certs, tls):
        ca = tls["tls_ca"]
        monkeypatch.setenv("MOONCAKE_TLS_CA", ca)
        monkeypatch.setenv("MOONCAKE_TLS_CERT", tls["tls_cert"])
        monkeypatch.setenv("MOONCAKE_TLS_KEY", tls["tls_key"])
        store = MooncakeDistributedStore()
        assert store.setup("localhost", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", meta) != 0, \
            "no daemon certificate: refused"
        monkeypatch.setenv("MOONCAKE_DAEMON_TLS_CERT", str(certs / "daemon.pem"))
        monkeypatch.setenv("MOONCAKE_DAEMON_TLS_KEY", str(certs / "daemon.key"))
        store = MooncakeDistributedStore()
        assert store.setup("localhost", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", meta) == 0
        try:
            own = store.get_hostname()
            client = mooncake_store.Client(meta, namespace="default", **tls)
            # 48 MiB: more than the store's own 16 MiB daemon holds, so the
            # daemon started here (64 MiB) takes blocks too.
            value = bytes(range(256)) * 4096
            keys = [f"tls-seg-{i}" for i in range(48)]
            for k in keys:
                assert store.put(k, value) == 0
            places = {addr for loc in client.locations(keys) if loc for addr in loc[1]}
            assert own in places, f"{own} holds blocks: {places}"
            for k in keys:
                got = store.get(k)
                assert got in (value, b""), "a block read back is the block put"
            assert any(store.get(k) == value for k in keys)
        finally:
            assert store.close() == 0
