"""Objects as tensors on the wire: the descriptor of a stored object (pure).

The cache server sends and receives every stored object, a layer object or a manifest,
as one rank-1 ``uint8`` row-major tensor (layout tag ``0x01``) whose data buffer is the
object's bytes at rest. A layer object is itself a Hurray stream (two block-paged
descriptors and their buffers), so any Hurray reader decodes what arrives.

``blob_descriptor`` patches the two size fields of a descriptor pyhurray built once and
has pyhurray decode the result before it is used; ``parse_blob_descriptor`` reads a peer's
descriptor with pyhurray's decoder (which never touches buffers) and checks that it is
such a tensor before anything is allocated for its data.
"""

from __future__ import annotations

import functools
import struct

import hurray

from hurray_store.errors import DescriptorError, FormatError

# Offsets in a rank-1 row-major descriptor (metadata.md): 20 shape[0] u64 | 28
# byte_offset u64 | 36 buffer_count u8 | 37 handle 0 (byte_size u64 first).
OFF_SHAPE0 = 20
OFF_BYTE_SIZE = 37


@functools.cache
def _template() -> bytes:
    d = hurray.zeros((1,), dtype=hurray.uint8).descriptor
    raw = d.encode()
    assert struct.unpack_from("<Q", raw, OFF_SHAPE0)[0] == 1
    assert struct.unpack_from("<Q", raw, OFF_BYTE_SIZE)[0] == 1
    return raw


@functools.lru_cache(maxsize=4096)
def blob_descriptor(nbytes: int) -> bytes:
    """The encoded descriptor of a ``uint8[nbytes]`` row-major CPU tensor."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    raw = bytearray(_template())
    struct.pack_into("<Q", raw, OFF_SHAPE0, nbytes)
    struct.pack_into("<Q", raw, OFF_BYTE_SIZE, nbytes)
    out = bytes(raw)
    got, used = parse_blob_descriptor(out)
    assert got == nbytes and used == len(out)
    return out


def parse_blob_descriptor(data: bytes | bytearray | memoryview) -> tuple[int, int]:
    """``(data bytes, descriptor length)`` of a blob descriptor at the start of
    ``data``; the descriptor's own ``descriptor_length`` delimits it (transport fields
    may follow). Raises FormatError for anything else."""
    mv = memoryview(data)
    try:
        d = hurray.Descriptor.decode(bytes(mv[:4096]))
    except Exception as e:  # pyhurray's InvalidDescriptorError and friends
        raise DescriptorError(f"not a Hurray descriptor: {e}") from e
    used = int(d.encoded_len)
    if used > mv.nbytes:
        raise FormatError(f"descriptor declares {used} bytes, {mv.nbytes} present")
    if str(d.dtype) != "uint8" or d.ndim != 1 or type(d.layout).__name__ != "RowMajorLayout":
        raise FormatError(
            f"this server stores objects as uint8 rank-1 row-major tensors, got {d!r}"
        )
    if (
        d.buffer_count != 1
        or d.byte_offset != 0
        or d.shard is not None
        or d.quantization is not None
    ):
        raise FormatError(
            "an object tensor has one buffer, byte_offset 0, no shard and no quantization"
        )
    if d.device.kind != "cpu":
        raise FormatError(f"objects travel in CPU memory, got device {d.device.kind}")
    dim = d.shape[0]
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
        # A dynamic dimension (or anything but a length) describes no bytes to receive.
        raise FormatError(f"an object tensor has a fixed length, got shape {tuple(d.shape)!r}")
    n = dim
    if int(d.buffer_handles[0].byte_size) != n:
        raise FormatError(f"buffer of {d.buffer_handles[0].byte_size} bytes for {n} elements")
    return n, used
