"""SGLang's HiCache host pages as hurray_store objects (pure: torch, the format and the
records; no SGLang, so it runs where SGLang is not installed).

**One object per SGLang page.** SGLang names every page by a hash of its tokens chained
to the pages before it, and asks for pages by those names: which of a batch exist
(``batch_exists``: the leading run), then a get or a set of up to 128 pages at once, and
a later call may name any run of them again. A page is therefore the unit that is
looked up, written once and evicted alone; a batch's pages are read concurrently. The
object of a page is the same stream as an LMCache chunk object (``records``): key and
value block-paged descriptors, each with its pool (one page), then the chunk record
(``HSLC``), the commit point, with the xxh3-64 of each pool. The record's fingerprint
is the page's own (``page_fingerprint``: the object's form, the model, the geometry,
the ranks and the page's name), so an object read under another name or form is
refused, never copied into the pool.

**The host pool's layouts.** ``page_view(kv_buffer, layout, page_size, index)`` is one
page of SGLang's ``MHATokenToKVPoolHost.kv_buffer`` as a ``[2, layers, page_size, heads,
head_dim]`` view (no copy), for the layouts SGLang's MHA host pool has:

- ``layer_first``       ``(2, layers, tokens, heads, head_dim)``
- ``page_first``        ``(2, tokens, layers, heads, head_dim)``
- ``page_first_direct`` ``(2, pages, layers, page_size, heads, head_dim)``
- ``page_head``         ``(2, pages, heads, page_size, layers, head_dim)``

(``page_unified`` interleaves K and V inside head groups: not supported.)

**Two forms of a page object.** Per layer (``layer_first``, ``page_first_direct``,
``page_head``): per layer a K and a V descriptor of ``[page_size, heads, head_dim]``,
which are contiguous in ``layer_first`` and ``page_first_direct`` pools. Token-major
(``page_first``, ``TOKEN_MAJOR``): one K and one V descriptor of ``[page_size, layers *
heads, head_dim]``, the page's tokens with every layer's heads side by side, which is how
``page_first`` holds a page (its K, then its V, each one contiguous run). Either way a
page set is written from the host pool's own bytes where its pools are contiguous there
(``direct_pools``), else from a contiguous staging page it is copied into; a page read
is checked in a staging buffer before any byte of it reaches the pool. The form is part
of a page's name (``adapters/sglang/backend.py``): an object is only ever read in its own form.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from hurray_store.format import checksum
from hurray_store.format.chunk import ChunkFormat

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
# The layouts of SGLang's MLA host pool (``MLATokenToKVPoolHost``): one latent per token
# and layer, ``[layers, tokens, 1, dim]``, ``[tokens, layers, 1, dim]`` or ``[pages,
# layers, page_size, 1, dim]``.
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
# Host layouts whose pages are token-major objects: one K and one V pool of the page's
# tokens, all layers' heads side by side, as the layout holds them (two parts to write
# and two pools to hash per page, no copy; per layer it took a transposing copy).
TOKEN_MAJOR = frozenset({"page_first"})


class PageLayoutError(ValueError):
    """A host pool or page the backend cannot read or write."""


def page_view(
    kv_buffer: torch.Tensor, layout: str, page_size: int, index: int, mla: bool = False
) -> torch.Tensor:
    """The page that starts at token ``index`` of SGLang's host ``kv_buffer`` in
    ``layout``, as a ``[2, layers, page_size, heads, head_dim]`` view (``mla``: of an
    MLA pool, ``[1, layers, page_size, 1, dim]``: its latent)."""
    P = page_size
    if index < 0 or index % P:
        raise PageLayoutError(f"token index {index} does not start a page of {P}")
    kv = kv_buffer
    if mla:
        return _mla_page_view(kv, layout, P, index)
    if layout == "layer_first":
        if index + P > kv.shape[2]:
            raise PageLayoutError(f"token index {index} outside a pool of {kv.shape[2]} tokens")
        return kv[:, :, index : index + P]
    if layout == "page_first":
        if index + P > kv.shape[1]:
            raise PageLayoutError(f"token index {index} outside a pool of {kv.shape[1]} tokens")
        return kv[:, index : index + P].permute(0, 2, 1, 3, 4)
    page = index // P
    if page >= kv.shape[1]:
        raise PageLayoutError(f"token index {index} outside a pool of {kv.shape[1]} pages")
    if layout == "page_first_direct":
        return kv[:, page]
    if layout == "page_head":
        return kv[:, page].permute(0, 3, 2, 1, 4)
    raise PageLayoutError(f"host layout {layout!r} is not one of {list(LAYOUTS)}")


def _mla_page_view(kv: torch.Tensor, layout: str, P: int, index: int) -> torch.Tensor:
    if layout == "layer_first":
        if index + P > kv.shape[1]:
            raise PageLayoutError(f"token index {index} outside a pool of {kv.shape[1]} tokens")
        return kv[:, index : index + P].unsqueeze(0)
    if layout == "page_first":
        if index + P > kv.shape[0]:
            raise PageLayoutError(f"token index {index} outside a pool of {kv.shape[0]} tokens")
        return kv[index : index + P].transpose(0, 1).unsqueeze(0)
    if layout == "page_first_direct":
        if index // P >= kv.shape[0]:
            raise PageLayoutError(f"token index {index} outside a pool of {kv.shape[0]} pages")
        return kv[index // P].unsqueeze(0)
    raise PageLayoutError(f"MLA host layout {layout!r} is not one of {list(MLA_LAYOUTS)}")


def flat_page_view(flat: torch.Tensor, layout: str, codec: PageCodec) -> torch.Tensor:
    """A flat page of SGLang's legacy calls (``get_data_page(flat=True)``,
    ``get_dummy_flat_data_page``: the host layout's own page order) as a ``[2, layers,
    page_size, heads, head_dim]`` view."""
    R, L, P, H, D = codec.shape
    if flat.dim() != 1 or flat.numel() != R * L * P * H * D or flat.dtype != codec.dtype:
        raise PageLayoutError(
            f"a flat page of {R * L * P * H * D} {codec.dtype}, got {tuple(flat.shape)} "
            f"of {flat.dtype}"
        )
    if not flat.is_contiguous():
        raise PageLayoutError("a flat page that is not contiguous")
    if codec.fused:  # an MLA pool's page: [L, P, 1, D], [P, L, 1, D] or [1, L, P, 1, D]
        if layout == "page_first":
            return flat.view(P, L, H, D).transpose(0, 1).unsqueeze(0)
        if layout in ("layer_first", "page_first_direct"):
            return flat.view(1, L, P, H, D)
        raise PageLayoutError(f"MLA host layout {layout!r} is not one of {list(MLA_LAYOUTS)}")
    if layout in ("layer_first", "page_first_direct"):
        return flat.view(2, L, P, H, D)
    if layout == "page_first":
        return flat.view(2, P, L, H, D).permute(0, 2, 1, 3, 4)
    if layout == "page_head":
        return flat.view(2, H, P, L, D).permute(0, 3, 2, 1, 4)
    raise PageLayoutError(f"host layout {layout!r} is not one of {list(LAYOUTS)}")


def page_fingerprint(prefix: str, name: str) -> bytes:
    """The 32-byte fingerprint a page's record carries: its key prefix (layout, model,
    ranks) and its SGLang name."""
    return hashlib.sha256(f"hurray_store/sglang-page/v1|{prefix}|{name}".encode()).digest()


class PageCodec:
    """The byte layout of a page object of ``layers`` layers of ``[page_size, heads,
    head_dim]`` keys and values of ``dtype``, per layer or token-major (``token_major``:
    one ``[page_size, layers * heads, head_dim]`` K and V): where each pool sits, the
    object's size, the object of a staging page, where a read object's pools are, and
    its check. A page is handed over as a ``[2, layers, page_size, heads, head_dim]``
    view (``shape``) in both forms. ``fused``: an MLA pool's page, one latent per layer
    (``[1, layers, page_size, 1, dim]``), stored as fused descriptors."""

    def __init__(
        self,
        layers: int,
        heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        token_major: bool = False,
        fused: bool = False,
    ) -> None:
        self.layers, self.heads, self.head_dim = layers, heads, head_dim
        self.page_size, self.dtype, self.token_major = page_size, dtype, token_major
        self.fused = fused
        self.roles = R = 1 if fused else 2
        self.shape = (R, layers, page_size, heads, head_dim)  # a page, as page_view gives it
        # The object's own layers and heads (its descriptors, records and pools)
        self.obj_layers, self.obj_heads = (1, layers * heads) if token_major else (layers, heads)
        # a staging page: the object's pools in order (K, then V; per layer, or per token)
        self.staging_shape = (R, page_size, layers, heads, head_dim) if token_major else self.shape
        self.pool_bytes = page_size * self.obj_heads * head_dim * dtype.itemsize  # one K or V
        self.page_bytes = R * self.obj_layers * self.pool_bytes
        # The object: a chunk object of one page (``format/chunk.py``)
        self.format = ChunkFormat(
            self.obj_layers, self.obj_heads, head_dim, page_size, dtype, page_size, fused
        )
        self.pools, self.size = self.format.layout(1)  # per layer where its K and V start
        self.record_bytes = self.format.record_bytes
        # Where the pools sit, as strides over the object's bytes (role, layer), when the
        # layers' descriptors are all of one length (they are, up to layer 2**7 here):
        # a read page is then copied out in one strided copy.
        k0, v0 = self.pools[0]
        step = self.pools[1][0] - k0 if self.obj_layers > 1 else 0
        # (role stride, layer stride); fused: the one pool of a layer is its "K"
        self.strides: tuple[int, int] | None = (v0 - k0 or 1, step)
        if any(p != (k0 + li * step, v0 + li * step) for li, p in enumerate(self.pools)):
            self.strides = None

    def page_of(self, obj: torch.Tensor) -> list[tuple[torch.Tensor, int, int]]:
        """The pools of a page object read into ``obj`` (a uint8 tensor of ``size``
        bytes), as ``(byte view, role, layer)`` parts of the ``[2, layers, page_size,
        heads, head_dim * itemsize]`` bytes of the page: one strided view when the
        pools are evenly spaced, else one per pool."""
        isz, at = self.dtype.itemsize, obj.storage_offset()
        row = (self.page_size, self.heads, self.head_dim * isz)
        inner = (self.heads * self.head_dim * isz, self.head_dim * isz, 1)
        if self.token_major:  # K [page_size, layers, heads, ...], then V: seen layer first
            (k0, v0), hd = self.pools[0], self.head_dim * isz
            view = obj.as_strided(
                (self.roles, self.layers, *row),
                (v0 - k0 or 1, inner[0], self.layers * inner[0], hd, 1),
                at + k0,
            )
            return [(view, -1, -1)]
        if self.strides is not None:
            kv, step = self.strides
            view = obj.as_strided(
                (self.roles, self.layers, *row), (kv, step, *inner), at + self.pools[0][0]
            )
            return [(view, -1, -1)]
        return [
            (obj.as_strided(row, inner, at + off), r, li)
            for li, pair in enumerate(self.pools)
            for r, off in enumerate(pair[: self.roles])
        ]

    def pool_sums(self, obj: memoryview) -> list[int]:
        """The xxh3-64 of each pool of a page object read into ``obj``, layer 0 K first."""
        nb = self.pool_bytes
        return [checksum(obj[off : off + nb]) for off in self.format.pool_offsets(1)]

    def staging_bytes(self, staging: torch.Tensor) -> memoryview:
        """The bytes of a contiguous buffer of staging pages ``[n, *staging_shape]``
        (taken once per batch: a tensor operation hands the GIL over, and with the
        store's threads busy it took milliseconds to get it back)."""
        if tuple(staging.shape[1:]) != self.staging_shape or not staging.is_contiguous():
            raise PageLayoutError(f"staging pages are a contiguous [n, {self.staging_shape}]")
        return memoryview(staging.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]

    def staging_page(self, staging: torch.Tensor, j: int) -> torch.Tensor:
        """Staging page ``j`` of ``staging`` (``[n, *staging_shape]``) as a ``[2, layers,
        page_size, heads, head_dim]`` view, to copy a page into."""
        page = staging[j]
        return page.permute(0, 2, 1, 3, 4) if self.token_major else page

    def pool_views(self, pages: memoryview, j: int) -> list[memoryview]:
        """The 2 x object layers byte views of staging page ``j`` of ``pages``
        (``staging_bytes``), layer 0 K, layer 0 V, layer 1 K, ..."""
        nb, half = self.pool_bytes, self.obj_layers * self.pool_bytes
        at = j * self.page_bytes
        return [
            pages[at + r * half + li * nb : at + r * half + (li + 1) * nb]
            for li in range(self.obj_layers)
            for r in range(self.roles)
        ]

    def encode(self, pools: Sequence[memoryview], fingerprint: bytes) -> list[memoryview | bytes]:
        """The buffers of the object of a page whose pools are ``pools`` (layer 0 K,
        layer 0 V, ...: ``pool_views`` of a staging page, or ``direct_pools`` of the
        host pool's), which must stay unchanged until the put returns. Each pool is
        hashed now, on the calling thread: right after it was copied into staging its
        bytes are still in the CPU's cache, and the store's threads are left the write."""
        sums = [checksum(v) for v in pools]
        parts: list[memoryview | bytes] = self.format.parts(1, pools)
        parts.append(self.format.record(fingerprint, self.page_size, 1, sums))
        return parts

    def direct_pools(self, page: torch.Tensor, storage: memoryview) -> list[memoryview] | None:
        """The 2 x object layers byte views (layer 0 K, layer 0 V, ...) of ``page``, a
        ``[2, layers, page_size, heads, head_dim]`` view (``page_view``) into the bytes
        ``storage`` of its tensor's storage, when each pool of it is contiguous there
        (per layer: SGLang's ``layer_first`` and ``page_first_direct``; token-major:
        ``page_first``): the object is then written from the host pool with no copy.
        None when they are not."""
        _, L, P, H, D = self.shape
        st = page.stride()
        if tuple(page.shape) != self.shape or page.dtype != self.dtype:
            return None
        isz, nb = self.dtype.itemsize, self.pool_bytes
        at = page.storage_offset() * isz
        if self.token_major:  # [P, L, H, D] of K, of V
            if st[1:] != (H * D, L * H * D, D, 1):
                return None
            starts = [at, at + st[0] * isz][: self.roles]
        else:  # [P, H, D] of each layer's K, V
            if st[2:] != (H * D, D, 1):
                return None
            starts = [
                at + (li * st[1] + r * st[0]) * isz for li in range(L) for r in range(self.roles)
            ]
        if at < 0 or max(starts) + nb > len(storage):
            return None
        return [storage[a : a + nb] for a in starts]

    def check(
        self, record: memoryview | bytes | bytearray, fingerprint: bytes, sums: Sequence[int]
    ) -> str:
        """Why the page read (``sums``: the xxh3-64 of each of its pools as read, layer
        0 K first; ``record``: the record's bytes) is not this page's object; "" when it is."""
        return self.format.check(record, fingerprint, self.page_size, 1, sums)
