"""vLLM's per-layer KV views, read as the store's pages and written back (torch only, no
vLLM: it runs wherever torch does, on any device).

vLLM 0.32 allocates a KV cache group as one buffer and hands ``register_kv_caches`` one
view per layer, logically ``[blocks, kv_heads, block_size, C]`` whatever the memory
order: C holds a token's K (``head_size`` elements) then its V. The memory order is a
``KVCacheLayout`` (``vllm/v1/kv_cache_layout.py``), a stride permutation of the
logical ``[L, B, H, N, C]``; the view's strides carry it, so gathering blocks through
the view reads the right bytes in any layout. The layout named here is checked against
the view's strides, never guessed from its shape.

- ``pages_of(view, layout, head_size, block_ids)``: ``(keys, values)``, each
  ``[len(block_ids), block_size, kv_heads, head_size]``, the store's page order.
- ``write_pages(view, layout, head_size, block_ids, keys, values)``: the inverse; blocks
  not named are untouched.

Both gather with one ``index_select`` and scatter with one ``index_copy_`` (no loop over
blocks). Two variations:

- **Kernel blocks.** A view whose blocks are smaller than the manager's (vLLM splits a
  manager block of ``block_size`` tokens into kernel blocks some backends need):
  ``block_size`` says the manager's, and manager block ``b`` is kernel blocks
  ``b * r .. b * r + r - 1``, ``r = block_size / view.shape[2]``.
- **Packing within C.** vLLM's CPU backend packs each head's K region (and V region) of
  a block for its kernel; ``packing`` is the permutation the connector learns from the
  kernel (``(packed_of, logical_of)``, each ``[2, block_size * head_size]``). GPU
  backends keep C plain: token-major, K then V.

K and V of different head sizes (``C - head_size`` for V) read and write too. An MLA
model's view holds one latent per token (``C`` = ``kv_lora_rank + qk_rope_head_dim``,
one head, no K and V): ``latent_of`` and ``write_latent`` read and write it as the
store's fused pages ``[n, block_size, 1, C]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# vLLM's KVCacheLayout members: the physical order of the logical axes L, B, H, N, C
# (the test checks these against the installed vLLM's enum).
LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}

Packing = tuple[torch.Tensor, torch.Tensor]


class LayoutError(ValueError):
    """A view that is not what its layout says (or a layout not known here)."""


def view_order(layout: str) -> tuple[int, ...]:
    """The physical order of a layer view's axes ``[B, H, N, C]`` (0..3), outermost first."""
    try:
        order = LAYOUTS[layout]
    except KeyError:
        raise LayoutError(f"KV cache layout {layout!r} is not one of {sorted(LAYOUTS)}") from None
    return tuple(i - 1 for i in order if i != 0)


