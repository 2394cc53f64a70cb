"""The Hurray network transport's messages: framing, payload codecs (pure: bytes in
and out, no sockets).

Every message is a 12-byte little-endian header ``(message_type u32, stream_id u32,
payload_length u32)`` and its payload (``docs/spec/interchange.md`` upstream). Objects
travel as rank-1 ``uint8`` tensors whose data is the object's bytes at rest
(``format/wire.py``). What the spec leaves out, hurray_store adds as private extension
messages (``0xF0``-``0xFE``), sent only to a peer that announced ``hurray_store/1`` in
its HELLO's extension data; ``docs/server.md`` documents each.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from hurray_store.errors import FormatError, ProtocolError, RemoteError
from hurray_store.format import blob_descriptor, parse_blob_descriptor
from hurray_store.format.cursor import Cursor

PROTOCOL_VERSION = 1
EXTENSION = "hurray_store/1"
HEADER = struct.Struct("<III")
HEADER_LEN = HEADER.size
DATA_OFFSET = struct.Struct("<Q")
MAX_KEY_BYTES = 1024
LAYOUT_ROW_MAJOR = 0x01
DEVICE_CPU = 0x00
MAX_FRAME = 16 << 20  # largest TENSOR_DATA frame either side sends
# One X_LOOKUP answers at most this much (an engine's batch; 4M tokens of 16-token
# pages), so no request holds the server's event loop for long.
MAX_LOOKUP_SEQS = 4096
MAX_LOOKUP_HASHES = 1 << 18
MEMORY_STANDARD = 0x00
_EXT_MARK = b"HSX1"  # opens the extension data after a HELLO's spec fields
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_DESC_TAIL = struct.Struct("<QII")  # total_data_bytes, shard_index, total_shards
_REQ_TAIL = struct.Struct("<BII")  # preferred_device, min_alignment, request_flags


class Msg(IntEnum):
    CLIENT_HELLO = 0x01
    SERVER_HELLO = 0x02
    TENSOR_REQUEST = 0x03
    TENSOR_DESCRIPTOR = 0x04
    TENSOR_DATA = 0x05
    TENSOR_DATA_END = 0x06
    TENSOR_PUT = 0x07
    TENSOR_PUT_ACK = 0x08
    ERROR = 0x09
    PING = 0x0A
    PONG = 0x0B
    RDMA_REGISTER = 0x0C
    RDMA_READY = 0x0D
    # private extensions (hurray_store/1)
    X_LOOKUP = 0xF0  # page hashes -> matched pages and the manifests covering them
    X_LOOKUP_REPLY = 0xF1
    X_COMMIT = 0xF2  # a segment's manifest: its staged layer objects become one segment
    X_COMMIT_ACK = 0xF3
    X_STATS = 0xF4  # -> JSON of the server store's stats
    X_STATS_REPLY = 0xF5
    X_CONTAINS = 0xF6  # keys -> sizes
    X_CONTAINS_REPLY = 0xF7
    X_DELETE = 0xF8  # keys -> ack
    X_DELETE_ACK = 0xF9
    X_RANGES = 0xFA  # key + byte ranges -> DESCRIPTOR / DATA / DATA_END of their bytes


KNOWN = frozenset(int(m) for m in Msg)
EXTENSIONS = frozenset(int(m) for m in Msg if m >= 0xF0)


class Err(IntEnum):
    PROTOCOL_VERSION_MISMATCH = 0x01
    UNKNOWN_TENSOR = 0x02
    LAYOUT_UNAVAILABLE = 0x03
    TRANSCODE_LIMIT_EXCEEDED = 0x04
    DEVICE_UNAVAILABLE = 0x05
    INVALID_MESSAGE = 0x06
    MESSAGE_TOO_LARGE = 0x07
    SHARD_MISMATCH = 0x08
    # implementation-defined
    AUTH_FAILED = 0xF0  # missing or wrong token
    BUSY = 0xF1  # connection limit, or in-flight put memory exhausted past the timeout
    TIMEOUT = 0xF2  # a request or its data frames took longer than the limit
    REJECTED = 0xF3  # a commit the server refused (bad manifest, missing objects)
    NOT_STORED = 0xF4  # the store could not keep it (no tier took it)
    SHUTTING_DOWN = 0xF5
    INTERNAL = 0xF6  # the server failed on a well-formed request (a bug; it is logged)


def invalid(message: str, *, fatal: bool = True) -> ProtocolError:
    return ProtocolError(Err.INVALID_MESSAGE, message, fatal=fatal)


# --------------------------------------------------------------------------- payload codec


def _cursor(data: bytes | bytearray | memoryview) -> Cursor:
    """A cursor over one payload: running short is a ProtocolError (INVALID_MESSAGE)."""
    return Cursor(data, lambda m: invalid(f"payload: {m}"))


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return _U32.pack(len(b)) + b


def key_field(key: str) -> bytes:
    b = key.encode("utf-8")
    if not b or len(b) > MAX_KEY_BYTES:
        raise ValueError(f"a key is 1 to {MAX_KEY_BYTES} UTF-8 bytes, got {len(b)}")
    return _U32.pack(len(b)) + b


def read_key(r: Cursor) -> str:
    key = r.string(MAX_KEY_BYTES)
    if not key or "\x00" in key:
        raise invalid("a key is a non-empty string without NUL")
    return key


@dataclass(slots=True)
class Hello:
    """CLIENT_HELLO / SERVER_HELLO. ``ext`` is the extension data that follows the
    spec's fields (``None``: the peer sent none)."""

    version: int = PROTOCOL_VERSION
    max_message_size: int = 64 << 20
    capabilities: int = 0
    layouts: list[int] = field(default_factory=lambda: [LAYOUT_ROW_MAJOR])
    devices: list[int] = field(default_factory=lambda: [DEVICE_CPU])
    memory_classes: list[int] = field(default_factory=lambda: [MEMORY_STANDARD])
    ext: dict[str, str] | None = None

    def encode(self) -> bytes:
        out = [struct.pack("<IIQ", self.version, self.max_message_size, self.capabilities)]
        out.append(struct.pack("<H", len(self.layouts)) + bytes(self.layouts))
        out.append(struct.pack("<H", len(self.devices)) + bytes(self.devices))
        out.append(struct.pack("<H", len(self.memory_classes)) + bytes(self.memory_classes))
        if self.ext is not None:
            body = b"".join(_string(k) + _string(v) for k, v in self.ext.items())
            out.append(_EXT_MARK + struct.pack("<H", len(self.ext)) + body)
        return b"".join(out)

    @classmethod
    def decode(cls, payload: bytes | bytearray | memoryview) -> Hello:
        r = _cursor(payload)
        h = cls(r.u32(), r.u32(), r.u64(), [], [], [], None)
        h.layouts = _layout_list(r)
        h.devices = list(r.take(r.u16()))
        h.memory_classes = list(r.take(r.u16())) if r.pos < r.mv.nbytes else []
        if r.pos < r.mv.nbytes and bytes(r.mv[r.pos : r.pos + 4]) == _EXT_MARK:
            r.take(4)
            h.ext = {}
            for _ in range(r.u16()):
                k = r.string(256)
                h.ext[k] = r.string(4096)
        r.done()
        return h


