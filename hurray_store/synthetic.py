"""Synthetic batches with shared prefixes, for the demo and the benchmarks."""

from __future__ import annotations

import torch

from hurray_store.format import LayerKV


def shared_prefix_layer(
    *,
    seqs: int = 32,
    tokens: int = 2048,
    heads: int = 8,
    dim: int = 128,
    page_size: int = 16,
    shared_fraction: float = 0.5,
    dtype: torch.dtype = torch.float16,
    layer_index: int = 0,
    seed: int = 0,
) -> LayerKV:
    """One layer of a batch of ``seqs`` sequences of ``tokens`` tokens whose first
    ``shared_fraction`` of pages is shared by all sequences (stored once)."""
    per_seq = -(-tokens // page_size)
    shared = int(per_seq * shared_fraction)
    own = per_seq - shared
    num_pages = shared + seqs * own
    g = torch.Generator().manual_seed(seed + layer_index)
    keys = torch.randn(num_pages, page_size, heads, dim, generator=g).to(dtype)
    values = torch.randn(num_pages, page_size, heads, dim, generator=g).to(dtype)
    prefix = torch.arange(shared)
    tails = torch.arange(shared, num_pages).view(seqs, own)
    block_table = (
        torch.cat([torch.cat([prefix, tails[s]]) for s in range(seqs)])
        if seqs
        else torch.zeros(0, dtype=torch.long)
    )
    seq_ptr = torch.arange(seqs + 1) * per_seq
    return LayerKV(layer_index, keys, values, block_table, seq_ptr)
