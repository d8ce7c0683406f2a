"""A store that requires tokens: the client authenticates with `token=`
(or $MOONCAKE_TOKEN), uses its tenant's namespaces, and is refused with
`StoreError` anywhere else."""

from __future__ import annotations

import json
import subprocess

import pytest

import mooncake_store

from conftest import Process, binary, free_port, wait_for_port


def new_token(name: str, role: str, tenant: str | None = None) -> tuple[str, str]:
    args = [binary(), "token", "new", "--json", "--name", name, "--role", role]
    if tenant:
        args += ["--tenant", tenant]
    v = json.loads(subprocess.run(args, check=True, capture_output=True).stdout)
    entry = f'[[tokens]]\nname = "{name}"\nsha256 = "{v["sha256"]}"\nrole = "{role}"\n'
    if tenant:
        entry += f'tenant = "{tenant}"\n'
    return v["token"], entry


def test_tokens_bind_clients_to_their_tenant(tmp_path, monkeypatch):
    acme, acme_entry = new_token("acme", "client", "acme")
    cluster, cluster_entry = new_token("storage", "cluster")
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(acme_entry + cluster_entry)
    meta = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("MOONCAKE_TOKEN", cluster)
    procs = [Process("meta", "--listen", meta, "--admin", "", "--auth", str(tokens))]
    try:
        wait_for_port(meta)
        procs.append(Process(
            "daemon", "--meta", meta, "--listen", f"127.0.0.1:{free_port()}",
            "--admin", "", "--dram", "16MiB", "--auth", str(tokens),
        ))
        monkeypatch.delenv("MOONCAKE_TOKEN")
        with pytest.raises(mooncake_store.StoreError, match="unauthorized"):
            mooncake_store.Client(meta)
        client = mooncake_store.Client(meta, namespace="acme/llama", token=acme)
        for _ in range(100):
            try:
                client.put("k", b"acme's block")
                break
            except mooncake_store.StoreError:
                import time
                time.sleep(0.05)
        assert client.get("k") == b"acme's block"
        other = client.with_namespace("globex")
        with pytest.raises(mooncake_store.StoreError, match="unauthorized"):
            other.get("k")
        assert other.put_batch(["k"], [b"x"]) == [mooncake_store.ILLEGAL_CLIENT]
    finally:
        for p in procs:
            p.kill()
