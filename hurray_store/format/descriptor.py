"""Block-paged descriptors, built with pyhurray (pure, no I/O).

Why this module does not just call ``hurray.StreamWriter`` / ``StreamReader``:

* pyhurray's ``Tensor`` copies every buffer it is given, and its in-memory writer copies
  again (far below memcpy's speed end to end). We build each descriptor with pyhurray once per
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
from collections.abc import Sequence

import hurray
import numpy as np

from hurray_store.format.layout import (
    HANDLE_LEN,
    INDEX_NP,
    OFF_HANDLES,
    OFF_NUM_PAGES,
    OFF_NUM_SEQS,
    OFF_SHAPE0,
)

log = logging.getLogger(__name__)


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
    size fields ``build_descriptor`` sets. Returns (bytes, buffer count)."""
    hdtype = hurray.int8 if scale_dtype_name else getattr(hurray, hdtype_name)
    elem = 1 if scale_dtype_name else _elem_size(hdtype_name)
    idx = INDEX_NP[index_type]
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


def build_descriptor(
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
        struct.pack_into("<Q", out, OFF_SHAPE0, table_len * page_size)
        struct.pack_into("<Q", out, OFF_NUM_PAGES, num_pages)
        struct.pack_into("<I", out, OFF_NUM_SEQS, num_seqs)
        for i, n in enumerate(sizes):
            struct.pack_into("<Q", out, OFF_HANDLES + i * HANDLE_LEN, n)
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
    idx = INDEX_NP[index_type]
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