def allocate(
    layout: str,
    shape: tuple[int, int, int, int, int],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A KV buffer of logical ``shape`` ``(L, B, H, N, C)`` laid out in ``layout``'s
    memory order, as vLLM allocates one, and its per-layer ``[B, H, N, C]`` views
    (uninitialised). For tests and checks that need views as vLLM registers them."""
    try:
        order = LAYOUTS[layout]
    except KeyError:
        raise LayoutError(f"KV cache layout {layout!r} is not one of {sorted(LAYOUTS)}") from None
    raw = torch.empty([shape[a] for a in order], dtype=dtype, device=device)
    five = raw.permute([order.index(a) for a in range(5)])  # logical axes
    return raw, [five[i] for i in range(shape[0])]


def check_view(view: torch.Tensor, layout: str) -> None:
    """Raise LayoutError unless ``view`` is a 4-D ``[B, H, N, C]`` view whose strides
    follow ``layout`` (axes of size 1 may have any stride)."""
    order = view_order(layout)
    if view.dim() != 4:
        raise LayoutError(f"a KV layer view is [blocks, heads, tokens, C], got {tuple(view.shape)}")
    strides = [view.stride(a) for a in order if view.shape[a] > 1]
    if strides != sorted(strides, reverse=True) or (view.stride(3) != 1 and view.shape[3] > 1):
        raise LayoutError(
            f"a view of shape {tuple(view.shape)} and strides {view.stride()} is not in "
            f"layout {layout} (axes B, H, N, C in memory order {order}, C contiguous)"
        )


def _kernel_ratio(view: torch.Tensor, block_size: int | None) -> int:
    n = view.shape[2]
    bs = n if block_size is None else int(block_size)
    if bs % n:
        raise LayoutError(f"manager blocks of {bs} tokens are not whole kernel blocks of {n}")
    return bs // n


def _ids(view: torch.Tensor, block_ids: Sequence[int] | torch.Tensor, r: int) -> torch.Tensor:
    # Made and checked on the host (a device tensor's min() would wait for the device).
    ids = torch.as_tensor(block_ids, dtype=torch.long, device="cpu").reshape(-1)
    if r > 1:
        ids = (ids[:, None] * r + torch.arange(r)).reshape(-1)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= view.shape[0]):
        raise IndexError(f"block ids outside the view's {view.shape[0] // r} blocks")
    return ids.to(view.device)


def _gather(view: torch.Tensor, layout: str, ids: torch.Tensor) -> torch.Tensor:
    """``view.index_select(0, ids)``, done in the view's memory order (whole runs of
    bytes), seen back as ``[n, H, N, C]``."""
    order = view_order(layout)
    back = [order.index(a) for a in range(4)]
    return view.permute(order).index_select(order.index(0), ids).permute(back)


def _scatter(view: torch.Tensor, layout: str, ids: torch.Tensor, blk: torch.Tensor) -> None:
    """``view.index_copy_(0, ids, blk)``, in the view's memory order."""
    order = view_order(layout)
    src = blk.permute(order).contiguous()
    view.permute(order).index_copy_(order.index(0), ids, src)


def _split_c(c: int, head_size: int) -> int:
    if not 0 < head_size < c:
        raise LayoutError(f"C of {c} elements holds no K of {head_size} and a V")
    return c - head_size


def _check_packing(hv: int, head_size: int, r: int) -> None:
    if hv != head_size or r != 1:
        raise LayoutError("a packed C holds K and V of one head size, in whole blocks")


