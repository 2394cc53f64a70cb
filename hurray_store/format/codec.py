"""Per-layer KV objects as Hurray streams (layer L1: pure, no I/O).

One object holds one layer of one batch: a Hurray stream of exactly two block-paged
descriptors (tag 0x0A), the key first and the value second, each followed directly by
its buffers::

    +-----------+-----------+-------------+---------+----------+
    | K desc    | page_pool | block_table | seq_ptr | [scales] |   kv_role = key
    +-----------+-----------+-------------+---------+----------+
    | V desc    | page_pool | block_table | seq_ptr | [scales] |   kv_role = value
    +-----------+-----------+-------------+---------+----------+

    page_pool   num_pages * page_size * heads * head_dim elements (fp16/bf16/fp32, or
                int8 when quantized); page p is one contiguous slice
    block_table uint32 (uint64 when the pool or table needs it), one page id per
                logical page, sequences back to back
    seq_ptr     same type, num_seqs + 1 offsets into block_table
    scales      int8 only: one scale per page slot (num_pages * page_size), in the
                original dtype, paged through the same block table

Why this module does not just call ``hurray.StreamWriter`` / ``StreamReader``:

* pyhurray's ``Tensor`` copies every buffer it is given, and its in-memory writer copies
  again (about 0.05x memcpy end to end). We build each descriptor with pyhurray once per
  (dtype, heads, head_dim, page_size, role, layer, index type, quantization) from a
  one-page template, then set the size fields (shape[0], num_pages, num_seqs and the
  buffer sizes, at the offsets ``metadata.md`` fixes) and have pyhurray's decoder confirm
  every field before the bytes are used. The pool itself is never copied until the one
  join that materialises the object; ``encode_layer_buffers`` skips even that.
* pyhurray's reader trusts declared sizes (a flipped bit can abort the process) and does
  not check block-table contents. ``decode_layer`` parses each descriptor with
  ``hurray.Descriptor.decode``, checks every declared size against the bytes present and
  every index invariant, and only then takes zero-copy views.
"""

from __future__ import annotations

import functools
import logging
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import hurray
import numpy as np
import torch

from hurray_store import errors
from hurray_store.spec import SUPPORTED_DTYPES

log = logging.getLogger(__name__)

MAGIC = b"HRRY"
READER_VERSION_MAJOR = 1
BLOCK_PAGED_TAG = 0x0A
FIXED_HEADER_LEN = 20
UINT32_MAX = 0xFFFFFFFF
QUANTIZATIONS = (None, "int8")

_TORCH_TO_HURRAY = {dtype: getattr(hurray, name) for dtype, name in SUPPORTED_DTYPES.items()}
_HURRAY_TO_TORCH = {h.name: t for t, h in _TORCH_TO_HURRAY.items()}
_INDEX_NP: dict[str, np.dtype] = {"uint32": np.dtype("<u4"), "uint64": np.dtype("<u8")}

# Offsets inside a rank-3 block-paged descriptor, from metadata.md (fixed header, shape,
# byte_offset) and block-paged.md (layout fields):
#   0 magic | 4 version | 6 descriptor_length u32 | 10 flags u32 | 14 type u8 | 15 layout u8
#  16 rank u32 | 20 shape u64[3] | 44 byte_offset u64 | 52 page_size u32 | 56 num_pages u64
#  64 paged_axis u32 | 68 num_seqs u32 | 72 kv_role u8 | 73 layer_index u32
#  77 index type u8 | 78 reserved[6] | 84 buffer_count u8 | 85 handles, 16 bytes each
#  (byte_size u64 first)
_OFF_SHAPE0 = 20
_OFF_NUM_PAGES = 56
_OFF_PAGED_AXIS = 64
_OFF_NUM_SEQS = 68
_OFF_HANDLES = 85
_HANDLE_LEN = 16


def supported_dtypes() -> tuple[torch.dtype, ...]:
    """The element types a layer may hold unquantized."""
    return tuple(_TORCH_TO_HURRAY)