def _layout_list(r: Cursor) -> list[int]:
    """A layout list; extension entries (0xF0-0xFE) are skipped by their length."""
    tags = []
    for _ in range(r.u16()):
        tag = r.u8()
        if 0xF0 <= tag <= 0xFE:
            r.take(r.u16())
            continue
        tags.append(tag)
    return tags


def encode_request(
    key: str, *, device: int = DEVICE_CPU, min_alignment: int = 64, flags: int = 0
) -> bytes:
    """TENSOR_REQUEST: key, preferred layouts (row-major), device, alignment, flags."""
    return (
        key_field(key)
        + struct.pack("<HB", 1, LAYOUT_ROW_MAJOR)
        + _REQ_TAIL.pack(device, min_alignment, flags)
    )


@dataclass(frozen=True, slots=True)
class Request:
    key: str
    layouts: list[int]
    device: int
    min_alignment: int
    flags: int


def decode_request(payload: memoryview) -> Request:
    r = _cursor(payload)
    key = read_key(r)
    layouts = _layout_list(r)
    device, align, flags = _REQ_TAIL.unpack(r.take(_REQ_TAIL.size))
    r.done()
    if align == 0 or align & (align - 1):
        raise invalid(f"min_alignment {align} is not a power of two", fatal=False)
    if flags & ~0x3:
        raise invalid(f"reserved request flag bits set: 0x{flags:x}", fatal=False)
    return Request(key, layouts, device, align, flags)


