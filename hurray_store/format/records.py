"""The records that end chunk and page objects and the L2 adapter's objects (pure:
bytes in and out).

Each adapter object is one Hurray stream whose last tensor, a rank-1 ``uint8`` tensor,
is its record: the object's commit point, written in the same object (every tier writes
an object whole or not at all), so no record exists without the bytes it describes.

A chunk object (the in-process plugin) is the chunk's layers, each a key and a value
block-paged descriptor with its pool, then the chunk record (``HSLC``)::

    magic "HSLC" | u16 version | 32 B layout fingerprint | u64 tokens | u32 layers |
    u64 chunk object size (the whole stream, record included)
    per layer: u64 key pool offset | u64 value pool offset (in the chunk object) |
               u64 xxh3-64 of the chunk's key token bytes | u64 of its value token bytes
    u64 xxh3-64 of everything before it

Its length follows from the layer count (``chunk_record_bytes``), so a reader that
knows the object's size knows where the record is.

An L2 object (the L2 adapter) is one Hurray stream of two rank-1 ``uint8`` tensors:
LMCache's bytes, then the L2 record (``HSL2``), its commit point, last::

    blob descriptor (uint8[n]) | LMCache's n bytes | blob descriptor (uint8[30]) | record
    record: magic "HSL2" | u16 version | u64 offset of the bytes in the object |
            u64 their size | u64 their xxh3-64

A blob descriptor has the same length for every n, so where the bytes and the record
sit follows from n alone (``l2_layout``): a load reads both in one ranged read.

Parsers check every length before they read, and raise FormatError.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hurray_store.errors import FormatError
from hurray_store.format.checksums import checksum
from hurray_store.format.self_checked import SelfChecked
from hurray_store.format.wire import blob_descriptor

CHUNK_MAGIC = b"HSLC"
CHUNK_VERSION = 4
# magic, version, fingerprint, num_tokens, num_layers, chunk object size
_CHUNK = struct.Struct("<4sH32sQIQ")
_LAYER = struct.Struct("<QQQQ")
_SUM = struct.Struct("<Q")
L2_MAGIC = b"HSL2"
L2_VERSION = 3
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
    # v2: the record ends the chunk object (v1 kept it in an object of its own).
    text = "|".join(["hurray_store/lmcache-layout/v2", *map(str, fields)])
    return hashlib.sha256(text.encode()).digest()


@dataclass(frozen=True, slots=True)
class ChunkLayer:
    """What a chunk record says of one layer: where its pools start in the chunk
    object, and the checksums of the chunk's token bytes in each."""

    key_pool_offset: int
    value_pool_offset: int
    key_tokens_checksum: int
    value_tokens_checksum: int


def chunk_record_bytes(num_layers: int) -> int:
    """The length of the chunk record of ``num_layers`` layers."""
    return _CHUNK.size + num_layers * _LAYER.size + _SUM.size


def chunk_record_of(num_layers: int) -> Callable[..., bytes]:
    """``(fingerprint, tokens, object size, pools, sums) -> bytes``: the whole record a
    chunk of ``num_layers`` layers with these pool offsets (per layer its key's and its
    value's) and token checksums (likewise, flat) has, made at once (one ``pack``): what
    a put writes, and what a reader compares with the record it read, where equal
    bytes say everything ``parse_chunk_record`` and the checksums' comparison would
    (any other record is parsed, for the reason it differs)."""
    body = struct.Struct(_CHUNK.format + _LAYER.format[1:] * num_layers)

    def record(fp: bytes, n: int, size: int, pools: Sequence[tuple[int, int]], sums: Any) -> bytes:
        fields: list[Any] = [CHUNK_MAGIC, CHUNK_VERSION, fp, n, num_layers, size]
        for (k_at, v_at), k_sum, v_sum in zip(pools, sums[::2], sums[1::2], strict=True):
            fields += (k_at, v_at, k_sum, v_sum)
        b = body.pack(*fields)
        return b + _SUM.pack(checksum(b))

    return record


