"""The segment manifest: the small object that commits a stored batch (pure).

A segment's layer objects are written first and its manifest last; a segment without a
manifest does not exist for readers. The manifest says everything a reader needs to
verify and to read any single page without touching the rest of an object. Byte layout
(little-endian; see docs/format.md for the rules and their reasons)::

    0      4       6       8              16                   16+L         24+L
    +------+-------+-------+--------------+--------- ... ------+------------+
    | HSMF | ver=1 | flags | body_len = L |       body         | xxh3-64    |
    +------+-------+-------+--------------+--------- ... ------+------------+
                                                      checksum of bytes [0, 16+L)

    body = fingerprint  u16 n + n bytes
           segment_id   u16 n + n bytes
           quantization u8 (0 none, 1 int8)
           page_size u32 | num_pages u64 | page_bytes u64 | scale_bytes u64
           num_seqs u32, then per sequence:
               first_page u64 | seq_len u64
               n_tokens u64 + u32[n_tokens]          (token ids 0 .. seq_len)
               n_hashes u32 | hash_len u8 + bytes     (hashes of its stored full pages)
               n_pages u32 + u32[n_pages]             (segment page ids of its stored pages)
           num_layers u32, then per layer:
               layer_index u32 | key u16 n + utf-8
               object_size u64 | object_checksum u64
               key_pool_offset u64 | value_pool_offset u64
               key_scales_offset u64 | value_scales_offset u64
               u64[num_pages] key page checksums | u64[num_pages] value page checksums
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from hurray_store import errors
from hurray_store.format.cursor import Cursor

MANIFEST_MAGIC = b"HSMF"
MANIFEST_VERSION = 1
_HEADER = struct.Struct("<4sHHQ")
_QUANT_CODES = {None: 0, "int8": 1}
_QUANT_NAMES = {v: k for k, v in _QUANT_CODES.items()}
MAX_HASH_LEN = 64


def checksum(*buffers: bytes | bytearray | memoryview) -> int:
    """xxh3-64 over the concatenation of ``buffers`` (integrity, not authentication)."""
    if len(buffers) == 1:
        return xxhash.xxh3_64_intdigest(buffers[0])
    h = xxhash.xxh3_64()
    for b in buffers:
        h.update(b)
    return h.intdigest()


def running_checksum() -> xxhash.xxh3_64:
    """``checksum`` taken piece by piece, as bytes arrive: ``update(piece)`` for each
    piece in order, then ``intdigest()`` is the ``checksum`` of their concatenation."""
    return xxhash.xxh3_64()


def page_checksum(
    page: bytes | bytearray | memoryview, scales: bytes | bytearray | memoryview | None = None
) -> int:
    """The checksum of one stored page of one role: xxh3-64 over its bytes, then its
    scales when quantized. The one definition: writers, readers, the server's commit
    and ``Manifest.verify_object`` all use it."""
    if scales is None:
        return xxhash.xxh3_64_intdigest(page)
    h = xxhash.xxh3_64()
    h.update(page)
    h.update(scales)
    return h.intdigest()


def object_checksum(
    fixed: Sequence[bytes | bytearray | memoryview],
    key_sums: Sequence[int],
    value_sums: Sequence[int],
) -> int:
    """A layer object's checksum, without a second pass over its pages: xxh3-64 over
    the object's bytes outside its pools and scales (descriptors, index buffers; in
    stream order), then the key page checksums, then the value page checksums (u64 LE).
    Anyone holding the object and the manifest can recompute it."""
    h = xxhash.xxh3_64()
    for b in fixed:
        h.update(b)
    h.update(np.asarray(key_sums, dtype="<u8").tobytes())
    h.update(np.asarray(value_sums, dtype="<u8").tobytes())
    return h.intdigest()


@dataclass(frozen=True, slots=True)
class ManifestSeq:
    """One sequence of a segment: which of its pages this segment stores."""

    token_ids: tuple[int, ...]  # all tokens of the sequence, 0 .. seq_len
    first_page: int  # position (in the sequence) of its first page stored here
    seq_len: int  # valid tokens
    page_hashes: tuple[bytes, ...]  # chained hashes of its stored FULL pages
    block_table: tuple[int, ...]  # segment page id of each stored page, in order


@dataclass(frozen=True, slots=True)
class ManifestLayer:
    """One layer object of a segment, and where each page lies inside it."""

    layer_index: int
    key: str
    object_size: int
    object_checksum: int
    key_pool_offset: int
    value_pool_offset: int
    key_scales_offset: int
    value_scales_offset: int
    key_page_checksums: tuple[int, ...]
    value_page_checksums: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Manifest:
    fingerprint: bytes
    segment_id: bytes
    quantization: str | None
    page_size: int
    num_pages: int  # distinct pages stored in the segment
    page_bytes: int  # bytes of one page of one role inside a layer object
    scale_bytes: int  # bytes of one page's scales (0 unless quantized)
    sequences: tuple[ManifestSeq, ...]
    layers: tuple[ManifestLayer, ...]

    def fixed_ranges(self, layer_pos: int) -> list[tuple[int, int]]:
        """Byte ranges of the object of ``self.layers[layer_pos]`` outside its pools and
        scales (descriptors and index buffers), in order: what ``object_checksum``
        covers besides the page checksums."""
        lay = self.layers[layer_pos]
        taken = sorted(
            [
                (lay.key_pool_offset, self.num_pages * self.page_bytes),
                (lay.value_pool_offset, self.num_pages * self.page_bytes),
            ]
            + (
                [
                    (lay.key_scales_offset, self.num_pages * self.scale_bytes),
                    (lay.value_scales_offset, self.num_pages * self.scale_bytes),
                ]
                if self.scale_bytes
                else []
            )
        )
        out, pos = [], 0
        for off, ln in taken:
            if off > pos:
                out.append((pos, off - pos))
            pos = max(pos, off + ln)
        if pos < lay.object_size:
            out.append((pos, lay.object_size - pos))
        return out

    def page_range(self, layer_pos: int, role: str, page: int) -> list[tuple[int, int]]:
        """Byte ranges ``(offset, length)`` of segment page ``page`` of ``role`` ("key"
        or "value") in the object of ``self.layers[layer_pos]``: the page, then its
        scales when quantized."""
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} outside [0, {self.num_pages})")
        lay = self.layers[layer_pos]
        pool = lay.key_pool_offset if role == "key" else lay.value_pool_offset
        out = [(pool + page * self.page_bytes, self.page_bytes)]
        if self.scale_bytes:
            sc = lay.key_scales_offset if role == "key" else lay.value_scales_offset
            out.append((sc + page * self.scale_bytes, self.scale_bytes))
        return out

    def verify_object(self, layer_pos: int, data: bytes | bytearray | memoryview) -> str | None:
        """Check a whole layer object against this manifest: its size, every page's
        checksum (pages and scales), and the object checksum over the rest. Returns
        what differs, or None when it all matches."""
        lay = self.layers[layer_pos]
        mv = memoryview(data).cast("B")
        if mv.nbytes != lay.object_size:
            return (
                f"layer {lay.layer_index}: {mv.nbytes} bytes, the manifest says {lay.object_size}"
            )
        for role, sums in (("key", lay.key_page_checksums), ("value", lay.value_page_checksums)):
            for p in range(self.num_pages):
                parts = [mv[o : o + n] for o, n in self.page_range(layer_pos, role, p)]
                if page_checksum(*parts) != sums[p]:
                    return f"layer {lay.layer_index}: {role} page {p} checksum differs"
        fixed = [mv[o : o + n] for o, n in self.fixed_ranges(layer_pos)]
        if (
            object_checksum(fixed, lay.key_page_checksums, lay.value_page_checksums)
            != lay.object_checksum
        ):
            return f"layer {lay.layer_index}: object checksum differs"
        return None

    # ------------------------------------------------------------------ encoding

    def encoded_size(self) -> int:
        """``len(self.to_bytes())``, from the counts alone (the checksums and token
        values do not change it), so a writer can reserve room before it has them."""
        n = _HEADER.size + 8 + 2 + len(self.fingerprint) + 2 + len(self.segment_id) + 29 + 4
        for s in self.sequences:
            hl = len(s.page_hashes[0]) if s.page_hashes else 0
            n += (
                24 + 4 * len(s.token_ids) + 5 + hl * len(s.page_hashes) + 4 + 4 * len(s.block_table)
            )
        n += 4
        for lay in self.layers:
            n += (
                4
                + 2
                + len(lay.key.encode())
                + 48
                + 8 * (len(lay.key_page_checksums) + len(lay.value_page_checksums))
            )
        return n

    def to_bytes(self) -> bytes:
        self.validate()
        parts: list[bytes] = []
        put = parts.append
        put(_short_bytes(self.fingerprint))
        put(_short_bytes(self.segment_id))
        put(
            struct.pack(
                "<BIQQQ",
                _QUANT_CODES[self.quantization],
                self.page_size,
                self.num_pages,
                self.page_bytes,
                self.scale_bytes,
            )
        )
        put(struct.pack("<I", len(self.sequences)))
        for s in self.sequences:
            put(struct.pack("<QQQ", s.first_page, s.seq_len, len(s.token_ids)))
            put(np.asarray(s.token_ids, dtype="<u4").tobytes())
            hlen = len(s.page_hashes[0]) if s.page_hashes else 0
            put(struct.pack("<IB", len(s.page_hashes), hlen))
            put(b"".join(s.page_hashes))
            put(struct.pack("<I", len(s.block_table)))
            put(np.asarray(s.block_table, dtype="<u4").tobytes())
        put(struct.pack("<I", len(self.layers)))
        for lay in self.layers:
            put(struct.pack("<I", lay.layer_index))
            put(_short_bytes(lay.key.encode()))
            put(
                struct.pack(
                    "<QQQQQQ",
                    lay.object_size,
                    lay.object_checksum,
                    lay.key_pool_offset,
                    lay.value_pool_offset,
                    lay.key_scales_offset,
                    lay.value_scales_offset,
                )
            )
            put(np.asarray(lay.key_page_checksums, dtype="<u8").tobytes())
            put(np.asarray(lay.value_page_checksums, dtype="<u8").tobytes())
        body = b"".join(parts)
        head = _HEADER.pack(MANIFEST_MAGIC, MANIFEST_VERSION, 0, len(body))
        return head + body + struct.pack("<Q", checksum(head, body))

    def validate(self) -> None:
        """The manifest's own invariants; ``from_bytes`` and ``to_bytes`` both enforce them."""
        _need(
            self.quantization in _QUANT_CODES,
            f"quantization must be one of {list(_QUANT_CODES)}, got {self.quantization!r}",
        )
        _need(self.page_size >= 1, f"page_size must be >= 1, got {self.page_size}")
        _need(self.page_bytes >= 1, f"page_bytes must be >= 1, got {self.page_bytes}")
        _need(
            (self.scale_bytes > 0) == (self.quantization is not None),
            "scale_bytes must be > 0 exactly when quantized",
        )
        _need(
            len(self.fingerprint) <= 0xFFFF and len(self.segment_id) <= 0xFFFF,
            "fingerprint and segment_id are at most 65535 bytes",
        )
        for i, s in enumerate(self.sequences):
            what = f"sequence {i}"
            _need(
                len(s.token_ids) == s.seq_len,
                f"{what}: expected seq_len = {s.seq_len} token ids, got {len(s.token_ids)}",
            )
            pages_total = -(-s.seq_len // self.page_size)
            _need(
                s.first_page + len(s.block_table) <= pages_total,
                f"{what}: stores pages [{s.first_page}, {s.first_page + len(s.block_table)}) "
                f"but {s.seq_len} tokens fill only {pages_total} pages",
            )
            full_stored = max(
                0, min(len(s.block_table), s.seq_len // self.page_size - s.first_page)
            )
            _need(
                len(s.page_hashes) == full_stored,
                f"{what}: expected {full_stored} page hashes (one per stored full page), "
                f"got {len(s.page_hashes)}",
            )
            if s.page_hashes:
                hl = len(s.page_hashes[0])
                _need(
                    16 <= hl <= MAX_HASH_LEN and all(len(h) == hl for h in s.page_hashes),
                    f"{what}: page hashes must share one length in [16, {MAX_HASH_LEN}]",
                )
            _need(
                all(0 <= p < self.num_pages for p in s.block_table),
                f"{what}: block table entries must be in [0, {self.num_pages})",
            )
            _need(
                all(0 <= t <= 0xFFFFFFFF for t in s.token_ids),
                f"{what}: token ids must be in [0, 2**32)",
            )
        seen = set()
        for lay in self.layers:
            what = f"layer {lay.layer_index}"
            _need(lay.layer_index not in seen, f"{what} appears twice")
            seen.add(lay.layer_index)
            _need(
                len(lay.key_page_checksums) == self.num_pages == len(lay.value_page_checksums),
                f"{what}: expected {self.num_pages} page checksums per role, got "
                f"{len(lay.key_page_checksums)} key and {len(lay.value_page_checksums)} value",
            )
            span = self.num_pages * self.page_bytes
            for name, off in (
                ("key_pool_offset", lay.key_pool_offset),
                ("value_pool_offset", lay.value_pool_offset),
            ):
                _need(
                    off + span <= lay.object_size,
                    f"{what}: {name} {off} + {span} page bytes exceed object_size "
                    f"{lay.object_size}",
                )
            if self.scale_bytes:
                sspan = self.num_pages * self.scale_bytes
                for name, off in (
                    ("key_scales_offset", lay.key_scales_offset),
                    ("value_scales_offset", lay.value_scales_offset),
                ):
                    _need(
                        off + sspan <= lay.object_size,
                        f"{what}: {name} {off} + {sspan} bytes exceed object_size "
                        f"{lay.object_size}",
                    )

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> Manifest:
        """Parse and verify a manifest. Raises only FormatError subclasses."""
        mv = memoryview(data)
        if mv.ndim != 1 or mv.itemsize != 1:
            mv = mv.cast("B")
        if len(mv) < _HEADER.size + 8:
            raise errors.TruncatedError(
                f"manifest: expected at least {_HEADER.size + 8} bytes, got {len(mv)}"
            )
        magic, version, flags, body_len = _HEADER.unpack_from(mv, 0)
        if magic != MANIFEST_MAGIC:
            raise errors.ManifestError(
                f"manifest: expected magic {MANIFEST_MAGIC!r}, got {bytes(magic)!r}"
            )
        if version != MANIFEST_VERSION:
            raise errors.VersionError(
                f"manifest: expected version {MANIFEST_VERSION}, got {version}"
            )
        if flags != 0:
            raise errors.ManifestError(f"manifest: reserved flags must be 0, got {flags:#x}")
        if body_len != len(mv) - _HEADER.size - 8:
            raise errors.TruncatedError(
                f"manifest: header declares a {body_len}-byte body, "
                f"{len(mv) - _HEADER.size - 8} bytes are present"
            )
        end = _HEADER.size + body_len
        (stored,) = struct.unpack_from("<Q", mv, end)
        actual = checksum(mv[:end])
        if stored != actual:
            raise errors.ChecksumError(
                f"manifest: checksum {stored:#018x} recorded, {actual:#018x} computed"
            )
        r = Cursor(mv, lambda m: errors.TruncatedError(f"manifest: {m}"), _HEADER.size, end)
        try:
            fingerprint = r.short_bytes()
            segment_id = r.short_bytes()
            qcode, page_size, num_pages, page_bytes, scale_bytes = r.unpack("<BIQQQ")
            if qcode not in _QUANT_NAMES:
                raise errors.ManifestError(f"manifest: unknown quantization code {qcode}")
            seqs = []
            for _ in range(r.count("<I", 8 + 8 + 8 + 5 + 4)):
                first_page, seq_len, n_tok = r.unpack("<QQQ")
                tokens = r.array("<u4", n_tok)
                n_hash, hlen = r.unpack("<IB")
                # Checked before the loop: a count of empty hashes would take no bytes and
                # loop n_hash times (2**32 - 1 from a 146-byte manifest).
                if n_hash and not 16 <= hlen <= MAX_HASH_LEN:
                    raise errors.ManifestError(
                        f"manifest: page hashes of {hlen} bytes; expected 16 to {MAX_HASH_LEN}"
                    )
                raw = r.take(n_hash * hlen)
                hashes = tuple(bytes(raw[i * hlen : (i + 1) * hlen]) for i in range(n_hash))
                (n_pages,) = r.unpack("<I")
                bt = r.array("<u4", n_pages)
                seqs.append(
                    ManifestSeq(
                        tuple(tokens.tolist()), first_page, seq_len, hashes, tuple(bt.tolist())
                    )
                )
            layers = []
            for _ in range(r.count("<I", 4 + 2 + 48)):
                (layer_index,) = r.unpack("<I")
                key = bytes(r.short_bytes()).decode("utf-8")
                size, csum, kpo, vpo, kso, vso = r.unpack("<QQQQQQ")
                kc = r.array("<u8", num_pages)
                vc = r.array("<u8", num_pages)
                layers.append(
                    ManifestLayer(
                        layer_index,
                        key,
                        size,
                        csum,
                        kpo,
                        vpo,
                        kso,
                        vso,
                        tuple(kc.tolist()),
                        tuple(vc.tolist()),
                    )
                )
            if r.pos != end:
                raise errors.ManifestError(
                    f"manifest: {end - r.pos} unparsed bytes at the end of the body"
                )
        except UnicodeDecodeError as e:
            raise errors.ManifestError(f"manifest: object key is not UTF-8: {e}") from e
        m = cls(
            fingerprint=bytes(fingerprint),
            segment_id=bytes(segment_id),
            quantization=_QUANT_NAMES[qcode],
            page_size=page_size,
            num_pages=num_pages,
            page_bytes=page_bytes,
            scale_bytes=scale_bytes,
            sequences=tuple(seqs),
            layers=tuple(layers),
        )
        m.validate()
        return m


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise errors.ManifestError(f"manifest: {msg}")


def _short_bytes(b: bytes) -> bytes:
    return struct.pack("<H", len(b)) + b