@dataclass(frozen=True, slots=True, eq=False)
class LayerKV:
    """One layer of a batch in block-paged form.

    ``keys``/``values``: ``[num_pages, page_size, num_kv_heads, head_dim]``, same shape
    and dtype. ``block_table``: flat page ids, sequences back to back. ``seq_ptr``:
    ``num_seqs + 1`` offsets into ``block_table`` (CSR style). Two entries may name the
    same page (a shared prefix); that is legal and never checked.
    """

    layer_index: int
    keys: torch.Tensor
    values: torch.Tensor
    block_table: torch.Tensor
    seq_ptr: torch.Tensor

    def __post_init__(self) -> None:
        if not 0 <= self.layer_index < UINT32_MAX:
            raise ValueError(
                f"layer_index must be in [0, {UINT32_MAX - 1}], got {self.layer_index}"
            )
        if self.keys.dim() != 4:
            raise ValueError(
                "keys must be [num_pages, page_size, num_kv_heads, head_dim], "
                f"got shape {tuple(self.keys.shape)}"
            )
        if self.values.shape != self.keys.shape or self.values.dtype != self.keys.dtype:
            raise ValueError(
                f"values must match keys: keys {tuple(self.keys.shape)} {self.keys.dtype}, "
                f"values {tuple(self.values.shape)} {self.values.dtype}"
            )
        for name, t in (("block_table", self.block_table), ("seq_ptr", self.seq_ptr)):
            if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
                raise ValueError(
                    f"{name} must be a flat integer tensor, got {t.dtype} {tuple(t.shape)}"
                )
        if self.seq_ptr.numel() < 1:
            raise ValueError("seq_ptr needs num_seqs + 1 >= 1 entries (an empty batch is [0])")
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")

    @property
    def num_pages(self) -> int:
        return int(self.keys.shape[0])

    @property
    def page_size(self) -> int:
        return int(self.keys.shape[1])

    @property
    def num_kv_heads(self) -> int:
        return int(self.keys.shape[2])

    @property
    def head_dim(self) -> int:
        return int(self.keys.shape[3])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_ptr.numel()) - 1

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    def pages_of(self, seq: int) -> torch.Tensor:
        """Page ids of sequence ``seq`` (a view into ``block_table``)."""
        lo, hi = int(self.seq_ptr[seq]), int(self.seq_ptr[seq + 1])
        return self.block_table[lo:hi]


@dataclass(frozen=True, slots=True)
class EncodedLayer:
    """An encoded layer object as a vector of buffers, plus where each part lies.

    ``buffers`` are the descriptor bytes and zero-copy views of the source tensors, in
    stream order; ``b"".join(buffers)`` is the object. Offsets are from the start of the
    object; page ``p`` of a role occupies ``[pool_offset + p*page_bytes, +page_bytes)``
    and, when quantized, its scales ``[scales_offset + p*scale_bytes, +scale_bytes)``.
    """

    buffers: list[bytes | memoryview]
    nbytes: int
    key_pool_offset: int
    value_pool_offset: int
    key_scales_offset: int  # 0 when not quantized
    value_scales_offset: int
    page_bytes: int
    scale_bytes: int  # per page; 0 when not quantized
    key_descriptor_len: int
    value_descriptor_len: int
    quantization: str | None = field(default=None)


# --------------------------------------------------------------------------- encoding


