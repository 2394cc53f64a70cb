"""Encoding: a layer's pages into a layer object, planned or whole (pure, no I/O)."""

from __future__ import annotations

import logging
from dataclasses import fields

import torch

from hurray_store import errors
from hurray_store.format.descriptor import (
    build_descriptor,
)
from hurray_store.format.layout import (
    INDEX_NP,
    QUANTIZATIONS,
    TORCH_TO_HURRAY,
    EncodedLayer,
    LayerKV,
    LayerPlan,
    Placeholder,
    index_type_for,
    validate_index,
)

log = logging.getLogger(__name__)


def byte_view(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


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
    roles: tuple[str, ...] = ("key", "value"),
) -> LayerPlan:
    """Descriptors and offsets of a layer object with these index buffers and shapes;
    validates the index invariants as the encoder does. ``roles``: a key and a value
    descriptor, or one ``("fused",)`` (an MLA latent that serves as both: its plan
    names its one pool as the key's and the value's)."""
    if roles not in (("key", "value"), ("fused",)):
        raise ValueError(f"roles must be ('key', 'value') or ('fused',), got {roles!r}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if dtype not in TORCH_TO_HURRAY:
        raise errors.DtypeError(
            f"layer dtype must be one of {[str(d) for d in TORCH_TO_HURRAY]}, got {dtype}"
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
    index_type = index_type_for(num_pages, table_len)
    idx = INDEX_NP[index_type]
    bt_b = bt_np.astype(idx).tobytes()
    sp_b = sp_np.astype(idx).tobytes()
    hname = TORCH_TO_HURRAY[dtype].name
    esize = dtype.itemsize
    page_bytes = page_size * heads * dim * (1 if quantization else esize)
    scale_bytes = page_size * esize if quantization else 0
    parts: list[bytes | Placeholder] = []
    offsets: dict[str, int] = {}
    pos = 0
    desc_lens = []
    for role in roles:
        sizes = [num_pages * page_bytes, len(bt_b), len(sp_b)]
        if quantization:
            sizes.append(num_pages * scale_bytes)
        desc = build_descriptor(
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
        parts += [desc, Placeholder(role, "pool", sizes[0]), bt_b, sp_b]
        offsets[f"{role}_pool"] = pos + len(desc)
        pos += len(desc) + sum(sizes[:3])
        if quantization:
            parts.append(Placeholder(role, "scales", sizes[3]))
            offsets[f"{role}_scales"] = pos
            pos += sizes[3]
    k, v = roles[0], roles[-1]  # a fused layer's one pool is its key and its value
    return LayerPlan(
        parts=parts,
        nbytes=pos,
        key_pool_offset=offsets[f"{k}_pool"],
        value_pool_offset=offsets[f"{v}_pool"],
        key_scales_offset=offsets.get(f"{k}_scales", 0),
        value_scales_offset=offsets.get(f"{v}_scales", 0),
        page_bytes=page_bytes,
        scale_bytes=scale_bytes,
        key_descriptor_len=desc_lens[0],
        value_descriptor_len=desc_lens[-1],
        quantization=quantization,
    )


def encode_layer_buffers(layer: LayerKV, *, quantization: str | None = None) -> EncodedLayer:
    """Encode ``layer`` as a vector of buffers (descriptors and zero-copy views).

    For tiers that write a vector (``os.writev``, socket ``sendmsg``) this avoids
    materialising the object at all. The views alias ``layer``'s tensors (or the
    quantized copies): keep them unchanged until the buffers are written.
    """
    if layer.dtype not in TORCH_TO_HURRAY:
        raise errors.DtypeError(
            f"layer dtype must be one of {[str(d) for d in TORCH_TO_HURRAY]}, got {layer.dtype}"
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
            data[(role, "pool")], data[(role, "scales")] = byte_view(q), byte_view(sc)
        else:
            data[(role, "pool")] = byte_view(t.contiguous())
    buffers = [data[(p.role, p.what)] if isinstance(p, Placeholder) else p for p in plan.parts]
    plan_fields = {f.name: getattr(plan, f.name) for f in fields(LayerPlan)}
    return EncodedLayer(**plan_fields, buffers=buffers)


def encode_layer(layer: LayerKV, *, quantization: str | None = None) -> bytes:
    """Encode one layer as one Hurray stream (key descriptor, then value descriptor).

    ``quantization="int8"`` stores symmetric int8 with one scale per page slot (see
    ``quantize_int8``). The bytes are readable by ``hurray.StreamReader``.
    """
    return b"".join(encode_layer_buffers(layer, quantization=quantization).buffers)
