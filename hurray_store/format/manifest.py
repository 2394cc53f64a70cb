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

from dataclasses import dataclass

from hurray_store.format import manifest_codec as codec
from hurray_store.format.checksums import object_checksum, page_checksum
from hurray_store.format.manifest_codec import MANIFEST_MAGIC, MANIFEST_VERSION

__all__ = ["MANIFEST_MAGIC", "MANIFEST_VERSION", "Manifest", "ManifestLayer", "ManifestSeq"]


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

    # ------------------------------------------------------------------ bytes

    def encoded_size(self) -> int:
        """``len(self.to_bytes())``, from the counts alone (the checksums and token
        values do not change it), so a writer can reserve room before it has them."""
        return codec.encoded_size(self)

    def to_bytes(self) -> bytes:
        return codec.encode_manifest(self)

    def validate(self) -> None:
        """The manifest's own invariants; ``from_bytes`` and ``to_bytes`` both enforce them."""
        codec.validate_manifest(self)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> Manifest:
        """Parse and verify a manifest. Raises only FormatError subclasses."""
        return codec.decode_manifest(data, cls, ManifestSeq, ManifestLayer)
