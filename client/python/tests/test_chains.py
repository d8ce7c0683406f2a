"""Blocks published as a chain are evicted from the chain's tail: the
prefix other requests match survives a full pool."""

from __future__ import annotations

import time

import mooncake_store
import pytest

from conftest import single_host_store


def test_a_full_pool_evicts_a_chain_from_its_tail():
    with single_host_store("1MiB") as meta:
        client = mooncake_store.Client(meta, namespace="t/chains")
        block = 256 << 10  # five of them: one more than the pool holds
        chain = mooncake_store.block_hashes(list(range(48)), 16)
        values = [bytes([i]) * block for i in range(3)]
        assert client.put_chain(chain, values) == [0, 0, 0]
        # Two more blocks overflow the pool: plain LRU would evict the
        # chain's head (its coldest block) and strand the rest.
        assert client.put_batch(["other-1", "other-2"], [b"x" * block, b"y" * block]) == [0, 0]
        deadline = time.monotonic() + 5
        while client.exists(chain) != [True, True, False] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.exists(chain) == [True, True, False]
        assert client.match_prefix(chain) == 2
        assert client.get(chain[0]) == values[0]


def test_put_chain_extends_a_given_parent(client):
    chain = mooncake_store.block_hashes(list(range(64)), 16)
    assert client.put_chain(chain[:2], [b"a", b"b"]) == [0, 0]
    assert client.put_chain(chain[2:], [b"c", b"d"], parent=chain[1]) == [0, 0]
    assert client.match_prefix(chain) == 4


def test_a_chain_of_blocks_made_of_pieces_is_evicted_from_its_tail():
    """`put_from_ptr_lists(chain=True)`, as the native SGLang backend writes
    a request's pages (K and V pieces each), keeps the chain's head."""
    import numpy as np

    with single_host_store("1MiB") as meta:
        client = mooncake_store.Client(meta, namespace="t/chains-pieces")
        half = 128 << 10
        pool = np.arange(6 * half, dtype=np.uint32).view(np.uint8)[: 6 * half].copy()
        client.register_buffer(pool.ctypes.data, pool.nbytes)
        base = pool.ctypes.data
        chain = mooncake_store.block_hashes(list(range(48)), 16)
        ptrs = [[base + (2 * i) * half, base + (2 * i + 1) * half] for i in range(3)]
        sizes = [[half, half]] * 3
        assert client.put_from_ptr_lists(chain[:1], ptrs[:1], sizes[:1], chain=True) == [0]
        assert client.put_from_ptr_lists(chain[1:], ptrs[1:], sizes[1:], chain=True,
                                         parent=chain[0]) == [0, 0]
        with pytest.raises(ValueError, match="chain"):
            client.put_from_ptr_lists(chain[:1], ptrs[:1], sizes[:1], parent=chain[0])
        assert client.put_batch(["other-1", "other-2"], [b"x" * 2 * half, b"y" * 2 * half]) == [0, 0]
        deadline = time.monotonic() + 5
        while client.exists(chain) != [True, True, False] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.match_prefix(chain) == 2
        assert client.get(chain[1]) == pool[2 * half : 4 * half].tobytes()


def test_a_leased_match_keeps_its_chain_through_a_full_pool(tmp_path):
    """`match_prefix(lease=True)`, as the native connectors check a prefix
    before they load it: the chain it matched stays while newer blocks
    fill the pool many times over; an unleased one goes. A key evicted
    since the index answered ends a leased match (the daemon says so)."""
    config = tmp_path / "store.toml"
    config.write_text('[daemon]\nkv_lease_ttl = "10m"\n')
    with single_host_store("4MiB", "--config", str(config)) as meta:
        client = mooncake_store.Client(meta, namespace="t/leased-chain")
        block = 256 << 10
        leased = mooncake_store.block_hashes(list(range(48)), 16)
        other = mooncake_store.block_hashes(list(range(100, 148)), 16)
        assert client.put_chain(leased, [bytes([i]) * block for i in range(3)]) == [0, 0, 0]
        assert client.put_chain(other, [b"o" * block] * 3) == [0, 0, 0]
        assert client.match_prefix(leased, lease=True) == 3
        assert client.match_prefix(other) == 3
        for i in range(64):
            client.put(f"filler-{i}", b"f" * block)
        assert client.match_prefix(leased, lease=True) == 3
        assert [client.get(h) for h in leased] == [bytes([i]) * block for i in range(3)]
        assert client.match_prefix(other, lease=True) == 0
        assert client.exists(other, lease=True) == [False] * 3