def encode_descriptor(nbytes: int) -> bytes:
    """TENSOR_DESCRIPTOR of an object of ``nbytes``: its descriptor, then the transport
    fields (one shard)."""
    return blob_descriptor(nbytes) + _DESC_TAIL.pack(nbytes, 0, 1)


def decode_descriptor(payload: memoryview, limit: int) -> int:
    """The data bytes a TENSOR_DESCRIPTOR announces (its ``descriptor_length``
    delimits the descriptor from the transport fields)."""
    try:
        n, used = parse_blob_descriptor(payload)
    except FormatError as e:
        raise invalid(f"TENSOR_DESCRIPTOR: {e}") from None
    r = _cursor(payload)
    r.take(used)
    total, shard, shards = _DESC_TAIL.unpack(r.take(_DESC_TAIL.size))
    r.done()
    if total != n or shard != 0 or shards != 1:
        raise ProtocolError(
            Err.SHARD_MISMATCH,
            f"descriptor of {n} bytes announces {total} bytes in shard {shard}/{shards}",
        )
    if n > limit:
        raise ProtocolError(
            Err.MESSAGE_TOO_LARGE, f"object of {n} bytes; this side takes at most {limit}"
        )
    return n


def encode_put(key: str, nbytes: int) -> bytes:
    desc = blob_descriptor(nbytes)
    return key_field(key) + _U32.pack(len(desc)) + desc + _U64.pack(nbytes)


def decode_put(payload: memoryview) -> tuple[str, int]:
    r = _cursor(payload)
    key = read_key(r)
    desc = r.blob(4096)
    total = r.u64()
    r.done()
    try:
        n, used = parse_blob_descriptor(desc)
    except FormatError as e:
        raise invalid(f"TENSOR_PUT: {e}", fatal=False) from None
    if used != desc.nbytes or n != total:
        raise invalid(
            f"TENSOR_PUT: descriptor of {n} bytes ({used} long) in a field of "
            f"{desc.nbytes}, total {total}",
            fatal=False,
        )
    return key, n


def encode_error(code: int, message: str) -> bytes:
    return _U32.pack(int(code)) + _string(message[:2000])


def decode_error(payload: memoryview) -> RemoteError:
    r = _cursor(payload)
    code = r.u32()
    msg = r.string(1 << 16)
    return RemoteError(code, msg)


def encode_keys(keys: Sequence[str]) -> bytes:
    return _U32.pack(len(keys)) + b"".join(key_field(k) for k in keys)


def decode_keys(payload: memoryview, limit: int = 1 << 16) -> list[str]:
    r = _cursor(payload)
    n = r.u32()
    if n > limit:
        raise invalid(f"{n} keys in one message; at most {limit}", fatal=False)
    keys = [read_key(r) for _ in range(n)]
    r.done()
    return keys


def encode_sizes(sizes: Sequence[int | None]) -> bytes:
    return _U32.pack(len(sizes)) + b"".join(
        struct.pack("<q", -1 if s is None else s) for s in sizes
    )


def decode_sizes(payload: memoryview) -> list[int | None]:
    r = _cursor(payload)
    out: list[int | None] = []
    for _ in range(r.u32()):
        (v,) = struct.unpack("<q", r.take(8))
        out.append(None if v < 0 else v)
    r.done()
    return out


def encode_ranges(key: str, ranges: Sequence[tuple[int, int]]) -> bytes:
    return (
        key_field(key)
        + _U32.pack(len(ranges))
        + b"".join(struct.pack("<QQ", o, n) for o, n in ranges)
    )


