"""An LMCache chunk as a chunk object (``format/chunk.py``; pure: no LMCache import, no
I/O): the encoding of LMCache's ``KV_2LTD`` buffer into the parts a tier writes, closed
by its record, and the fingerprint of LMCache's layout. The plugin (``plugin.py``) names
chunks, pins them and moves them; this says what their bytes are.
"""

from __future__ import annotations

from typing import Any

import torch

from hurray_store.format import checksum
from hurray_store.format.chunk import ChunkFormat
from hurray_store.format.records import layout_fingerprint
from hurray_store.format.self_checked import SelfChecked


class ChunkLayout(ChunkFormat):
    """The chunk objects of one LMCache engine: ``num_layers`` layers of
    ``num_kv_heads`` x ``head_size`` in ``dtype``, chunks of up to ``chunk_size``
    tokens cut into pages of ``page_size``, under LMCache's layout fingerprint."""

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
        super().__init__(num_layers, num_kv_heads, head_size, page_size, dtype, chunk_size)
        self.chunk_size = chunk_size
        self.fingerprint = layout_fingerprint(
            num_layers, num_kv_heads, head_size, chunk_size, dtype, use_mla, page_size
        )

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
        sums = [0] * (2 * self.num_layers)  # per pool: layer 0 key, layer 0 value, ...
        pools: list[tuple[list[Any], list[int | None]]] = []  # each pool's parts, sums
        for li in range(self.num_layers):
            for r in (0, 1):
                at = (r * self.num_layers + li) * nb
                tok = whole[at : at + nb]
                if full == n:  # hashed as it is written
                    pools.append(([tok], [2 * li + r]))
                    continue
                parts = [tok[:full_b]] if full else []
                last = bytearray(self.token_bytes(P))  # the one copy, zero padded
                last[: nb - full_b] = tok[full_b:]
                parts.append(memoryview(last))
                pools.append((parts, [None] * len(parts)))
                sums[2 * li + r] = checksum(tok)  # the token bytes, not the padding
        buffers: list[Any] = []
        sum_at: list[int | None] = []
        for t in self.template(pages):
            if isinstance(t, int):
                buffers += pools[t][0]
                sum_at += pools[t][1]
            else:
                buffers.append(t)
                sum_at.append(None)

        def closing(sums: list[int]) -> list[bytes]:
            return [self.record(self.fingerprint, n, pages, sums)]

        return SelfChecked(buffers, sum_at, sums, closing, self.record_bytes, checksum)
