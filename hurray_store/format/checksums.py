"""The checksums of the format: xxh3-64 of bytes, of a stored page, of a layer object
(integrity, not authentication; docs/format.md)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash


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
