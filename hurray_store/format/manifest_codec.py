"""The manifest's bytes (docs/format.md, "The manifest"; the layout is in
``format/manifest.py``): its size from the counts alone, its encoding, its invariants,
and its parsing, which checks before it trusts or allocates."""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import numpy as np

from hurray_store import errors
from hurray_store.format.checksums import checksum
from hurray_store.format.cursor import Cursor

if TYPE_CHECKING:  # the types only: ``manifest`` builds on this module, not back
    from hurray_store.format.manifest import Manifest, ManifestLayer, ManifestSeq

MANIFEST_MAGIC = b"HSMF"
MANIFEST_VERSION = 1
HEADER = struct.Struct("<4sHHQ")
QUANT_CODES = {None: 0, "int8": 1}
QUANT_NAMES = {v: k for k, v in QUANT_CODES.items()}
MAX_HASH_LEN = 64


def encoded_size(m: Manifest) -> int:
    """``len(m.to_bytes())``, from the counts alone (the checksums and token
    values do not change it), so a writer can reserve room before it has them."""
    n = HEADER.size + 8 + 2 + len(m.fingerprint) + 2 + len(m.segment_id) + 29 + 4
    for s in m.sequences:
        hl = len(s.page_hashes[0]) if s.page_hashes else 0
        n += 24 + 4 * len(s.token_ids) + 5 + hl * len(s.page_hashes) + 4 + 4 * len(s.block_table)
    n += 4
    for lay in m.layers:
        n += (
            4
            + 2
            + len(lay.key.encode())
            + 48
            + 8 * (len(lay.key_page_checksums) + len(lay.value_page_checksums))
        )
    return n


def encode_manifest(m: Manifest) -> bytes:
    validate_manifest(m)
    parts: list[bytes] = []
    put = parts.append
    put(_short_bytes(m.fingerprint))
    put(_short_bytes(m.segment_id))
    put(
        struct.pack(
            "<BIQQQ",
            QUANT_CODES[m.quantization],
            m.page_size,
            m.num_pages,
            m.page_bytes,
            m.scale_bytes,
        )
    )
    put(struct.pack("<I", len(m.sequences)))
    for s in m.sequences:
        put(struct.pack("<QQQ", s.first_page, s.seq_len, len(s.token_ids)))
        put(np.asarray(s.token_ids, dtype="<u4").tobytes())
        hlen = len(s.page_hashes[0]) if s.page_hashes else 0
        put(struct.pack("<IB", len(s.page_hashes), hlen))
        put(b"".join(s.page_hashes))
        put(struct.pack("<I", len(s.block_table)))
        put(np.asarray(s.block_table, dtype="<u4").tobytes())
    put(struct.pack("<I", len(m.layers)))
    for lay in m.layers:
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
    head = HEADER.pack(MANIFEST_MAGIC, MANIFEST_VERSION, 0, len(body))
    return head + body + struct.pack("<Q", checksum(head, body))


