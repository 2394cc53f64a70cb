"""Decoding: a layer object validated before anything is trusted, then zero-copy
views (pure, no I/O)."""

from __future__ import annotations

import logging
import struct
import warnings
from dataclasses import dataclass

import hurray
import numpy as np
import torch

from hurray_store import errors
from hurray_store.format.descriptor import (
    _elem_size,
)
from hurray_store.format.layout import (
    BLOCK_PAGED_TAG,
    FIXED_HEADER_LEN,
    HURRAY_TO_TORCH,
    INDEX_NP,
    MAGIC,
    OFF_PAGED_AXIS,
    READER_VERSION_MAJOR,
    UINT32_MAX,
    LayerKV,
    validate_index,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ParsedTensor:
    """One block-paged tensor found in an object, its sizes checked, nothing read yet."""

    descriptor: hurray.Descriptor
    descriptor_len: int
    offset: int  # where the descriptor starts in the object
    buffer_offsets: tuple[int, ...]
    buffer_sizes: tuple[int, ...]
    end: int
    dtype_name: str  # "float16" | "bfloat16" | "float32" | "int8"
    scale_dtype_name: str | None
    index_type: str
    table_len: int


def _decode_descriptor(mv: memoryview, off: int, what: str) -> tuple[hurray.Descriptor, int]:
    n = len(mv)
    if n - off < FIXED_HEADER_LEN:
        raise errors.TruncatedError(
            f"{what}: expected a {FIXED_HEADER_LEN}-byte descriptor header at offset {off}, "
            f"only {n - off} bytes remain"
        )
    head = bytes(mv[off : off + FIXED_HEADER_LEN])
    if head[:4] != MAGIC:
        raise errors.DescriptorError(
            f"{what}: expected magic {MAGIC!r} at offset {off}, got {head[:4]!r}"
        )
    if head[4] > READER_VERSION_MAJOR:
        raise errors.VersionError(
            f"{what}: format version {head[4]}.{head[5]} is newer than this reader "
            f"(major {READER_VERSION_MAJOR}); upgrade hurray_store"
        )
    (dlen,) = struct.unpack_from("<I", head, 6)
    if dlen < FIXED_HEADER_LEN:
        raise errors.DescriptorError(
            f"{what}: descriptor_length must be >= {FIXED_HEADER_LEN}, got {dlen}"
        )
    if dlen > n - off:
        raise errors.TruncatedError(
            f"{what}: descriptor declares {dlen} bytes, only {n - off} remain at offset {off}"
        )
    # Checks on the fixed header that name the problem more precisely than pyhurray's
    # decoder would (it rejects these too, as a generic invalid descriptor).
    (flags,) = struct.unpack_from("<I", head, 10)
    layout_tag, rank = head[15], struct.unpack_from("<I", head, 16)[0]
    if layout_tag != BLOCK_PAGED_TAG:
        raise errors.LayoutError(
            f"{what}: expected layout tag 0x0A (block-paged), got {layout_tag:#04x}"
        )
    if rank != 3:
        raise errors.RankError(
            f"{what}: block-paged tensors must be rank 3 [total_tokens, heads, head_dim], "
            f"got rank {rank}"
        )
    if flags & 0x2:
        raise errors.ShardError(
            f"{what}: a block-paged descriptor must not carry a shard (HAS_SHARD is set)"
        )
    if dlen >= OFF_PAGED_AXIS + 4:
        # Kept even when permissive: a LayerKV has nowhere to put another paged axis.
        (paged_axis,) = struct.unpack_from("<I", mv, off + OFF_PAGED_AXIS)
        if paged_axis != 0:
            raise errors.PagedAxisError(f"{what}: paged_axis must be 0, got {paged_axis}")
    try:
        d = hurray.Descriptor.decode(bytes(mv[off : off + dlen]))
    except BaseException as e:  # pyo3 panics derive from BaseException
        if isinstance(e, KeyboardInterrupt | SystemExit | GeneratorExit):
            raise
        msg = f"{what}: pyhurray rejects the descriptor at offset {off}: {e}"
        if "quantization" in str(e):  # its decoder enforces the block-paged quantization rules
            raise errors.QuantizationError(msg) from e
        raise errors.DescriptorError(msg) from e
    if d.encoded_len != dlen:
        raise errors.DescriptorError(
            f"{what}: descriptor_length says {dlen} bytes, its fields take {d.encoded_len}"
        )
    return d, dlen


def parse_chunk(
    data: bytes | bytearray | memoryview,
) -> tuple[list[tuple[ParsedTensor, ParsedTensor]], memoryview]:
    """Parse a chunk object (the LMCache plugin's chunks, SGLang's pages): layers, each a
    key and a value block-paged tensor (or each one tensor of kv_role ``fused``, an MLA
    latent, given as its layer's key and value), then one ``uint8`` tensor that ends the
    stream (its record). The layers' descriptors, and the record's bytes (not parsed
    here). Raises a ``FormatError`` subclass for anything else."""
    from hurray_store.format.wire import parse_blob_descriptor

    mv = memoryview(data)
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    layers: list[tuple[ParsedTensor, ParsedTensor]] = []
    off = 0
    while off < len(mv):
        try:
            n, used = parse_blob_descriptor(mv[off:])
        except errors.FormatError:
            pass
        else:
            if off + used + n != len(mv):
                raise errors.TensorCountError(
                    f"a record of {n} bytes at {off} does not end the {len(mv)}-byte object"
                )
            if not layers:
                raise errors.TensorCountError("a chunk object with no layer before its record")
            return layers, mv[off + used :]
        k = _parse_tensor(mv, off, f"layer {len(layers)} key tensor")
        if k.descriptor.layout.kv_role == "fused":  # an MLA latent: the layer's one tensor
            _check_fused(k, layers)
            layers.append((k, k))
            off = k.end
            continue
        v = _parse_tensor(mv, k.end, f"layer {len(layers)} value tensor")
        _check_pair(k, v, mv[: v.end])
        if layers and layers[0][0] is layers[0][1]:
            raise errors.RoleError("a chunk object mixes fused layers and key/value layers")
        layers.append((k, v))
        off = v.end
    raise errors.TensorCountError("a chunk object ends in its record; this one has none")


def _parse_tensor(mv: memoryview, off: int, what: str) -> ParsedTensor:
    # Layout tag, rank, shard and paged_axis were checked on the header bytes already.
    d, dlen = _decode_descriptor(mv, off, what)
    lay = d.layout
    if any(s is None for s in d.shape):
        raise errors.RankError(f"{what}: dynamic dimensions are not allowed, got shape {d.shape}")
    if d.extension_type is not None:
        raise errors.DtypeError(
            f"{what}: extension element types are not KV data, got {d.extension_type!r}"
        )
    if d.byte_offset != 0:
        raise errors.DescriptorError(
            f"{what}: byte_offset must be 0 for block-paged, got {d.byte_offset}"
        )
    if lay.page_size < 1:
        raise errors.DescriptorError(f"{what}: page_size must be >= 1, got {lay.page_size}")
    if d.shape[1] < 1 or d.shape[2] < 1:
        raise errors.RankError(f"{what}: heads and head_dim must be >= 1, got shape {d.shape}")
    dname = d.dtype.name
    q = d.quantization
    scale_name: str | None = None
    nbuf_expected = 3
    if q is None:
        if dname not in HURRAY_TO_TORCH:
            raise errors.DtypeError(
                f"{what}: expected float16, bfloat16 or float32 (or int8 with "
                f"quantization), got {dname}"
            )
    else:
        try:
            lay.validate_quantization_compatibility(q)
        except hurray.InvalidDescriptorError as e:
            raise errors.QuantizationError(
                f"{what}: quantization breaks the block-paged rules: {e}"
            ) from e
        if not isinstance(q, hurray.PerBlockAffine):
            raise errors.UnsupportedQuantizationError(
                f"{what}: only per-block-affine int8 (one scale per page slot) is dequantized "
                f"here, got {q!r}"
            )
        if q.axis != 0 or q.block_size != lay.page_size:
            raise errors.QuantizationError(
                f"{what}: per-block-affine needs axis 0 and block_size == page_size "
                f"({lay.page_size}), got axis {q.axis}, block_size {q.block_size}"
            )
        if q.scale_buffer_index != 3:
            raise errors.QuantizationError(
                f"{what}: scales must be buffer 3, got {q.scale_buffer_index}"
            )
        if q.zero_point_buffer_index is not None:
            raise errors.UnsupportedQuantizationError(
                f"{what}: asymmetric (zero-point) schemes are not supported"
            )
        if dname != "int8":
            raise errors.UnsupportedQuantizationError(
                f"{what}: quantized data must be int8, got {dname}"
            )
        scale_name = q.scale_type.name
        if scale_name not in HURRAY_TO_TORCH:
            raise errors.UnsupportedQuantizationError(
                f"{what}: scale type must be float16, bfloat16 or float32, got {scale_name}"
            )
        nbuf_expected = 4
    sizes = tuple(int(h.byte_size) for h in d.buffer_handles)
    if len(sizes) != nbuf_expected:
        raise errors.BufferSizeError(f"{what}: expected {nbuf_expected} buffers, got {len(sizes)}")
    index_type = lay.block_table_index_type
    width = INDEX_NP[index_type].itemsize
    total_tokens, heads, dim = (int(s) for s in d.shape)
    page_size, num_pages, num_seqs = int(lay.page_size), int(lay.num_pages), int(lay.num_seqs)
    if sizes[1] % width:
        raise errors.BufferSizeError(
            f"{what}: block_table size {sizes[1]} is not a multiple of {width}"
        )
    table_len = sizes[1] // width
    if total_tokens != table_len * page_size:
        raise errors.BufferSizeError(
            f"{what}: shape[0] must be len(block_table) * page_size = "
            f"{table_len * page_size}, got {total_tokens}"
        )
    if sizes[2] != (num_seqs + 1) * width:
        raise errors.BufferSizeError(
            f"{what}: seq_ptr must hold num_seqs + 1 = {num_seqs + 1} entries "
            f"({(num_seqs + 1) * width} bytes), got {sizes[2]} bytes"
        )
    elem = _elem_size(dname)
    pool_expected = num_pages * page_size * heads * dim * elem
    if sizes[0] != pool_expected:
        raise errors.BufferSizeError(
            f"{what}: page_pool must be num_pages*page_size*heads*head_dim*{elem} = "
            f"{pool_expected} bytes, got {sizes[0]}"
        )
    if scale_name is not None:
        sc_expected = num_pages * page_size * _elem_size(scale_name)
        if sizes[3] != sc_expected:
            raise errors.BufferSizeError(
                f"{what}: scales must be num_pages*page_size = {num_pages * page_size} entries "
                f"({sc_expected} bytes), got {sizes[3]}"
            )
    pos = off + dlen
    offs = []
    for s in sizes:
        offs.append(pos)
        pos += s
    if pos > len(mv):
        raise errors.TruncatedError(
            f"{what}: descriptor and buffers need {pos - off} bytes from offset {off}, "
            f"only {len(mv) - off} remain"
        )
    return ParsedTensor(
        descriptor=d,
        descriptor_len=dlen,
        offset=off,
        buffer_offsets=tuple(offs),
        buffer_sizes=sizes,
        end=pos,
        dtype_name=dname,
        scale_dtype_name=scale_name,
        index_type=index_type,
        table_len=table_len,
    )


def _check_fused(t: ParsedTensor, layers: list[tuple[ParsedTensor, ParsedTensor]]) -> None:
    """A fused layer of a chunk object: layer-scoped, and not beside key/value layers."""
    lay = t.descriptor.layout
    if lay.layer_index is None or lay.layer_index == UINT32_MAX:
        raise errors.LayerMismatchError(
            "layer_index must name a layer, got 0xFFFFFFFF (not layer-scoped)"
        )
    if layers and layers[0][0] is not layers[0][1]:
        raise errors.RoleError("a chunk object mixes fused layers and key/value layers")


def _check_pair(k: ParsedTensor, v: ParsedTensor, mv: memoryview) -> None:
    kl, vl = k.descriptor.layout, v.descriptor.layout
    if kl.kv_role != "key":
        raise errors.RoleError(f"the first tensor must have kv_role key, got {kl.kv_role}")
    if vl.kv_role != "value":
        raise errors.RoleError(f"the second tensor must have kv_role value, got {vl.kv_role}")
    if kl.layer_index != vl.layer_index:
        raise errors.LayerMismatchError(
            f"key and value must name one layer, got key layer {kl.layer_index}, value "
            f"layer {vl.layer_index}"
        )
    if kl.layer_index is None or kl.layer_index == UINT32_MAX:
        raise errors.LayerMismatchError(
            "layer_index must name a layer, got 0xFFFFFFFF (not layer-scoped)"
        )
    for f in ("page_size", "num_pages", "num_seqs", "block_table_index_type"):
        a, b = getattr(kl, f), getattr(vl, f)
        if a != b:
            raise errors.PagingMismatchError(f"key and value disagree on {f}: key {a}, value {b}")
    if k.descriptor.shape != v.descriptor.shape:
        raise errors.PagingMismatchError(
            f"key and value shapes differ: key {k.descriptor.shape}, value {v.descriptor.shape}"
        )
    if (k.dtype_name, k.scale_dtype_name) != (v.dtype_name, v.scale_dtype_name):
        raise errors.PagingMismatchError(
            f"key and value element types differ: key {k.dtype_name}/{k.scale_dtype_name}, "
            f"value {v.dtype_name}/{v.scale_dtype_name}"
        )
    for i, name in ((1, "block_table"), (2, "seq_ptr")):
        a = mv[k.buffer_offsets[i] : k.buffer_offsets[i] + k.buffer_sizes[i]]
        b = mv[v.buffer_offsets[i] : v.buffer_offsets[i] + v.buffer_sizes[i]]
        if a.nbytes != b.nbytes or bytes(a) != bytes(b):
            raise errors.PagingMismatchError(f"key and value {name} buffers differ")


def parse_layer(
    data: bytes | bytearray | memoryview, *, permissive: bool = False
) -> tuple[ParsedTensor, ParsedTensor]:
    """Parse and check the two descriptors of a layer object without touching its pages
    (or the one of a fused layer, an MLA latent: returned as its key and value).

    Raises a ``FormatError`` subclass for anything that is not a well-formed layer object;
    the index invariants are checked unless ``permissive``.
    """
    mv = memoryview(data)
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    k = _parse_tensor(mv, 0, "key tensor")
    if k.descriptor.layout.kv_role == "fused":
        if k.end != len(mv):
            raise errors.TensorCountError(
                f"a fused layer object is one tensor; {len(mv) - k.end} bytes follow it"
            )
        _check_fused(k, [])
        v = k
    elif k.end == len(mv):
        raise errors.TensorCountError(
            f"expected two tensors (key, value), the stream ends after one ({len(mv)} bytes)"
        )
    else:
        v = _parse_tensor(mv, k.end, "value tensor")
        if v.end != len(mv):
            raise errors.TensorCountError(
                f"expected exactly two tensors, {len(mv) - v.end} bytes follow the value tensor"
            )
        _check_pair(k, v, mv)
    if not permissive:
        validate_index(
            _index_array(mv, k, 1),
            _index_array(mv, k, 2),
            int(k.descriptor.layout.num_pages),
            int(k.descriptor.layout.num_seqs),
        )
    return k, v


def _index_array(mv: memoryview, p: ParsedTensor, i: int) -> np.ndarray:
    idx = INDEX_NP[p.index_type]
    return np.frombuffer(
        mv, dtype=idx, count=p.buffer_sizes[i] // idx.itemsize, offset=p.buffer_offsets[i]
    )


def view_tensor(mv: memoryview, off: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over ``mv[off:off + nbytes]`` (no copy; read-only input stays read-only
    by contract)."""
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    esz = dtype.itemsize
    with warnings.catch_warnings():
        # torch warns when it wraps an immutable buffer (bytes). Decoded layers over
        # immutable input are read-only by contract (decode_layer says so): noise here.
        warnings.filterwarnings(
            "ignore", message="The given buffer is not writable", category=UserWarning
        )
        return torch.frombuffer(mv, dtype=dtype, count=nbytes // esz, offset=off)


def _pool(mv: memoryview, p: ParsedTensor, dtype: torch.dtype | None) -> torch.Tensor:
    lay = p.descriptor.layout
    _, heads, dim = (int(s) for s in p.descriptor.shape)
    shape = (int(lay.num_pages), int(lay.page_size), heads, dim)
    if p.scale_dtype_name is None:
        t = view_tensor(
            mv, p.buffer_offsets[0], p.buffer_sizes[0], HURRAY_TO_TORCH[p.dtype_name]
        ).view(shape)
        return t if dtype is None or dtype == t.dtype else t.to(dtype)
    q = view_tensor(mv, p.buffer_offsets[0], p.buffer_sizes[0], torch.int8).view(
        shape[0] * shape[1], heads * dim
    )
    sc = view_tensor(
        mv, p.buffer_offsets[3], p.buffer_sizes[3], HURRAY_TO_TORCH[p.scale_dtype_name]
    )
    out_dtype = dtype or HURRAY_TO_TORCH[p.scale_dtype_name]
    return (q.float() * sc.float()[:, None]).to(out_dtype).view(shape)


def decode_layer(
    data: bytes | bytearray | memoryview,
    *,
    permissive: bool = False,
    dtype: torch.dtype | None = None,
) -> LayerKV:
    """Decode one layer object, validating before trusting.

    Checks magic and version, exactly two block-paged tensors (key then value, one layer,
    the same paging fields, shapes and index buffers; or one of kv_role ``fused``, an
    MLA latent, given back as both keys and values), rank 3, paged_axis 0, no shard,
    every declared size against the bytes present, the quantization rules, and, unless
    ``permissive``, the index invariants (``seq_ptr[0] == 0``, non-decreasing,
    ``seq_ptr[-1] == len(block_table)``, ``0 <= block_table[k] < num_pages``).
    ``permissive=True`` skips only those index invariants (the spec lets a permissive
    reader accept them); a LayerKV whose block table names a missing page then fails at
    the first index operation, it never reads outside the pool.

    Unquantized pools come back as zero-copy views of ``data`` (read-only when ``data``
    is immutable; their addresses need not be aligned). int8 objects are dequantized to
    ``dtype`` (default: the dtype recorded as the scale type). Raises only FormatError.
    """
    mv = memoryview(data)
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    k, v = parse_layer(mv, permissive=permissive)
    bt_raw, sp_raw = _index_array(mv, k, 1), _index_array(mv, k, 2)
    limit = np.iinfo(np.int64).max
    for name, a in (("block_table", bt_raw), ("seq_ptr", sp_raw)):
        if a.size and int(a.max()) > limit:  # only reachable when permissive
            raise errors.PageIdError(f"{name} entries must fit a signed 64-bit index")
    bt, sp = bt_raw.astype(np.int64), sp_raw.astype(np.int64)
    return LayerKV(
        layer_index=int(k.descriptor.layout.layer_index),
        keys=_pool(mv, k, dtype),
        values=_pool(mv, v, dtype),
        block_table=torch.from_numpy(bt),
        seq_ptr=torch.from_numpy(sp),
    )