def pages_of(
    view: torch.Tensor,
    layout: str,
    head_size: int,
    block_ids: Sequence[int] | torch.Tensor,
    *,
    block_size: int | None = None,
    packing: Packing | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks ``block_ids`` of one layer view as the store's pages: ``(keys,
    values)``, each ``[n, block_size, kv_heads, head]`` (contiguous, on the view's
    device). ``block_size``: the manager's block size when the view holds kernel
    blocks; ``packing``: the CPU backend's packing within C; ``out``: two tensors of
    that shape (on any device) the pages are copied into, and returned."""
    check_view(view, layout)
    r = _kernel_ratio(view, block_size)
    ids = _ids(view, block_ids, r)
    nb, heads, nk, c = view.shape
    hv = _split_c(c, head_size)
    blk = _gather(view, layout, ids)  # [n * r, H, Nk, C]
    n = ids.numel() // r
    if r > 1:  # kernel blocks of one manager block, in token order
        blk = blk.reshape(n, r, heads, nk, c).transpose(1, 2).reshape(n, heads, r * nk, c)
    tokens = r * nk
    if packing is not None:
        _check_packing(hv, head_size, r)
        _, logical_of = packing
        x = blk.reshape(n, heads, 2, tokens * head_size)
        x = x.gather(-1, logical_of.to(x.device).expand(x.shape))
        kv = x.view(n, heads, 2, tokens, head_size)
        k, v = kv[:, :, 0], kv[:, :, 1]
    else:
        k, v = blk[..., :head_size], blk[..., head_size:]
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    if out is None:
        return k.contiguous(), v.contiguous()
    for src, dst in zip((k, v), out, strict=True):
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"out {tuple(dst.shape)} {dst.dtype}, pages {tuple(src.shape)}")
        dst.copy_(src)
    return out


def write_pages(
    view: torch.Tensor,
    layout: str,
    head_size: int,
    block_ids: Sequence[int] | torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    block_size: int | None = None,
    packing: Packing | None = None,
) -> None:
    """Write pages ``keys``/``values`` (each ``[n, block_size, kv_heads, head]``) into
    the blocks ``block_ids`` of one layer view, as ``pages_of`` reads them; other
    blocks are untouched."""
    check_view(view, layout)
    r = _kernel_ratio(view, block_size)
    ids = _ids(view, block_ids, r)
    nb, heads, nk, c = view.shape
    hv = _split_c(c, head_size)
    n, tokens = ids.numel() // r, r * nk
    want_k, want_v = (n, tokens, heads, head_size), (n, tokens, heads, hv)
    if tuple(keys.shape) != want_k or tuple(values.shape) != want_v:
        raise ValueError(
            f"pages {tuple(keys.shape)} and {tuple(values.shape)}, the blocks take "
            f"{want_k} and {want_v}"
        )
    k = keys.to(view.device, view.dtype).transpose(1, 2)  # [n, H, N, hs]
    v = values.to(view.device, view.dtype).transpose(1, 2)
    if packing is not None:
        _check_packing(hv, head_size, r)
        packed_of, _ = packing
        kv = torch.stack([k, v], dim=2).reshape(n, heads, 2, tokens * head_size)
        blk = kv.gather(-1, packed_of.to(kv.device).expand(kv.shape)).view(n, heads, tokens, c)
    else:
        blk = torch.cat([k, v], dim=-1)  # [n, H, N, C]
    if r > 1:
        blk = blk.view(n, heads, r, nk, c).transpose(1, 2).reshape(n * r, heads, nk, c)
    _scatter(view, layout, ids, blk)


def latent_of(
    view: torch.Tensor,
    layout: str,
    block_ids: Sequence[int] | torch.Tensor,
    *,
    block_size: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The blocks ``block_ids`` of an MLA layer view (``[B, 1, N, C]``, the latent per
    token) as the store's fused pages ``[n, block_size, 1, C]`` (copied into ``out``
    when given)."""
    check_view(view, layout)
    r = _kernel_ratio(view, block_size)
    ids = _ids(view, block_ids, r)
    nb, heads, nk, c = view.shape
    n = ids.numel() // r
    blk = _gather(view, layout, ids).reshape(n, heads, r * nk, c)  # kernel blocks in order
    pages = blk.transpose(1, 2)
    if out is None:
        return pages.contiguous()
    if out.shape != pages.shape or out.dtype != pages.dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype}, pages {tuple(pages.shape)}")
    out.copy_(pages)
    return out


def write_latent(
    view: torch.Tensor,
    layout: str,
    block_ids: Sequence[int] | torch.Tensor,
    pages: torch.Tensor,
    *,
    block_size: int | None = None,
) -> None:
    """Write fused pages ``[n, block_size, 1, C]`` into the blocks ``block_ids`` of an
    MLA layer view, as ``latent_of`` reads them; other blocks are untouched."""
    check_view(view, layout)
    r = _kernel_ratio(view, block_size)
    ids = _ids(view, block_ids, r)
    nb, heads, nk, c = view.shape
    n = ids.numel() // r
    if tuple(pages.shape) != (n, r * nk, heads, c):
        raise ValueError(f"pages {tuple(pages.shape)}, the blocks take {(n, r * nk, heads, c)}")
    blk = pages.to(view.device, view.dtype).transpose(1, 2).reshape(n * r, heads, nk, c)
    _scatter(view, layout, ids, blk)
