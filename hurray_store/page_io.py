"""Pages between a paged pool and a layer object's bytes, checked: the one path.

- ``gather_pages`` / ``scatter_pages``: pool pages to a page tensor and back. The
  snapshot and restore of ``paging`` and the store's objects use these two.
- ``gather_layer``: a layer's pages gathered straight into their places in a planned layer
  object, each page hashed while it is warm in cache; returns the checksums the
  manifest records.
- ``verify_and_scatter``: stored pages verified against those checksums, then copied
  into pool pages; returns the pages that failed.

A page checksum is ``format.page_checksum``: xxh3-64 of the page's bytes, then its scales.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hurray_store.format import (
    LayerPlan,
    Manifest,
    Placeholder,
    object_checksum,
    page_checksum,
    quantize_int8,
    view_tensor,
)
from hurray_store.spec import KVSpec
from hurray_store.tiers.helpers import blob_nbytes, host_view
from hurray_store.tiers.types import Blob

CHUNK_BYTES = (
    1 << 22
)  # gather (or verify) this much, then hash (or copy) it while it is warm in cache


def _word(page_bytes: int) -> torch.dtype:
    # Pages move as the widest integer that divides a page: torch's uint8 gather runs at
    # half the speed of int64, and unaligned int64 stores are fine on CPUs.
    return next(
        w
        for w in (torch.int64, torch.int32, torch.int16, torch.uint8)
        if page_bytes % w.itemsize == 0
    )


def gather_pages(src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
    """``out[j] = src[idx[j]]`` for pages ``src`` ``[num_blocks, ...]`` (one role of a
    layer) into ``out`` ``[len(idx), ...]`` of the same page size (any dtype)."""
    n = int(idx.numel())
    if n == 0:
        return
    pb = src[0].numel() * src.element_size()
    word = _word(pb)
    s = src.reshape(src.shape[0], -1).view(word)
    o = out.reshape(n, -1).view(word)
    if s.device.type == "cpu" and o.device.type == "cpu":
        torch.index_select(s, 0, idx, out=o)
    else:
        o.copy_(s.index_select(0, idx.to(s.device)))


def scatter_pages(dst: torch.Tensor, rows: torch.Tensor, pages: torch.Tensor) -> None:
    """``dst[rows[j]] = pages[j]``: pages into pool rows (on the pool's device)."""
    if int(rows.numel()):
        dst.index_copy_(0, rows, pages.to(dst.device, non_blocking=True))


def gather_layer(
    kv: torch.Tensor, idx: torch.Tensor, plan: LayerPlan, out: memoryview
) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """Gather pages ``idx`` of one layer (``kv``: ``[2, num_blocks, P, H, D]``) into the
    places in ``out``, an object planned by ``plan`` whose fixed parts are written.
    Returns the object checksum and the page checksums per role."""
    n = int(idx.numel())
    pb, sb = plan.page_bytes, plan.scale_bytes
    sums: dict[str, list[int]] = {"key": [], "value": [], "fused": []}
    fixed: list[bytes | bytearray | memoryview] = []
    pos = 0
    for part in plan.parts:
        if not isinstance(part, Placeholder):
            fixed.append(part)
            pos += len(part)
            continue
        role_i = 1 if part.role == "value" else 0
        if part.what == "scales":
            pos += part.nbytes  # written, and hashed with its pages, below
            continue
        if plan.quantization:
            q, sc = quantize_int8(kv[role_i].index_select(0, idx.to(kv.device)).cpu())
            qb, scb = host_view(q), host_view(sc)
            out[pos : pos + part.nbytes] = qb
            soff = plan.key_scales_offset if part.role == "key" else plan.value_scales_offset
            out[soff : soff + n * sb] = scb
            sums[part.role] += [
                page_checksum(qb[j * pb : (j + 1) * pb], scb[j * sb : (j + 1) * sb])
                for j in range(n)
            ]
            pos += part.nbytes
            continue
        word = _word(pb)
        dst = (
            torch.frombuffer(out, dtype=word, count=n * pb // word.itemsize, offset=pos).view(n, -1)
            if n
            else None
        )
        step = max(1, CHUNK_BYTES // pb)
        for a in range(0, n, step):
            b = min(n, a + step)
            assert dst is not None
            gather_pages(kv[role_i], idx[a:b], dst[a:b])
            base = pos + a * pb
            sums[part.role] += [
                page_checksum(out[base + j * pb : base + (j + 1) * pb]) for j in range(b - a)
            ]
        pos += part.nbytes
    if sums["fused"]:  # a fused latent's one pool is the manifest's key and value
        sums["key"] = sums["value"] = sums["fused"]
    return (
        object_checksum(fixed, sums["key"], sums["value"]),
        tuple(sums["key"]),
        tuple(sums["value"]),
    )


def verify_and_scatter(
    kv: torch.Tensor,
    spec: KVSpec,
    m: Manifest,
    lay_pos: int,
    runs: Sequence[tuple[int, int]],
    parts: Sequence[Blob],
    rows: torch.Tensor,
    *,
    whole: bool,
    check: bool,
) -> list[int] | None:
    """Copy the pages ``runs`` of layer object ``m.layers[lay_pos]`` into pool rows
    ``rows`` (``kv``: ``[2, num_blocks, P, H, D]``; rows in page order, keys and values
    alike), checking each page's checksum first when ``check``: chunk by chunk, so the
    copy reads what the hash just brought into cache.

    ``parts``: the bytes of ``run_ranges(m, lay_pos, runs)``, or with ``whole``
    the whole object (then its size and, when ``check``, its object checksum are
    verified too). Returns the positions (in page order) whose checksum differs ([]
    when every page is good), or None when a whole object is wrong (nothing copied).
    """
    lay = m.layers[lay_pos]
    pb, sb = m.page_bytes, m.scale_bytes
    if whole:
        blob = parts[0]
        if blob_nbytes(blob) != lay.object_size:
            return None
        if check:
            # The page checks below cover the pages; the rest of the object (what a
            # promotion copies besides pages) must match the object checksum.
            bv = host_view(blob)
            fixed = [bv[o : o + n] for o, n in m.fixed_ranges(lay_pos)]
            if (
                object_checksum(fixed, lay.key_page_checksums, lay.value_page_checksums)
                != lay.object_checksum
            ):
                return None
        parts = [blob[off : off + ln] for off, ln in run_ranges(m, lay_pos, runs)]
    step = max(1, CHUNK_BYTES // pb)
    failed: list[int] = []
    it = iter(parts)
    pos = 0
    for a, b in runs:
        n = b - a
        roles = ((0, lay.key_page_checksums), (1, lay.value_page_checksums))[: kv.shape[0]]
        for role_i, sums in roles:
            pool_part = next(it)
            scale_part = next(it) if sb else None
            pv = host_view(pool_part) if check else None
            sv = host_view(scale_part) if check and scale_part is not None else None
            data = _u8(pool_part)
            scales = _u8(scale_part) if scale_part is not None else None
            for c0 in range(0, n, step):
                c1 = min(n, c0 + step)
                if pv is not None:
                    for j in range(c0, c1):
                        page_scales = None if sv is None else sv[j * sb : (j + 1) * sb]
                        if page_checksum(pv[j * pb : (j + 1) * pb], page_scales) != sums[a + j]:
                            failed.append(pos + j)
                pages = pages_of(
                    data[c0 * pb : c1 * pb],
                    None if scales is None else scales[c0 * sb : c1 * sb],
                    spec,
                    c1 - c0,
                    kv.device,
                )
                scatter_pages(kv[role_i], rows[pos + c0 : pos + c1], pages)
        pos += n
    return sorted(set(failed))


def run_ranges(m: Manifest, lay_pos: int, runs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(offset, length)`` in layer object ``m.layers[lay_pos]`` of each run's bytes:
    per run the keys then the values, each followed by its scales when quantized (a
    fused layer, whose key and value are its one pool: that pool alone)."""
    lay = m.layers[lay_pos]
    roles = ("key",) if lay.key_pool_offset == lay.value_pool_offset else ("key", "value")
    out = []
    for a, b in runs:
        for role in roles:
            out += [(off, ln * (b - a)) for off, ln in m.page_range(lay_pos, role, a)]
    return out


def _u8(b: Blob) -> torch.Tensor:
    if isinstance(b, torch.Tensor):
        return b
    mv = host_view(b)
    return view_tensor(mv, 0, len(mv), torch.uint8)


def pages_of(
    data: torch.Tensor, scales: torch.Tensor | None, spec: KVSpec, n: int, device: torch.device
) -> torch.Tensor:
    """``n`` stored pages (uint8 bytes, plus int8 scales) as ``[n, P, H, D]`` of the
    spec's dtype on ``device``."""
    shape = (n, spec.page_size, spec.num_kv_heads, spec.head_dim)
    data = data.to(device, non_blocking=True)
    if data.storage_offset() % 16:
        # A device slice at an odd offset (the descriptor is 133 bytes) cannot be
        # reinterpreted in place: one device-side copy aligns it.
        data = data.clone()
    if scales is None:
        return data.view(spec.dtype).view(shape)
    sc = scales.to(device).clone().view(spec.dtype).view(n, spec.page_size, 1)
    q = data.view(torch.int8).view(n, spec.page_size, -1)
    return (q.float() * sc.float()).to(spec.dtype).view(shape)
