"""An LMCache chunk as a hurray_store object (pure: no LMCache import, no I/O): where
each layer's key and value pools lie in the chunk object for a chunk of so many pages,
the ranges a get reads, and the encoding of a chunk into the buffers a tier writes,
closed by its record (docs/format.md, "Chunk objects"). The plugin
(``plugin.py``) names chunks, pins them and moves them; this says what their bytes are.
"""

from __future__ import annotations

from typing import Any

import torch

from hurray_store.format import Placeholder, checksum, plan_layer
from hurray_store.format.wire import blob_descriptor
from hurray_store.records import chunk_record_bytes, chunk_record_of, layout_fingerprint
from hurray_store.tiers import SelfChecked


class ChunkLayout:
    """The layout of the chunks of one LMCache engine: ``num_layers`` layers of
    ``num_kv_heads`` x ``head_size`` in ``dtype``, chunks of up to ``chunk_size``
    tokens cut into pages of ``page_size``. What it computes per page count is made
    once and not to be changed (get workers read it from their threads)."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
        chunk_size: int,
        dtype: torch.dtype,
        use_mla: bool,
        page_size: int,
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.chunk_size = chunk_size
        self.dtype = dtype
        self.page_size = page_size
        self.fingerprint = layout_fingerprint(
            num_layers, num_kv_heads, head_size, chunk_size, dtype, use_mla, page_size
        )
        self.record_bytes = chunk_record_bytes(num_layers)
        self.record_descriptor = blob_descriptor(self.record_bytes)
        self.record_of = chunk_record_of(num_layers)
        self._plans: dict[tuple[int, int], Any] = {}  # (layer, pages) -> LayerPlan
        self._pages: dict[int, int] | None = None  # chunk object size -> its pages
        self._layouts: dict[int, tuple[list[tuple[int, int]], int]] = {}  # by page count
        self._reads: dict[int, list[tuple[int, int]]] = {}  # a get's ranges, by page count

    def encode(self, obj: Any) -> SelfChecked:
        """The chunk object: views of LMCache's buffer, the descriptors, one padded copy
        of a partial last page per pool, and the record, closed with the checksums of
        the chunk's token bytes. Runs on LMCache's thread, which keeps a reference to
        the buffer until the put completes. A pool of whole pages is hashed where the
        object is written (a disk tier: on its writer thread, just before the write),
        a pool with a partial last page here; each byte once."""
        shape = obj.get_shape()
        width = self.num_kv_heads * self.head_size
        if (
            len(shape) != 4
            or shape[0] != 2
            or shape[1] != self.num_layers
            or shape[3] != width
            or obj.get_dtype() != self.dtype
        ):
            raise ValueError(
                f"expected a KV_2LTD chunk [2, {self.num_layers}, tokens, {width}] of "
                f"{self.dtype}, got {tuple(shape)} of {obj.get_dtype()}"
            )
        n = int(shape[2])
        P = self.page_size
        pages = -(-n // P)
        full = n // P * P
        # Each layer's key (or value) tokens are one run of the chunk's bytes: views of
        # one byte view of the whole chunk, sliced (no tensor made per layer). LMCache's
        # ``byte_array`` is made from the buffer's address with no torch operation: each
        # of those lets go of the GIL, and with the store's threads busy a slice or view
        # of a tensor waits milliseconds to get it back, where this takes a microsecond.
        whole = memoryview(obj.byte_array).cast("B")
        nb, full_b = self.token_bytes(n), self.token_bytes(full)
        if len(whole) != 2 * self.num_layers * nb:
            raise ValueError(f"a chunk of {n} tokens in {len(whole)} bytes")
        buffers: list[Any] = []
        sum_at: list[int | None] = []
        sums = [0] * (2 * self.num_layers)  # per layer its key's and its value's
        offsets, size = self.layers_of(pages)
        for li in range(self.num_layers):
            pools: dict[str, tuple[list[Any], list[int | None]]] = {}
            for r, role in enumerate(("key", "value")):
                at = (r * self.num_layers + li) * nb
                tok = whole[at : at + nb]
                if full == n:  # hashed as it is written
                    pools[role] = ([tok], [2 * li + r])
                    continue
                parts = [tok[:full_b]] if full else []
                last = bytearray(self.token_bytes(P))  # the one copy, zero padded
                last[: nb - full_b] = tok[full_b:]
                parts.append(memoryview(last))
                pools[role] = (parts, [None] * len(parts))
                sums[2 * li + r] = checksum(tok)  # the token bytes, not the padding
            for part in self.plan(li, pages).parts:
                if isinstance(part, Placeholder):
                    buffers += pools[part.role][0]
                    sum_at += pools[part.role][1]
                else:
                    buffers.append(part)
                    sum_at.append(None)
        buffers.append(self.record_descriptor)
        sum_at.append(None)

        def closing(sums: list[int]) -> list[bytes]:
            return [self.record_of(self.fingerprint, n, size, offsets, sums)]

        return SelfChecked(buffers, sum_at, sums, closing, self.record_bytes, checksum)

    def plan(self, layer: int, pages: int) -> Any:
        """The descriptors of a layer of ``pages`` pages (one sequence), made once."""
        plan = self._plans.get((layer, pages))
        if plan is None:
            plan = self._plans[(layer, pages)] = plan_layer(
                layer,
                torch.arange(pages),
                torch.tensor([0, pages]),
                num_pages=pages,
                page_size=self.page_size,
                heads=self.num_kv_heads,
                dim=self.head_size,
                dtype=self.dtype,
            )
        return plan

    def layers_of(self, pages: int) -> tuple[list[tuple[int, int]], int]:
        """Where each layer's key and value pools start in a chunk object of ``pages``
        pages, and the object's size (made once per page count; not to be changed)."""
        got = self._layouts.get(pages)
        if got is None:
            pools, pos = [], 0
            for li in range(self.num_layers):
                plan = self.plan(li, pages)
                pools.append((pos + plan.key_pool_offset, pos + plan.value_pool_offset))
                pos += plan.nbytes
            got = self._layouts[pages] = (
                pools,
                pos + len(self.record_descriptor) + self.record_bytes,
            )
        return got

    def ranges_of(self, pages: int) -> list[tuple[int, int]]:
        """What a get of a chunk object of ``pages`` pages reads: each layer's key and
        value tokens, then the record (made once per page count; not to be changed)."""
        got = self._reads.get(pages)
        if got is None:
            pools, size = self.layers_of(pages)
            nb = self.token_bytes(min(pages * self.page_size, self.chunk_size))
            got = self._reads[pages] = [
                *((off, nb) for pair in pools for off in pair),
                (size - self.record_bytes, self.record_bytes),
            ]
        return got

    def pages_of(self, size: int) -> int | None:
        """The page count of a chunk object of ``size`` bytes (None: no such object)."""
        by_size = self._pages
        if by_size is None:  # made whole, then published: get workers read it at once
            by_size = {
                self.layers_of(pages)[1]: pages
                for pages in range(1, -(-self.chunk_size // self.page_size) + 1)
            }
            self._pages = by_size
        return by_size.get(size)

    def token_bytes(self, n: int) -> int:
        return n * self.num_kv_heads * self.head_size * self.dtype.itemsize
