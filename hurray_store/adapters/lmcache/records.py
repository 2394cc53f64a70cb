"""The records the LMCache adapters store beside their objects (pure: bytes in and out).

A chunk record (the in-process plugin, ``HSLC``), the commit point of one chunk object
(the chunk's layers, each a key and a value block-paged descriptor with its pool, one
Hurray stream)::

    magic "HSLC" | u16 version | 32 B layout fingerprint | u64 tokens | u32 layers |
    u64 chunk object size
    per layer: u64 key pool offset | u64 value pool offset (in the chunk object) |
               u64 xxh3-64 of the chunk's key token bytes | u64 of its value token bytes
    u64 xxh3-64 of everything before it

An L2 record (the L2 adapter, ``HSL2``), the commit point of one L2 object (a Hurray
stream of one rank-1 ``uint8`` tensor: its descriptor, then LMCache's bytes)::

    magic "HSL2" | u16 version | u64 offset of the bytes in the object | u64 their size |
    u64 their xxh3-64

Parsers check every length before they read, and raise FormatError.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass

import torch

from hurray_store.errors import FormatError
from hurray_store.format import checksum

CHUNK_MAGIC = b"HSLC"
CHUNK_VERSION = 3
# magic, version, fingerprint, num_tokens, num_layers, chunk object size
_CHUNK = struct.Struct("<4sH32sQIQ")
_LAYER = struct.Struct("<QQQQ")
_SUM = struct.Struct("<Q")
L2_MAGIC = b"HSL2"
L2_VERSION = 2
_L2 = struct.Struct("<4sHQQQ")  # magic, version, offset, size, checksum
L2_RECORD_BYTES = _L2.size


def layout_fingerprint(
    num_layers: int,
    num_kv_heads: int,
    head_size: int,
    chunk_size: int,
    dtype: torch.dtype,
    use_mla: bool,
    page_size: int,
) -> bytes:
    """32 bytes that change with anything that changes what a chunk's bytes mean."""
    fields = (num_layers, num_kv_heads, head_size, chunk_size, dtype, int(use_mla), page_size)
    text = "|".join(["hurray_store/lmcache-layout/v1", *map(str, fields)])
    return hashlib.sha256(text.encode()).digest()


@dataclass(frozen=True, slots=True)
class ChunkLayer:
    """What a chunk record says of one layer: where its pools start in the chunk
    object, and the checksums of the chunk's token bytes in each."""

    key_pool_offset: int
    value_pool_offset: int
    key_tokens_checksum: int
    value_tokens_checksum: int


def pack_chunk_record(
    fingerprint: bytes, num_tokens: int, object_size: int, layers: Sequence[ChunkLayer]
) -> list[bytes]:
    """The record's bytes, as the body and its checksum (two buffers, no join)."""
    body = b"".join(
        [
            _CHUNK.pack(
                CHUNK_MAGIC, CHUNK_VERSION, fingerprint, num_tokens, len(layers), object_size
            ),
            *(_LAYER.pack(*astuple(lay)) for lay in layers),
        ]
    )
    return [body, _SUM.pack(checksum(body))]


def parse_chunk_record(
    rec: bytes | memoryview,
    fingerprint: bytes,
    num_layers: int,
    chunk_size: int,
    token_bytes: Callable[[int], int],
) -> tuple[int, int, list[ChunkLayer]]:
    """``(tokens, chunk object size, layers)`` of a record written for this layout;
    FormatError when the record is short, corrupt, of another layout or version, or
    points outside its object."""
    mv = memoryview(rec).cast("B")
    if len(mv) < _CHUNK.size + _SUM.size:
        raise FormatError(f"chunk record of {len(mv)} bytes is shorter than its header")
    (stored_sum,) = _SUM.unpack_from(mv, len(mv) - _SUM.size)
    if checksum(mv[: -_SUM.size]) != stored_sum:
        raise FormatError("chunk record: checksum differs")
    magic, version, fp, n, nl, size = _CHUNK.unpack_from(mv)
    if magic != CHUNK_MAGIC or version != CHUNK_VERSION:
        raise FormatError(f"chunk record: magic {bytes(magic)!r} version {version}")
    if fp != fingerprint or nl != num_layers or not 0 < n <= chunk_size:
        raise FormatError("chunk record: another layout")
    if len(mv) != _CHUNK.size + nl * _LAYER.size + _SUM.size:
        raise FormatError("chunk record: wrong length")
    nb = token_bytes(n)
    layers = [
        ChunkLayer(*_LAYER.unpack_from(mv, _CHUNK.size + li * _LAYER.size)) for li in range(nl)
    ]
    for li, lay in enumerate(layers):
        if lay.key_pool_offset + nb > size or lay.value_pool_offset + nb > size:
            raise FormatError(f"layer {li}: pool offsets outside the chunk object")
    return n, size, layers


def pack_l2_record(offset: int, data: bytes | memoryview) -> bytes:
    return _L2.pack(L2_MAGIC, L2_VERSION, offset, len(data), checksum(data))


def parse_l2_record(rec: bytes | memoryview) -> tuple[int, int, int]:
    """``(offset, size, checksum)`` of the bytes an L2 record commits; FormatError
    otherwise."""
    mv = memoryview(rec).cast("B")
    if len(mv) != _L2.size:
        raise FormatError(f"L2 record: {len(mv)} bytes, a record has {_L2.size}")
    magic, version, offset, size, csum = _L2.unpack(mv)
    if magic != L2_MAGIC or version != L2_VERSION:
        raise FormatError(f"L2 record: magic {bytes(magic)!r} version {version}")
    return offset, size, csum
