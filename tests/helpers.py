"""Builders shared by the tests: layers, raw pyhurray streams, byte surgery."""

from __future__ import annotations

import struct

import hurray
import numpy as np
import torch

from hurray_store.format import LayerKV

H_DTYPES = {
    torch.float16: hurray.float16,
    torch.bfloat16: hurray.bfloat16,
    torch.float32: hurray.float32,
}


def make_layer(
    tables: list[list[int]],
    num_pages: int,
    *,
    page_size: int = 4,
    heads: int = 2,
    dim: int = 8,
    dtype: torch.dtype = torch.float16,
    layer_index: int = 0,
    seed: int = 0,
) -> LayerKV:
    g = torch.Generator().manual_seed(seed)
    shape = (num_pages, page_size, heads, dim)
    keys = torch.randn(shape, generator=g).to(dtype)
    values = torch.randn(shape, generator=g).to(dtype)
    flat = [p for t in tables for p in t]
    ptr = [0]
    for t in tables:
        ptr.append(ptr[-1] + len(t))
    return LayerKV(
        layer_index, keys, values, torch.tensor(flat, dtype=torch.long), torch.tensor(ptr)
    )


def hurray_tensor(
    *,
    role: str = "key",
    layer: int = 0,
    page_size: int = 4,
    num_pages: int = 5,
    heads: int = 2,
    dim: int = 8,
    block_table: list[int] | None = None,
    seq_ptr: list[int] | None = None,
    num_seqs: int | None = None,
    dtype=hurray.float16,
    elem: int = 2,
    pool: bytes | None = None,
    quantization=None,
    scales: bytes | None = None,
    index_type: str = "uint32",
    total_tokens: int | None = None,
) -> hurray.Tensor:
    """A block-paged tensor built directly with pyhurray, with no checks of ours."""
    bt = [0, 1, 0] if block_table is None else block_table
    sp = [0, 2, 3] if seq_ptr is None else seq_ptr
    idx = np.uint32 if index_type == "uint32" else np.uint64
    layout = hurray.BlockPagedLayout(
        page_size=page_size,
        num_pages=num_pages,
        paged_axis=0,
        num_seqs=len(sp) - 1 if num_seqs is None else num_seqs,
        kv_role=role,
        layer_index=layer,
        block_table_index_type=index_type,
    )
    aux = [np.array(bt, idx).tobytes(), np.array(sp, idx).tobytes()]
    if scales is not None:
        aux.append(scales)
    if pool is None:
        pool = bytes(range(256)) * (num_pages * page_size * heads * dim * elem // 256 + 1)
        pool = pool[: num_pages * page_size * heads * dim * elem]
    return hurray.Tensor(
        pool,
        dtype,
        [len(bt) * page_size if total_tokens is None else total_tokens, heads, dim],
        aux_buffers=aux,
        layout=layout,
        quantization=quantization,
    )


def hurray_stream(*tensors: hurray.Tensor) -> bytes:
    with hurray.StreamWriter() as w:
        for t in tensors:
            w.write(t)
    return w.getvalue()


def descriptor_len(obj: bytes, off: int = 0) -> int:
    return struct.unpack_from("<I", obj, off + 6)[0]


def patch(obj: bytes, off: int, fmt: str, value: int) -> bytes:
    b = bytearray(obj)
    struct.pack_into(fmt, b, off, value)
    return bytes(b)


def rewrite_key_descriptor(obj: bytes, new_desc: bytes) -> bytes:
    """Replace the key tensor's descriptor (its buffers stay)."""
    return new_desc + obj[descriptor_len(obj) :]


def set_rank(desc: bytes, rank: int) -> bytes:
    """Rewrite a rank-3 descriptor's shape to ``rank`` dims (padding with 1s or dropping)."""
    shape = list(struct.unpack_from("<3Q", desc, 20))
    new_shape = (shape + [1] * rank)[:rank]
    body = desc[:16] + struct.pack("<I", rank) + struct.pack(f"<{rank}Q", *new_shape) + desc[44:]
    return patch(body, 6, "<I", len(body))


def add_shard(desc: bytes) -> bytes:
    """Set HAS_SHARD and append a shard section (parent shape, offsets)."""
    shape = struct.unpack_from("<3Q", desc, 20)
    section = struct.pack("<3Q", shape[0] * 2, shape[1], shape[2]) + struct.pack("<3Q", 0, 0, 0)
    flags = struct.unpack_from("<I", desc, 10)[0] | 0x2
    out = patch(desc, 10, "<I", flags) + section
    return patch(out, 6, "<I", len(out))
