"""What the vLLM drivers share: a small Llama-shaped model (its config.json
only: no weights, no tokenizer), the KV cache configuration vLLM derives
for it, and a stand-in for the model runner's KV writes: for each token,
KV bytes that depend on the token and all tokens before it, so that what a
connector loads is checked byte for byte against what the model would
have computed.

KV caches are in vLLM's layout: per layer (blocks, KV heads, block size,
K and V).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import zlib
from pathlib import Path

import torch

from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

BLOCK, LAYERS, HEADS, DIM, BLOCKS = 16, 2, 2, 16, 96
EOS = 2
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]

MODEL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HEADS * DIM * 2,
    "intermediate_size": 128, "num_attention_heads": HEADS * 2, "num_key_value_heads": HEADS,
    "num_hidden_layers": LAYERS, "vocab_size": 1000, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": EOS,
}


def model_dir() -> str:
    """A folder with the model's config.json, as vLLM reads a model."""
    folder = tempfile.mkdtemp(prefix="vllm-model-")
    Path(folder, "config.json").write_text(json.dumps(MODEL))
    return folder


def kv_cache_config(heads: int = HEADS) -> KVCacheConfig:
    """The KV cache configuration of a rank holding `heads` KV heads."""
    return KVCacheConfig(
        num_blocks=BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                LAYER_NAMES,
                FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=DIM, dtype=torch.float16),
            )
        ],
    )


def kv_caches(heads: int = HEADS) -> dict[str, torch.Tensor]:
    """One rank's paged KV cache, a tensor per layer."""
    return {name: torch.zeros(BLOCKS, heads, BLOCK, 2 * DIM, dtype=torch.float16) for name in LAYER_NAMES}


def expected(tokens: list[int], pos: int, layer: int, heads: range) -> torch.Tensor:
    """K and V (heads, 2 * head size) of token `pos` in `layer` for the KV
    heads `heads` (a tensor-parallel rank holds a range of them): a
    function of the head and every token up to `pos`, as a model's would
    be; small integers, exact in float16."""
    seed = zlib.crc32(repr((layer, tokens[: pos + 1])).encode())
    head = torch.tensor(list(heads), dtype=torch.int64).view(-1, 1)
    k = (torch.arange(DIM, dtype=torch.int64) * 7 + head * 131 + seed) % 2039
    return torch.cat([k, (k + 1) % 2039], dim=1).to(torch.float16)


def write_kv(caches: dict[str, torch.Tensor], heads: range, tokens: list[int], blocks: list[int], start: int, n: int):
    """A rank's forward pass: the KV of tokens `start` to `start + n` into
    the slots of `blocks`."""
    for pos in range(start, start + n):
        for layer, cache in enumerate(caches.values()):
            cache[blocks[pos // BLOCK], :, pos % BLOCK] = expected(tokens, pos, layer, heads)


def check_kv(caches: dict[str, torch.Tensor], heads: range, tokens: list[int], blocks: list[int], upto: int):
    """Fails unless a rank holds the model's KV for tokens before `upto`."""
    for pos in range(upto):
        for layer, cache in enumerate(caches.values()):
            if not torch.equal(cache[blocks[pos // BLOCK], :, pos % BLOCK], expected(tokens, pos, layer, heads)):
                raise AssertionError(f"token {pos} of layer {layer}, KV heads {heads.start}-{heads.stop - 1}, differs")


def runner_output(req_ids: list[str], **fields) -> ModelRunnerOutput:
    """A model runner's output: vLLM 0.33's also maps each request to its
    row (`req_id_to_index`), which vLLM 0.34 dropped."""
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        fields["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, **fields)


class Requests:
    """An instance's requests and the KV its ranks compute for them: a
    driver's engine calls `__init__` with its scheduler and its ranks'
    KV heads and caches, `(heads, {layer: cache})` each."""

    def __init__(self, scheduler, ranks: list[tuple[range, dict[str, torch.Tensor]]], hash_algo: str) -> None:
        self.scheduler = scheduler
        self.ranks = ranks
        self.hash_fn = get_hash_fn_by_name(hash_algo)
        init_none_hash(self.hash_fn)
        self.tokens: dict[str, list[int]] = {}

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, EOS)
        request = Request(
            request_id=req_id, prompt_token_ids=list(prompt), sampling_params=params,
            pooling_params=None, mm_features=None,
            block_hasher=get_request_block_hasher(BLOCK, self.hash_fn),
        )
        self.scheduler.add_request(request)
        self.tokens[req_id] = list(prompt)
        return request

    def slots(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def forward(self, req_id: str, start: int, n: int) -> None:
        """Writes the KV of tokens `start` to `start + n` on every rank."""
        for heads, caches in self.ranks:
            write_kv(caches, heads, self.tokens[req_id], self.slots(req_id), start, n)

    def check(self, req_id: str, upto: int) -> None:
        """Fails unless every rank holds the model's KV for tokens before `upto`."""
        for heads, caches in self.ranks:
            try:
                check_kv(caches, heads, self.tokens[req_id], self.slots(req_id), upto)
            except AssertionError as e:
                raise AssertionError(f"{req_id}: {e}") from None

    def report(self, out, starts: dict[str, int], connector_output, sample: bool = True) -> None:
        """Ends a step as the model runner does: a token sampled for each
        request whose prompt (or last token) the step finished (none when
        `sample` is false: vLLM drops what a step with failed loads
        computed), and the output handed to the scheduler."""
        req_ids = list(out.num_scheduled_tokens)
        sampled = [
            self.sampled(r, sample and starts[r] + out.num_scheduled_tokens[r] >= self.scheduler.requests[r].num_tokens)
            for r in req_ids
        ]
        result = runner_output(
            req_ids,
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=connector_output,
        )
        self.scheduler.update_from_output(out, result)

    def sampled(self, req_id: str, done: bool) -> list[int]:
        """The token a step samples for a request: one when its last
        scheduled token was its last known one (a function of its tokens)."""
        if not done:
            return []
        token = (sum(self.tokens[req_id]) % 900) + 10
        self.tokens[req_id].append(token)
        return [token]