def decode_ranges(payload: memoryview, limit: int = 1 << 20) -> tuple[str, list[tuple[int, int]]]:
    r = _cursor(payload)
    key = read_key(r)
    n = r.u32()
    if n > limit:
        raise invalid(f"{n} ranges in one request; at most {limit}", fatal=False)
    ranges = [struct.unpack("<QQ", r.take(16)) for _ in range(n)]
    r.done()
    return key, ranges


def encode_lookup(
    seqs: Sequence[tuple[int, Sequence[bytes]]], *, claim: bool, wait_ms: int = 0
) -> bytes:
    """X_LOOKUP: flags (bit 0: claim the unmatched pages for a put), the longest the
    server may wait for other clients' claims, then per sequence the pages the caller
    already has and the page hashes (16 bytes each)."""
    out = [struct.pack("<III", 1 if claim else 0, wait_ms, len(seqs))]
    for have, hashes in seqs:
        out.append(struct.pack("<II", have, len(hashes)))
        out.extend(hashes)
    return b"".join(out)


def decode_lookup(
    payload: memoryview, hash_len: int
) -> tuple[bool, int, list[tuple[int, list[bytes]]]]:
    r = _cursor(payload)
    flags = r.u32()
    wait_ms = r.u32()
    if flags & ~1:
        raise invalid(f"reserved lookup flag bits set: 0x{flags:x}", fatal=False)
    seqs = []
    n_seqs = r.count("<I", 8)
    if n_seqs > MAX_LOOKUP_SEQS:
        raise invalid(f"a lookup of {n_seqs} sequences; at most {MAX_LOOKUP_SEQS}", fatal=False)
    total = 0
    for _ in range(n_seqs):
        have, n = r.u32(), r.u32()
        total += n
        if total > MAX_LOOKUP_HASHES:
            raise invalid(f"a lookup of more than {MAX_LOOKUP_HASHES} page hashes", fatal=False)
        raw = bytes(r.take(n * hash_len))
        seqs.append((have, [raw[i * hash_len : (i + 1) * hash_len] for i in range(n)]))
    r.done()
    return bool(flags & 1), wait_ms, seqs


def encode_lookup_reply(matched: Sequence[int], manifests: Sequence[bytes]) -> bytes:
    out = [_U32.pack(len(matched)), *(_U32.pack(m) for m in matched), _U32.pack(len(manifests))]
    for m in manifests:
        out += [_U32.pack(len(m)), m]
    return b"".join(out)


def decode_lookup_reply(payload: memoryview) -> tuple[list[int], list[bytes]]:
    r = _cursor(payload)
    matched = [r.u32() for _ in range(r.u32())]
    manifests = [bytes(r.blob(r.mv.nbytes)) for _ in range(r.u32())]
    r.done()
    return matched, manifests


def encode_commit(
    manifest_key: str, manifest: bytes | bytearray | memoryview
) -> list[bytes | bytearray | memoryview]:
    return [key_field(manifest_key), _U32.pack(memoryview(manifest).nbytes), manifest]


def decode_commit(payload: memoryview, limit: int) -> tuple[str, memoryview]:
    r = _cursor(payload)
    key = read_key(r)
    m = r.blob(limit)
    r.done()
    return key, m


def encode_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, default=str).encode()


def data_frames(
    stream: int, parts: Sequence[bytes | bytearray | memoryview], frame: int
) -> list[bytes | memoryview]:
    """The concatenation of ``parts`` as TENSOR_DATA frames of at most ``frame`` payload
    bytes (headers and zero-copy views, ready for ``send_parts``), then TENSOR_DATA_END."""
    out: list[bytes | memoryview] = []
    step = frame - DATA_OFFSET.size
    off = 0
    for p in parts:
        mv = memoryview(p).cast("B")
        for a in range(0, mv.nbytes, step):
            chunk = mv[a : a + step]
            out += [
                HEADER.pack(Msg.TENSOR_DATA, stream, chunk.nbytes + DATA_OFFSET.size),
                DATA_OFFSET.pack(off),
                chunk,
            ]
            off += chunk.nbytes
    out.append(HEADER.pack(Msg.TENSOR_DATA_END, stream, 0))
    return out
