"""Batches of paged sequences with shared prefixes, and checks of what came back."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hurray_store import KVSpec, PagedKVPool


def spec(**kw: object) -> KVSpec:
    base: dict = dict(
        model="test-model",
        num_layers=3,
        num_kv_heads=2,
        head_dim=8,
        page_size=4,
        dtype=torch.float16,
    )
    base.update(kw)
    return KVSpec(**base)


def random_pool(sp: KVSpec, num_blocks: int = 256, seed: int = 0) -> PagedKVPool:
    pool = PagedKVPool(sp, num_blocks)
    g = torch.Generator().manual_seed(seed)
    for layer in pool.layers:
        layer.copy_(torch.randn(layer.shape, generator=g).to(layer.dtype))
    return pool


@dataclass
class Batch:
    tokens: list[list[int]]
    tables: list[list[int]]


def shared_batch(pool: PagedKVPool, prefix: list[int], tails: list[list[int]]) -> Batch:
    """Sequences ``prefix + tail``; the prefix's full pages are shared in the pool."""
    P = pool.spec.page_size
    n_shared = len(prefix) // P
    shared = pool.allocate(n_shared)
    tokens, tables = [], []
    for tail in tails:
        toks = prefix + tail
        own = -(-len(toks) // P) - n_shared
        tables.append(shared + pool.allocate(own))
        tokens.append(toks)
    return Batch(tokens, tables)


def assert_pages_equal(
    src: PagedKVPool,
    src_tables: list[list[int]],
    dst: PagedKVPool,
    dst_tables: list[list[int]],
    num_tokens: list[int],
) -> None:
    P = src.spec.page_size
    for s, n in enumerate(num_tokens):
        assert n % P == 0
        for i in range(n // P):
            a, b = src_tables[s][i], dst_tables[s][i]
            for li in range(src.spec.num_layers):
                assert torch.equal(src.layers[li][:, a], dst.layers[li][:, b]), (
                    f"seq {s} page {i} layer {li}"
                )
