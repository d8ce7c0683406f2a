"""vLLM's encoder-cache store (`mooncake_store_embedding`), unchanged, on
this store.

vLLM 0.33 shares multimodal encoder outputs (image and audio embeddings)
between instances through Mooncake Store: before encoding, an instance
asks which of a step's inputs the store holds (`batch_is_exist`) and loads
them into its registered read buffer (`batch_get_into`); what it had to
encode it publishes in the background, a 24-byte header and the tensor in
one object (`batch_put_from_multi_buffers` with
`ReplicateConfig.data_type = ObjectDataType.TENSOR`), registering each
tensor for the put and unregistering it after. This driver builds that
path the way vLLM does (`create_mooncake_embedding_store_client` reading
`MOONCAKE_CONFIG_PATH`, then `MooncakeEmbeddingStoreBackend`) and plays
two encoder instances on CPU tensors: the first misses and publishes, the
second finds every output, byte for byte. Then what must stay a miss: an
input whose shape differs from what was stored, one never stored, ones
removed. Run by `tools/test-engines.sh`.

Usage: python vllm_ec_store.py META_ADDR
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

from mooncake.store import MooncakeDistributedStore
from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.backend import (
    MooncakeEmbeddingStoreBackend,
)
from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.data import (
    TensorSpec,
    make_embedding_key,
)
from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.store_client import (
    create_mooncake_embedding_store_client,
)

HIDDEN = 1024
# Token counts of an image's or an audio clip's embedding, and dtypes vLLM
# encoders produce.
OUTPUTS = [(576, torch.bfloat16), (1, torch.bfloat16), (256, torch.float16), (97, torch.float32),
           (1200, torch.bfloat16), (64, torch.float16)]
READ_BUFFER = 8 << 20


def spec(tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(tuple(tensor.shape), str(tensor.dtype), tensor.nbytes)


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def backend(namespace: str) -> MooncakeEmbeddingStoreBackend:
    """An encoder instance's publisher and resolver, as vLLM builds it."""
    client = create_mooncake_embedding_store_client(read_buffer_bytes=READ_BUFFER)
    return MooncakeEmbeddingStoreBackend(
        client, namespace, max_pending_items=64, max_pending_bytes=256 << 20
    )


def main(meta: str) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        # vLLM's `standalone-store` mode: the store's daemons hold the pool.
        json.dump({"metadata_server": "P2PHANDSHAKE", "master_server_address": meta,
                   "protocol": "tcp", "device_name": "", "mode": "standalone-store",
                   "global_segment_size": 0, "local_buffer_size": "64MB"}, f)
    os.environ["MOONCAKE_CONFIG_PATH"] = f.name
    namespace = f"embedding@model:test-vl@revision:default@encoder:{os.getpid()}@dtype:bfloat16@protocol:v3"
    gen = torch.Generator().manual_seed(7)
    outputs = {
        f"mm-{i}": torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
        for i, (tokens, dtype) in enumerate(OUTPUTS)
    }
    specs = {identifier: spec(t) for identifier, t in outputs.items()}

    # The first instance finds nothing, encodes, and publishes.
    first = backend(namespace)
    cache: dict[str, torch.Tensor] = {}
    assert first.resolve_inputs(specs, cache, "cpu") == set(), "an empty store held outputs"
    for identifier, tensor in outputs.items():
        first.save_output(identifier, tensor)
    first.shutdown()  # waits for every put, then closes its client

    # A second instance, as another vLLM server would, loads them all.
    second = backend(namespace)
    cache = {}
    loaded = second.resolve_inputs(specs, cache, "cpu")
    assert loaded == set(specs), f"loaded {sorted(loaded)} of {sorted(specs)}"
    for identifier, tensor in outputs.items():
        got = cache[identifier]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, identifier
        assert raw(got) == raw(tensor), f"{identifier}: wrong bytes"
    print(f"encoder outputs published by one instance and loaded by another: {len(loaded)}, "
          f"{sum(t.nbytes for t in outputs.values()) / 2**20:.1f} MiB, byte for byte")

    # Publishing what the store holds again puts nothing and breaks nothing.
    for identifier, tensor in outputs.items():
        second.save_output(identifier, tensor)
    second.reap()

    # Misses stay misses: a shape other than the one stored (the header
    # says so), an input never stored.
    wrong = {"mm-0": TensorSpec((577, HIDDEN), "torch.bfloat16", 577 * HIDDEN * 2),
             "mm-never": TensorSpec((8, HIDDEN), "torch.bfloat16", 8 * HIDDEN * 2)}
    assert second.resolve_inputs(wrong, {}, "cpu") == set(), "a wrong shape or an unknown input loaded"
    assert second.resolve_inputs(specs, {}, "cpu") == set(specs), "a miss disturbed later loads"

    # Removed outputs are gone for every instance.
    store = MooncakeDistributedStore()
    assert store.setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", meta) == 0
    keys = [make_embedding_key(namespace, identifier) for identifier in specs]
    # Forced: the loads above looked them up (batch_is_exist, a lease of
    # 5 s), and as in Mooncake a lease refuses a removal that is not.
    assert store.batch_remove(keys, force=True) == [0] * len(keys)
    assert second.resolve_inputs(specs, {}, "cpu") == set(), "removed outputs loaded"
    assert store.close() == 0
    second.shutdown()
    os.unlink(f.name)
    print("a shape other than the stored one, an input never stored, removed outputs: misses")


if __name__ == "__main__":
    main(sys.argv[1])