def _byte_view(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def validate_index(bt: np.ndarray, sp: np.ndarray, num_pages: int, num_seqs: int) -> None:
    """The four storage invariants of block-paged.md on the two index buffers.

    Vectorized; aliasing is not checked (it is legal).
    """
    if sp.shape[0] != num_seqs + 1:
        raise errors.SeqPtrError(
            f"seq_ptr must have num_seqs + 1 = {num_seqs + 1} entries, got {sp.shape[0]}"
        )
    if int(sp[0]) != 0:
        raise errors.SeqPtrError(f"seq_ptr[0] must be 0, got {int(sp[0])}")
    if num_seqs > 0:
        # Unsigned entries: compare neighbours rather than subtract (no wrap-around).
        bad = np.flatnonzero(sp[1:] < sp[:-1])
        if bad.size:
            s = int(bad[0])
            raise errors.SeqPtrError(
                f"seq_ptr must be non-decreasing: seq_ptr[{s}] = {int(sp[s])} > "
                f"seq_ptr[{s + 1}] = {int(sp[s + 1])}"
            )
    if int(sp[-1]) != bt.shape[0]:
        raise errors.SeqPtrError(
            f"seq_ptr[-1] must equal len(block_table) = {bt.shape[0]}, got {int(sp[-1])}"
        )
    if bt.shape[0]:
        lo, hi = int(bt.min()), int(bt.max())
        if lo < 0 or hi >= num_pages:
            k = int(np.flatnonzero((bt < 0) | (bt >= num_pages))[0])
            raise errors.PageIdError(
                f"block_table[{k}] = {int(bt[k])} is outside [0, num_pages = {num_pages})"
            )


def _index_type(num_pages: int, table_len: int) -> str:
    return "uint32" if max(num_pages, table_len) <= UINT32_MAX else "uint64"


@functools.lru_cache(maxsize=4096)
def _template(
    hdtype_name: str,
    heads: int,
    dim: int,
    page_size: int,
    role: str,
    layer: int,
    index_type: str,
    scale_dtype_name: str | None,
) -> tuple[bytes, int]:
    """A pyhurray-built descriptor for a one-page, one-sequence pool: the template whose
    size fields ``_descriptor`` sets. Returns (bytes, buffer count)."""
    hdtype = hurray.int8 if scale_dtype_name else getattr(hurray, hdtype_name)
    elem = 1 if scale_dtype_name else _elem_size(hdtype_name)
    idx = _INDEX_NP[index_type]
    aux = [np.zeros(1, idx).tobytes(), np.array([0, 1], idx).tobytes()]
    quant = None
    if scale_dtype_name:
        sdt = getattr(hurray, scale_dtype_name)
        aux.append(bytes(page_size * _elem_size(scale_dtype_name)))
        quant = hurray.PerBlockAffine.symmetric(0, page_size, 3, sdt)
    layout = hurray.BlockPagedLayout(
        page_size=page_size,
        num_pages=1,
        paged_axis=0,
        num_seqs=1,
        kv_role=role,
        layer_index=layer,
        block_table_index_type=index_type,
    )
    t = hurray.Tensor(
        bytes(page_size * heads * dim * elem),
        hdtype,
        [page_size, heads, dim],
        aux_buffers=aux,
        layout=layout,
        quantization=quant,
    )
    return t.descriptor.encode(), len(aux) + 1


def _elem_size(hdtype_name: str) -> int:
    return {"float16": 2, "bfloat16": 2, "float32": 4, "int8": 1}[hdtype_name]


@functools.cache
def _warn_slow_path() -> None:
    log.warning("descriptor template did not round-trip through pyhurray; using the slow path")


def _descriptor(
    *,
    hdtype_name: str,
    heads: int,
    dim: int,
    page_size: int,
    role: str,
    layer: int,
    index_type: str,
    scale_dtype_name: str | None,
    num_pages: int,
    num_seqs: int,
    table_len: int,
    sizes: Sequence[int],
) -> bytes:
    """Descriptor bytes for one role, exactly as pyhurray writes them."""
    if all(sizes):
        tmpl, nbuf = _template(
            hdtype_name, heads, dim, page_size, role, layer, index_type, scale_dtype_name
        )
        out = bytearray(tmpl)
        struct.pack_into("<Q", out, _OFF_SHAPE0, table_len * page_size)
        struct.pack_into("<Q", out, _OFF_NUM_PAGES, num_pages)
        struct.pack_into("<I", out, _OFF_NUM_SEQS, num_seqs)
        for i, n in enumerate(sizes):
            struct.pack_into("<Q", out, _OFF_HANDLES + i * _HANDLE_LEN, n)
        desc = bytes(out)
        # pyhurray is the arbiter: the patched descriptor must decode to exactly the
        # fields we meant, or we fall back to building it the slow way.
        d = hurray.Descriptor.decode(desc)
        lay = d.layout
        if (
            d.shape == (table_len * page_size, heads, dim)
            and lay.num_pages == num_pages
            and lay.num_seqs == num_seqs
            and lay.page_size == page_size
            and lay.kv_role == role
            and lay.layer_index == layer
            and lay.block_table_index_type == index_type
            and [h.byte_size for h in d.buffer_handles] == list(sizes)
            and nbuf == len(sizes)
        ):
            return desc
        _warn_slow_path()
    # Slow path (empty buffers, or a pyhurray whose encoding moved): let pyhurray build
    # the descriptor from placeholder buffers of the right sizes.
    idx = _INDEX_NP[index_type]
    sp = np.zeros(num_seqs + 1, idx)
    sp[-1] = table_len
    aux = [bytes(sizes[1]), sp.tobytes()]
    quant = None
    if scale_dtype_name:
        aux.append(bytes(sizes[3]))
        quant = hurray.PerBlockAffine.symmetric(0, page_size, 3, getattr(hurray, scale_dtype_name))
    layout = hurray.BlockPagedLayout(
        page_size=page_size,
        num_pages=num_pages,
        paged_axis=0,
        num_seqs=num_seqs,
        kv_role=role,
        layer_index=layer,
        block_table_index_type=index_type,
    )
    t = hurray.Tensor(
        bytes(sizes[0]),
        hurray.int8 if scale_dtype_name else getattr(hurray, hdtype_name),
        [table_len * page_size, heads, dim],
        aux_buffers=aux,
        layout=layout,
        quantization=quant,
    )
    return bytes(t.descriptor.encode())


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per page slot.

    ``x``: ``[num_pages, page_size, heads, dim]``. Returns ``(q, scales)``: ``q`` int8 of
    the same shape, ``scales`` ``[num_pages * page_size]`` in ``x.dtype``. The scale is
    rounded up when stored, so ``|x| / scale <= 127`` holds after rounding and no value
    clips: per slot, ``|x - q*scale| <= scale/2`` with ``scale ~ absmax(slot)/127``.
    """
    slots = x.shape[0] * x.shape[1]
    xf = x.reshape(slots, x.shape[2] * x.shape[3]).float()
    amax = xf.abs().amax(dim=1) if xf.shape[1] else torch.zeros(slots)
    eps = torch.finfo(x.dtype).eps
    tiny = torch.finfo(x.dtype).tiny
    scale = (amax / 127.0 * (1.0 + 2 * eps)).clamp_min(tiny).to(x.dtype)
    s = scale.float()
    q = torch.round(xf / s[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(x.shape), scale


@dataclass(frozen=True, slots=True)
class Slot:
    """A placeholder in a LayerPlan for bytes the caller fills: a role's page pool or
    its scales."""

    role: str  # "key" | "value"
    what: str  # "pool" | "scales"
    nbytes: int


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """The byte layout of one layer object before its pages exist: descriptors and
    index buffers as bytes, pools and scales as Slots, in stream order. A writer that
    gathers pages straight into the object's final buffer fills the slots itself."""

    parts: list[bytes | Slot]
    nbytes: int
    key_pool_offset: int
    value_pool_offset: int
    key_scales_offset: int
    value_scales_offset: int
    page_bytes: int
    scale_bytes: int
    key_descriptor_len: int
    value_descriptor_len: int
    quantization: str | None

    def write_fixed(self, out: memoryview) -> None:
        """Copy the descriptors and index buffers into ``out`` (the whole object)."""
        pos = 0
        for part in self.parts:
            if isinstance(part, Slot):
                pos += part.nbytes
            else:
                out[pos : pos + len(part)] = part
                pos += len(part)


def plan_layer(
    layer_index: int,
    block_table: torch.Tensor,
    seq_ptr: torch.Tensor,
    *,
    num_pages: int,
    page_size: int,
    heads: int,
    dim: int,
    dtype: torch.dtype,
    quantization: str | None = None,
) -> LayerPlan:
    """Descriptors and offsets of a layer object with these index buffers and shapes;
    validates the index invariants as the encoder does."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if dtype not in _TORCH_TO_HURRAY:
        raise errors.DtypeError(
            f"layer dtype must be one of {[str(d) for d in _TORCH_TO_HURRAY]}, got {dtype}"
        )
    if quantization == "int8" and (page_size < 2 or page_size & (page_size - 1)):
        # Hurray's per-block-affine scheme needs block_size (= page_size) a power of two.
        raise errors.QuantizationError(
            f"int8 quantization needs page_size a power of two >= 2 (the per-block-affine "
            f"block size), got {page_size}"
        )
    bt_np = block_table.detach().cpu().numpy()
    sp_np = seq_ptr.detach().cpu().numpy()
    num_seqs = int(sp_np.shape[0]) - 1
    validate_index(bt_np, sp_np, num_pages, num_seqs)
    table_len = int(bt_np.shape[0])
    index_type = _index_type(num_pages, table_len)
    idx = _INDEX_NP[index_type]
    bt_b = bt_np.astype(idx).tobytes()
    sp_b = sp_np.astype(idx).tobytes()
    hname = _TORCH_TO_HURRAY[dtype].name
    esize = dtype.itemsize
    page_bytes = page_size * heads * dim * (1 if quantization else esize)
    scale_bytes = page_size * esize if quantization else 0
    parts: list[bytes | Slot] = []
    offsets: dict[str, int] = {}
    pos = 0
    desc_lens = []
    for role in ("key", "value"):
        sizes = [num_pages * page_bytes, len(bt_b), len(sp_b)]
        if quantization:
            sizes.append(num_pages * scale_bytes)
        desc = _descriptor(
            hdtype_name=hname,
            heads=heads,
            dim=dim,
            page_size=page_size,
            role=role,
            layer=layer_index,
            index_type=index_type,
            scale_dtype_name=hname if quantization else None,
            num_pages=num_pages,
            num_seqs=num_seqs,
            table_len=table_len,
            sizes=sizes,
        )
        desc_lens.append(len(desc))
        parts += [desc, Slot(role, "pool", sizes[0]), bt_b, sp_b]
        offsets[f"{role}_pool"] = pos + len(desc)
        pos += len(desc) + sum(sizes[:3])
        if quantization:
            parts.append(Slot(role, "scales", sizes[3]))
            offsets[f"{role}_scales"] = pos
            pos += sizes[3]
    return LayerPlan(
        parts=parts,
        nbytes=pos,
        key_pool_offset=offsets["key_pool"],
        value_pool_offset=offsets["value_pool"],
        key_scales_offset=offsets.get("key_scales", 0),
        value_scales_offset=offsets.get("value_scales", 0),
        page_bytes=page_bytes,
        scale_bytes=scale_bytes,
        key_descriptor_len=desc_lens[0],
        value_descriptor_len=desc_lens[1],
        quantization=quantization,
    )


def encode_layer_buffers(layer: LayerKV, *, quantization: str | None = None) -> EncodedLayer:
    """Encode ``layer`` as a vector of buffers (descriptors and zero-copy views).

    For tiers that write a vector (``os.writev``, socket ``sendmsg``) this avoids
    materialising the object at all. The views alias ``layer``'s tensors (or the
    quantized copies): keep them unchanged until the buffers are written.
    """
    if layer.dtype not in _TORCH_TO_HURRAY:
        raise errors.DtypeError(
            f"layer dtype must be one of {[str(d) for d in _TORCH_TO_HURRAY]}, got {layer.dtype}"
        )
    num_pages, page_size, heads, dim = (int(s) for s in layer.keys.shape)
    plan = plan_layer(
        layer.layer_index,
        layer.block_table,
        layer.seq_ptr,
        num_pages=num_pages,
        page_size=page_size,
        heads=heads,
        dim=dim,
        dtype=layer.dtype,
        quantization=quantization,
    )
    data: dict[tuple[str, str], memoryview] = {}
    for role, src in (("key", layer.keys), ("value", layer.values)):
        t = src.detach().cpu()
        if quantization == "int8":
            q, sc = quantize_int8(t)
            data[(role, "pool")], data[(role, "scales")] = _byte_view(q), _byte_view(sc)
        else:
            data[(role, "pool")] = _byte_view(t.contiguous())
    buffers = [data[(p.role, p.what)] if isinstance(p, Slot) else p for p in plan.parts]
    return EncodedLayer(
        buffers=buffers,
        nbytes=plan.nbytes,
        key_pool_offset=plan.key_pool_offset,
        value_pool_offset=plan.value_pool_offset,
        key_scales_offset=plan.key_scales_offset,
        value_scales_offset=plan.value_scales_offset,
        page_bytes=plan.page_bytes,
        scale_bytes=plan.scale_bytes,
        key_descriptor_len=plan.key_descriptor_len,
        value_descriptor_len=plan.value_descriptor_len,
        quantization=quantization,
    )


def encode_layer(layer: LayerKV, *, quantization: str | None = None) -> bytes:
    """Encode one layer as one Hurray stream (key descriptor, then value descriptor).

    ``quantization="int8"`` stores symmetric int8 with one scale per page slot (see
    ``quantize_int8``). The bytes are readable by ``hurray.StreamReader``.
    """
    return b"".join(encode_layer_buffers(layer, quantization=quantization).buffers)


# --------------------------------------------------------------------------- decoding


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
    if dlen >= _OFF_PAGED_AXIS + 4:
        # Kept even when permissive: a LayerKV has nowhere to put another paged axis.
        (paged_axis,) = struct.unpack_from("<I", mv, off + _OFF_PAGED_AXIS)
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
        if dname not in _HURRAY_TO_TORCH:
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
        if scale_name not in _HURRAY_TO_TORCH:
            raise errors.UnsupportedQuantizationError(
                f"{what}: scale type must be float16, bfloat16 or float32, got {scale_name}"
            )
        nbuf_expected = 4
    sizes = tuple(int(h.byte_size) for h in d.buffer_handles)
    if len(sizes) != nbuf_expected:
        raise errors.BufferSizeError(f"{what}: expected {nbuf_expected} buffers, got {len(sizes)}")
    index_type = lay.block_table_index_type
    width = _INDEX_NP[index_type].itemsize
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
    """Parse and check the two descriptors of a layer object without touching its pages.

    Raises a ``FormatError`` subclass for anything that is not a well-formed layer object;
    the index invariants are checked unless ``permissive``.
    """
    mv = memoryview(data)
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    k = _parse_tensor(mv, 0, "key tensor")
    if k.end == len(mv):
        raise errors.TensorCountError(
            f"expected two tensors (key, value), the stream ends after one ({len(mv)} bytes)"
        )
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
    idx = _INDEX_NP[p.index_type]
    return np.frombuffer(
        mv, dtype=idx, count=p.buffer_sizes[i] // idx.itemsize, offset=p.buffer_offsets[i]
    )


def _view(mv: memoryview, off: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
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
        t = _view(mv, p.buffer_offsets[0], p.buffer_sizes[0], _HURRAY_TO_TORCH[p.dtype_name]).view(
            shape
        )
        return t if dtype is None or dtype == t.dtype else t.to(dtype)
    q = _view(mv, p.buffer_offsets[0], p.buffer_sizes[0], torch.int8).view(
        shape[0] * shape[1], heads * dim
    )
    sc = _view(mv, p.buffer_offsets[3], p.buffer_sizes[3], _HURRAY_TO_TORCH[p.scale_dtype_name])
    out_dtype = dtype or _HURRAY_TO_TORCH[p.scale_dtype_name]
    return (q.float() * sc.float()[:, None]).to(out_dtype).view(shape)


def decode_layer(
    data: bytes | bytearray | memoryview,
    *,
    permissive: bool = False,
    dtype: torch.dtype | None = None,
) -> LayerKV:
    """Decode one layer object, validating before trusting.

    Checks magic and version, exactly two block-paged tensors (key then value, one layer,
    the same paging fields, shapes and index buffers), rank 3, paged_axis 0, no shard,
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
