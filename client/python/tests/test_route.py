"""The router's question from Python: how much of a request's prefix each
host holds, and the cheapest host under the documented cost."""

from __future__ import annotations

import mooncake_store
import pytest


def test_route_answers_the_prefix_per_host_and_the_cheapest(client):
    chain = mooncake_store.block_hashes(list(range(80)), 16)
    assert len(chain) == 5
    assert client.put_batch(chain[:3], [b"k" * 1000] * 3) == [0] * 3

    answer = client.route(chain)
    assert (answer["blocks"], answer["matched"]) == (5, 3)
    (host,) = answer["hosts"]
    assert (host["leading"], host["held"], host["daemons"]) == (3, 3, 1)
    assert host["instance"] == "", "no instances configured"

    assert host["cost"] == pytest.approx(2.0), "two blocks to prefill, none to move"
    assert answer["best"] == host["node"]

    # A host with no daemon, asked by name, holds nothing: the three
    # blocks would move there at 0.5 each.
    other = client.route(chain, candidates=["elsewhere"], transfer_cost=0.5)
    (elsewhere,) = other["hosts"]
    assert (elsewhere["daemons"], elsewhere["held"]) == (0, 0)
    assert elsewhere["cost"] == pytest.approx(2.0 + 3 * 0.5)

    # A queue at the holder tips the choice to the empty host.
    queued = client.route(chain, queues={host["node"]: 2, "elsewhere": 0})
    costs = {h["node"]: h["cost"] for h in queued["hosts"]}
    assert costs == pytest.approx({host["node"]: 4.0, "elsewhere": 2.3})
    assert queued["best"] == "elsewhere"

    with pytest.raises(ValueError):
        client.route(chain, transfer_cost=-1)
