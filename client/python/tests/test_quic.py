"""Blocks over QUIC with mutual TLS from Python: the right certificate
round-trips bytes; no certificate gets an error and no bytes."""

from __future__ import annotations

import subprocess

import pytest

import mooncake_store

from conftest import binary, free_port, single_host_store


def test_quic_with_mutual_tls_round_trips_and_refuses_strangers(tmp_path):
    certs = tmp_path / "certs"
    subprocess.run([binary(), "certs", "--out", str(certs)], check=True, capture_output=True)
    with single_host_store(
        "64MiB",
        "--quic-listen", f"127.0.0.1:{free_port()}",
        "--tls-cert", str(certs / "daemon.pem"),
        "--tls-key", str(certs / "daemon.key"),
        "--tls-client-ca", str(certs / "ca.pem"),
    ) as meta:
        client = mooncake_store.Client(
            meta,
            namespace="t/quic",
            quic_ca=str(certs / "ca.pem"),
            quic_cert=str(certs / "client.pem"),
            quic_key=str(certs / "client.key"),
        )
        value = bytes(range(256)) * 1024
        client.put("q1", value)
        assert client.get("q1") == value

        # Without a client certificate the store refuses the connection
        # (its meta service first): an error that says so, not a miss.
        with pytest.raises(mooncake_store.StoreError, match="refused the connection"):
            mooncake_store.Client(meta, namespace="t/quic", timeout=2.0, quic_ca=str(certs / "ca.pem"))

        with pytest.raises(ValueError, match="quic_cert and quic_key go together"):
            mooncake_store.Client(meta, quic_ca=str(certs / "ca.pem"), quic_cert="x.pem")
        with pytest.raises(ValueError, match="no-such.pem"):
            mooncake_store.Client(meta, quic_ca=str(tmp_path / "no-such.pem"))
