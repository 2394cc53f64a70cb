"""The layer object's layout: what its bytes are, as data types (pure, no I/O).

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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import hurray
import numpy as np
import torch

from hurray_store import errors
from hurray_store.spec import SUPPORTED_DTYPES

MAGIC = b"HRRY"
READER_VERSION_MAJOR = 1
BLOCK_PAGED_TAG = 0x0A
FIXED_HEADER_LEN = 20
UINT32_MAX = 0xFFFFFFFF
QUANTIZATIONS = (None, "int8")

TORCH_TO_HURRAY = {dtype: getattr(hurray, name) for dtype, name in SUPPORTED_DTYPES.items()}
HURRAY_TO_TORCH = {h.name: t for t, h in TORCH_TO_HURRAY.items()}
INDEX_NP: dict[str, np.dtype] = {"uint32": np.dtype("<u4"), "uint64": np.dtype("<u8")}

# Offsets inside a rank-3 block-paged descriptor, from metadata.md (fixed header, shape,
# byte_offset) and block-paged.md (layout fields):
#   0 magic | 4 version | 6 descriptor_length u32 | 10 flags u32 | 14 type u8 | 15 layout u8
#  16 rank u32 | 20 shape u64[3] | 44 byte_offset u64 | 52 page_size u32 | 56 num_pages u64
#  64 paged_axis u32 | 68 num_seqs u32 | 72 kv_role u8 | 73 layer_index u32
#  77 index type u8 | 78 reserved[6] | 84 buffer_count u8 | 85 handles, 16 bytes each
#  (byte_size u64 first)
OFF_SHAPE0 = 20
OFF_NUM_PAGES = 56
OFF_PAGED_AXIS = 64
OFF_NUM_SEQS = 68
OFF_HANDLES = 85
HANDLE_LEN = 16


def supported_dtypes() -> tuple[torch.dtype, ...]:
    """The element types a layer may hold unquantized."""
    return tuple(TORCH_TO_HURRAY)


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


def index_type_for(num_pages: int, table_len: int) -> str:
    return "uint32" if max(num_pages, table_len) <= UINT32_MAX else "uint64"


@dataclass(frozen=True, slots=True)
class Placeholder:
    """A placeholder in a LayerPlan for bytes the caller fills: a role's page pool or
    its scales."""

    role: str  # "key" | "value" | "fused"
    what: str  # "pool" | "scales"
    nbytes: int


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """The byte layout of one layer object before its pages exist: descriptors and
    index buffers as bytes, pools and scales as Placeholders, in stream order. A writer that
    gathers pages straight into the object's final buffer fills the slots itself."""

    parts: list[bytes | Placeholder]
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
            if isinstance(part, Placeholder):
                pos += part.nbytes
            else:
                out[pos : pos + len(part)] = part
                pos += len(part)


@dataclass(frozen=True, slots=True)
class EncodedLayer(LayerPlan):
    """An encoded layer object: its plan, and the object as a vector of buffers.

    ``buffers`` are the descriptor bytes and zero-copy views of the source tensors, in
    stream order; ``b"".join(buffers)`` is the object. Offsets are from the start of the
    object; page ``p`` of a role occupies ``[pool_offset + p*page_bytes, +page_bytes)``
    and, when quantized, its scales ``[scales_offset + p*scale_bytes, +scale_bytes)``.
    """

    buffers: list[bytes | memoryview] = field(default_factory=list)