def validate_manifest(m: Manifest) -> None:
    """The manifest's own invariants; ``from_bytes`` and ``to_bytes`` both enforce them."""
    _need(
        m.quantization in QUANT_CODES,
        f"quantization must be one of {list(QUANT_CODES)}, got {m.quantization!r}",
    )
    _need(m.page_size >= 1, f"page_size must be >= 1, got {m.page_size}")
    _need(m.page_bytes >= 1, f"page_bytes must be >= 1, got {m.page_bytes}")
    _need(
        (m.scale_bytes > 0) == (m.quantization is not None),
        "scale_bytes must be > 0 exactly when quantized",
    )
    _need(
        len(m.fingerprint) <= 0xFFFF and len(m.segment_id) <= 0xFFFF,
        "fingerprint and segment_id are at most 65535 bytes",
    )
    for i, s in enumerate(m.sequences):
        what = f"sequence {i}"
        _need(
            len(s.token_ids) == s.seq_len,
            f"{what}: expected seq_len = {s.seq_len} token ids, got {len(s.token_ids)}",
        )
        pages_total = -(-s.seq_len // m.page_size)
        _need(
            s.first_page + len(s.block_table) <= pages_total,
            f"{what}: stores pages [{s.first_page}, {s.first_page + len(s.block_table)}) "
            f"but {s.seq_len} tokens fill only {pages_total} pages",
        )
        full_stored = max(0, min(len(s.block_table), s.seq_len // m.page_size - s.first_page))
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
            all(0 <= p < m.num_pages for p in s.block_table),
            f"{what}: block table entries must be in [0, {m.num_pages})",
        )
        _need(
            all(0 <= t <= 0xFFFFFFFF for t in s.token_ids),
            f"{what}: token ids must be in [0, 2**32)",
        )
    seen = set()
    for lay in m.layers:
        what = f"layer {lay.layer_index}"
        _need(lay.layer_index not in seen, f"{what} appears twice")
        seen.add(lay.layer_index)
        _need(
            len(lay.key_page_checksums) == m.num_pages == len(lay.value_page_checksums),
            f"{what}: expected {m.num_pages} page checksums per role, got "
            f"{len(lay.key_page_checksums)} key and {len(lay.value_page_checksums)} value",
        )
        roles = ("key", "value")
        spans = [(f"{r}_pool_offset", m.num_pages * m.page_bytes, " page") for r in roles]
        if m.scale_bytes:
            spans += [(f"{r}_scales_offset", m.num_pages * m.scale_bytes, "") for r in roles]
        for name, span, unit in spans:
            off = getattr(lay, name)
            _need(
                off + span <= lay.object_size,
                f"{what}: {name} {off} + {span}{unit} bytes exceed object_size {lay.object_size}",
            )


def decode_manifest(
    data: bytes | bytearray | memoryview,
    manifest: type[Manifest],
    seq: type[ManifestSeq],
    layer: type[ManifestLayer],
) -> Manifest:
    """Parse and verify a manifest. Raises only FormatError subclasses."""
    mv = memoryview(data)
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    if len(mv) < HEADER.size + 8:
        raise errors.TruncatedError(
            f"manifest: expected at least {HEADER.size + 8} bytes, got {len(mv)}"
        )
    magic, version, flags, body_len = HEADER.unpack_from(mv, 0)
    if magic != MANIFEST_MAGIC:
        raise errors.ManifestError(
            f"manifest: expected magic {MANIFEST_MAGIC!r}, got {bytes(magic)!r}"
        )
    if version != MANIFEST_VERSION:
        raise errors.VersionError(f"manifest: expected version {MANIFEST_VERSION}, got {version}")
    if flags != 0:
        raise errors.ManifestError(f"manifest: reserved flags must be 0, got {flags:#x}")
    if body_len != len(mv) - HEADER.size - 8:
        raise errors.TruncatedError(
            f"manifest: header declares a {body_len}-byte body, "
            f"{len(mv) - HEADER.size - 8} bytes are present"
        )
    end = HEADER.size + body_len
    (stored,) = struct.unpack_from("<Q", mv, end)
    actual = checksum(mv[:end])
    if stored != actual:
        raise errors.ChecksumError(
            f"manifest: checksum {stored:#018x} recorded, {actual:#018x} computed"
        )
    r = Cursor(mv, lambda m: errors.TruncatedError(f"manifest: {m}"), HEADER.size, end)
    try:
        fingerprint = r.short_bytes()
        segment_id = r.short_bytes()
        qcode, page_size, num_pages, page_bytes, scale_bytes = r.unpack("<BIQQQ")
        if qcode not in QUANT_NAMES:
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
                seq(tuple(tokens.tolist()), first_page, seq_len, hashes, tuple(bt.tolist()))
            )
        layers = []
        for _ in range(r.count("<I", 4 + 2 + 48)):
            (layer_index,) = r.unpack("<I")
            key = bytes(r.short_bytes()).decode("utf-8")
            size, csum, kpo, vpo, kso, vso = r.unpack("<QQQQQQ")
            kc = r.array("<u8", num_pages)
            vc = r.array("<u8", num_pages)
            layers.append(
                layer(
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
    m = manifest(
        fingerprint=bytes(fingerprint),
        segment_id=bytes(segment_id),
        quantization=QUANT_NAMES[qcode],
        page_size=page_size,
        num_pages=num_pages,
        page_bytes=page_bytes,
        scale_bytes=scale_bytes,
        sequences=tuple(seqs),
        layers=tuple(layers),
    )
    validate_manifest(m)
    return m


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise errors.ManifestError(f"manifest: {msg}")


def _short_bytes(b: bytes) -> bytes:
    return struct.pack("<H", len(b)) + b
