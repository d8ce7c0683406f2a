"""SGLang's multimodal embedding store (`MooncakeEmbeddingStore`),
unchanged, on this store.

With `--enable-mm-global-cache` SGLang's encoder servers share vision and
audio embeddings between nodes by content hash, through the backend that
`EmbeddingStoreFactory.create_backend("mooncake")` makes: it sets up
`mooncake.store` from SGLang's `MOONCAKE_*` environment, registers the
embedding pool (`register_buffer` of the pool tensor), and moves an
embedding as the pool pages it spans (`batch_put_from_multi_buffers`,
skipping hashes `batch_is_exist` finds; `batch_get_into_multi_buffers`),
or as one buffer (`batch_put` / `batch_get`). This driver makes the backend
through SGLang's factory and calls it as SGLang's `EmbeddingCacheController`
does, on a CPU pool: embeddings written from some pages come back into
others byte for byte, a second put of the same hashes stores nothing new,
and hashes never put are misses. Run by `tools/test-engines.sh`.

Usage: python sglang_embedding.py META_ADDR
"""

from __future__ import annotations

import os
import sys

import torch

DIM = 1152  # a vision tower's hidden size
PAGE_TOKENS = 16
PAGES = 64
DTYPE = torch.bfloat16


def pages_of(pool: torch.Tensor, first: int, count: int) -> tuple[list[int], list[int]]:
    """The pointers and sizes of `count` pool pages from `first`: an
    embedding's pieces as SGLang's controller passes them."""
    page_bytes = pool[0].numel() * pool.element_size()
    return ([pool[p].data_ptr() for p in range(first, first + count)], [page_bytes] * count)


def main(meta: str) -> None:
    os.environ.update({
        "MOONCAKE_MASTER": meta,
        "MOONCAKE_PROTOCOL": "tcp",
        "MOONCAKE_DEVICE": "",
        "MOONCAKE_TE_META_DATA_SERVER": "P2PHANDSHAKE",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "0",
    })
    from sglang.srt.mem_cache.embedding_store import EmbeddingStoreFactory

    store = EmbeddingStoreFactory.create_backend("mooncake")
    pool = torch.zeros(PAGES, PAGE_TOKENS, DIM, dtype=DTYPE)
    store.register_buffer(pool)
    gen = torch.Generator().manual_seed(3)

    # Embeddings of 1 to 8 pages, written into the first half of the pool.
    spans = {f"img-{os.getpid()}-{i}": n for i, n in enumerate([1, 3, 8, 2, 5])}
    first, placed = 0, {}
    for mm_hash, n in spans.items():
        pool[first:first + n] = torch.randn(n, PAGE_TOKENS, DIM, generator=gen).to(DTYPE)
        placed[mm_hash] = (first, n)
        first += n
    hashes = list(spans)
    assert store.batch_is_exist(hashes) == [False] * len(hashes)
    ptrs, sizes = zip(*(pages_of(pool, *placed[h]) for h in hashes))
    assert store.batch_put_from_multi_buffers(hashes, list(ptrs), list(sizes)) == [True] * len(hashes)
    assert store.batch_is_exist(hashes + ["img-never"]) == [True] * len(hashes) + [False]
    # Put again: found, skipped, reported stored.
    assert store.batch_put_from_multi_buffers(hashes, list(ptrs), list(sizes)) == [True] * len(hashes)

    # Read into the other half of the pool, page by page.
    half, back = PAGES // 2, {}
    for mm_hash in hashes:
        back[mm_hash] = (half, spans[mm_hash])
        half += spans[mm_hash]
    ptrs, sizes = zip(*(pages_of(pool, *back[h]) for h in hashes))
    assert store.batch_get_into_multi_buffers(hashes, list(ptrs), list(sizes)) == [True] * len(hashes)
    for mm_hash in hashes:
        (a, n), (b, _) = placed[mm_hash], back[mm_hash]
        assert torch.equal(pool[a:a + n].view(torch.int16), pool[b:b + n].view(torch.int16)), mm_hash
    print(f"embeddings put from pool pages and read back into others: {len(hashes)}, "
          f"{sum(spans.values())} pages of {PAGE_TOKENS} tokens, byte for byte")

    # One buffer an embedding (`batch_put` / `batch_get`), and misses.
    one = f"img-{os.getpid()}-whole"
    src, dst = pages_of(pool, 0, 1), pages_of(pool, PAGES - 2, 2)
    assert store.batch_put([one], src[0], src[1]) == [True]
    assert store.batch_get([one, "img-never"], dst[0], dst[1]) == [True, False]
    assert torch.equal(pool[0].view(torch.int16), pool[PAGES - 2].view(torch.int16))
    missed = pages_of(pool, PAGES - 1, 1)
    assert store.batch_get_into_multi_buffers(["img-never"], [missed[0]], [missed[1]]) == [False]
    print("one-buffer embeddings read back; hashes never put are misses")


if __name__ == "__main__":
    main(sys.argv[1])