def parse_chunk_record(
    rec: bytes | bytearray | memoryview,
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


def describe_chunk_record(rec: bytes | bytearray | memoryview) -> dict[str, Any]:
    """The header fields of a chunk record, checked against its own checksum (not
    against any layout: for ``hurray-store inspect``); FormatError when it is none."""
    mv = memoryview(rec).cast("B")
    if len(mv) < _CHUNK.size + _SUM.size:
        raise FormatError(f"chunk record of {len(mv)} bytes is shorter than its header")
    magic, version, fp, n, nl, size = _CHUNK.unpack_from(mv)
    if magic != CHUNK_MAGIC:
        raise FormatError(f"not a chunk record (magic {bytes(magic)!r})")
    (stored_sum,) = _SUM.unpack_from(mv, len(mv) - _SUM.size)
    return {
        "magic": bytes(magic).decode(),
        "version": version,
        "fingerprint": bytes(fp).hex(),
        "tokens": n,
        "layers": nl,
        "object_size": size,
        "checksum_ok": checksum(mv[: -_SUM.size]) == stored_sum,
    }


def l2_layout(nbytes: int) -> tuple[int, int, int]:
    """``(offset of LMCache's bytes, offset of the record, object size)`` of the L2
    object of ``nbytes`` bytes."""
    d = len(blob_descriptor(nbytes))
    at = d + nbytes + len(blob_descriptor(L2_RECORD_BYTES))
    return d, at, at + L2_RECORD_BYTES


def pack_l2_object(data: bytes | memoryview) -> SelfChecked:
    """The L2 object of ``data`` (``data`` itself among its parts, no copy), closed by
    its record: ``data`` is hashed where the object is written (a disk tier or a single
    Redis: on the thread that writes it, just before it goes out), the record last."""
    offset = l2_layout(len(data))[0]

    def closing(sums: list[int]) -> list[bytes]:
        return [_L2.pack(L2_MAGIC, L2_VERSION, offset, len(data), sums[0])]

    parts = [blob_descriptor(len(data)), data, blob_descriptor(L2_RECORD_BYTES)]
    return SelfChecked(parts, [None, 0, None], [0], closing, L2_RECORD_BYTES, checksum)


def parse_l2_record(rec: bytes | bytearray | memoryview) -> tuple[int, int, int]:
    """``(offset, size, checksum)`` of the bytes an L2 record commits; FormatError
    otherwise."""
    mv = memoryview(rec).cast("B")
    if len(mv) != _L2.size:
        raise FormatError(f"L2 record: {len(mv)} bytes, a record has {_L2.size}")
    magic, version, offset, size, csum = _L2.unpack(mv)
    if magic != L2_MAGIC or version != L2_VERSION:
        raise FormatError(f"L2 record: magic {bytes(magic)!r} version {version}")
    return offset, size, csum


# A state object (a host pool's page that is not paged KV: an SGLang Mamba state slot) is
# one Hurray stream of two rank-1 ``uint8`` tensors: the page's bytes as the engine's pool
# lays them out, then the state record (``HSST``), its commit point, last::
#
#     blob descriptor (uint8[n]) | the page's n bytes | blob descriptor (uint8[62]) | record
#     record: magic "HSST" | u16 version | 32 B fingerprint (the object's name and what
#             its bytes mean) | u64 their size | u64 their xxh3-64 | u64 xxh3-64 of the
#             record before it
STATE_MAGIC = b"HSST"
STATE_VERSION = 1
_STATE = struct.Struct("<4sH32sQQ")  # magic, version, fingerprint, size, checksum
STATE_RECORD_BYTES = _STATE.size + _SUM.size


def state_layout(nbytes: int) -> tuple[int, int, int]:
    """``(offset of the page's bytes, offset of the record, object size)`` of the state
    object of an ``nbytes`` page."""
    d = len(blob_descriptor(nbytes))
    at = d + nbytes + len(blob_descriptor(STATE_RECORD_BYTES))
    return d, at, at + STATE_RECORD_BYTES


def state_object(data: memoryview, fingerprint: bytes) -> list[bytes | memoryview]:
    """The parts of the state object of ``data`` (itself among them, no copy)."""
    head = _STATE.pack(STATE_MAGIC, STATE_VERSION, fingerprint, len(data), checksum(data))
    return [
        blob_descriptor(len(data)),
        data,
        blob_descriptor(STATE_RECORD_BYTES),
        head + _SUM.pack(checksum(head)),
    ]


def check_state_object(obj: memoryview, fingerprint: bytes, nbytes: int) -> str:
    """Why ``obj`` is not the state object of ``nbytes`` bytes ``fingerprint`` names
    ("" when it is): its length, its descriptors, its record and the page's checksum
    are all checked before a byte is used."""
    d, at, size = state_layout(nbytes)
    mv = obj.cast("B")
    if len(mv) != size:
        return f"a state object of {len(mv)} bytes, expected {size}"
    if bytes(mv[:d]) != blob_descriptor(nbytes) or bytes(mv[d + nbytes : at]) != blob_descriptor(
        STATE_RECORD_BYTES
    ):
        return "a state object's descriptors are not those of its size"
    rec = mv[at:]
    (stored,) = _SUM.unpack_from(rec, _STATE.size)
    if checksum(rec[: _STATE.size]) != stored:
        return "state record: checksum differs"
    magic, version, fp, n, data_sum = _STATE.unpack_from(rec)
    if magic != STATE_MAGIC or version != STATE_VERSION:
        return f"state record: magic {bytes(magic)!r} version {version}"
    if fp != fingerprint or n != nbytes:
        return "state record: another page's object"
    if checksum(mv[d : d + nbytes]) != data_sum:
        return "state page: checksum differs"
    return ""


def describe_state_object(obj: bytes | bytearray | memoryview) -> dict[str, Any]:
    """A state object's record fields, checked against the object itself (its length,
    descriptors and checksums; not against any page's fingerprint: for ``hurray-store
    inspect``); FormatError when it is none."""
    mv = memoryview(obj).cast("B")
    if len(mv) < STATE_RECORD_BYTES:
        raise FormatError(f"{len(mv)} bytes: shorter than a state record")
    rec = mv[len(mv) - STATE_RECORD_BYTES :]
    magic, version, fp, n, _ = _STATE.unpack_from(rec)
    if magic != STATE_MAGIC:
        raise FormatError(f"not a state object (magic {bytes(magic)!r})")
    if state_layout(n)[2] != len(mv):
        raise FormatError(f"a state record of {n} bytes in an object of {len(mv)}")
    why = check_state_object(mv, bytes(fp), n)
    return {"version": version, "bytes": n, "fingerprint": bytes(fp).hex(), "check": why or "ok"}
