"""The plugin's gets: LMCache's chunks read straight into LMCache's buffer and checked
there against their records.

A get reads every layer's token bytes and the record beside them, in one ranged read
(on disk one file, on Redis one transaction), on LMCache's thread: from a disk tier or a
single Redis it reads there too, with no trip to the store's loop, each range hashed as
it comes in; from the others, on the loop, all at once, checked here. Any mismatch is a
miss, and the object leaves the store: never wrong data. (A chunk whose last page is
partial comes back with a copy of its tokens: the token count is in the record, read
with them.)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

from hurray_store.adapters.lmcache.chunks import ChunkRegistry
from hurray_store.adapters.lmcache.layout import ChunkLayout
from hurray_store.engine import EnginePort
from hurray_store.errors import FormatError
from hurray_store.format import checksum
from hurray_store.tiers import RangeIn

log = logging.getLogger(__name__)


class ChunkGets:
    """Gets of one engine's chunks (``chunks``) from ``store`` into LMCache's buffer
    (``allocator``, LMCache's local CPU backend)."""

    def __init__(
        self, port: EnginePort, chunks: ChunkRegistry, layout: ChunkLayout, allocator: Any
    ) -> None:
        self.port, self.chunks = port, chunks
        self.layout, self.allocator = layout, allocator

    def get_many(self, keys: Sequence[Any]) -> list[MemoryObj | None]:
        """The chunks of ``keys``, None where missing, read through the port
        (``EnginePort.read``: on a disk tier or a single Redis from this thread, as
        LMCache's own disk backend reads, each range hashed as it comes in; else on the
        store's loop) and checked here. Any mismatch is a miss, and the chunk leaves."""
        out: list[MemoryObj | None] = [None] * len(keys)
        gets: list[_ChunkGet] = []
        try:
            for j, key in enumerate(keys):
                if (g := self._prepare(key, j)) is not None:
                    gets.append(g)
            read = self.port.read(
                [(g.name, g.ranges, g.into) for g in gets], self._hash_range(gets)
            )
            for g, ok in zip(gets, read, strict=True):
                if not ok:
                    g.release()  # gone since the ledger said so
                elif None in g.sums:  # read on the store's loop: hashed here
                    g.sums = [checksum(d) for d in g.dst]
            for g in gets:
                if g.out is not None:
                    out[g.index] = g.finish(self)
        except BaseException:
            for o in out:
                if o is not None:
                    o.ref_count_down()
            raise
        finally:
            for g in gets:
                g.release()  # whatever finish did not hand over
        return out

    @staticmethod
    def _hash_range(gets: list[_ChunkGet]) -> RangeIn:
        def hashed(j: int, i: int, s: int) -> None:  # hashed as it came in
            g = gets[j]
            if i < len(g.dst):
                g.sums[i] = s

        return hashed

    def _prepare(self, key: Any, index: int) -> _ChunkGet | None:
        """What a get of ``key`` (``index`` in its batch) reads where: from its object's
        size in the ledger (the loop asks shared tiers when they do not know it), its
        page count, and LMCache's buffer for its tokens. None: a miss."""
        k = self.chunks.name(key)
        size = self.port.size(k)
        if size is None:
            return None
        pages = self.layout.pages_of(size)
        if pages is None:
            self.drop_chunk(key, k, f"{size} bytes is the size of no chunk object of this layout")
            return None
        # The page count gives the token count but for a partial last page: read that
        # many tokens, and the record beside them.
        n = min(pages * self.layout.page_size, self.layout.chunk_size)
        out = self.allocate_chunk(key, n)
        if out is None:
            return None
        try:
            return _ChunkGet(key, index, k, pages, n, out, self)
        except BaseException:
            out.ref_count_down()
            raise

    def drop_chunk(self, key: Any, name: str, why: str) -> None:
        """A chunk object that failed verification: deleted, a miss (a get's seam)."""
        log.warning("hurray plugin: %s failed verification (%s); a miss", key, why)
        self.port.reject(name, why)

    def pool_views(self, obj: MemoryObj) -> list[memoryview]:
        """Byte views of a chunk's token rows, per layer its keys then its values."""
        # [2, layers, tokens, width]: one view, with no torch operation (see ChunkLayout.encode)
        whole, L = memoryview(obj.byte_array).cast("B"), self.layout.num_layers
        nb = len(whole) // (2 * L)
        return [whole[(r * L + li) * nb : (r * L + li + 1) * nb] for li in range(L) for r in (0, 1)]

    def allocate_chunk(self, key: Any, tokens: int) -> MemoryObj | None:
        """LMCache's buffer for a chunk of ``tokens`` (a get's seam); None when full."""
        lay = self.layout
        out = self.allocator.allocate(
            torch.Size([2, lay.num_layers, tokens, lay.num_kv_heads * lay.head_size]),
            lay.dtype,
            MemoryFormat.KV_2LTD,
        )
        if out is None:
            log.warning("hurray plugin: LMCache's CPU buffer is full; %s is a miss", key)
        return out


class _ChunkGet:
    """One chunk's get: where its ranges sit in its object, LMCache's buffer they go
    into, and the record and checksums that check them."""

    def __init__(
        self, key: Any, index: int, name: str, pages: int, n: int, out: MemoryObj, gets: ChunkGets
    ) -> None:
        self.key, self.index, self.name, self.pages, self.n = key, index, name, pages, n
        self.out: MemoryObj | None = out
        self.rec = bytearray(gets.layout.record_bytes)
        self.ranges = gets.layout.ranges_of(pages)  # the object's size is the layout's
        self.dst = gets.pool_views(out)
        self.into = [*self.dst, memoryview(self.rec)]
        self.sums: list[int | None] = [None] * len(self.dst)

    def release(self) -> None:
        if self.out is not None:
            self.out.ref_count_down()
            self.out = None

    def finish(self, p: ChunkGets) -> MemoryObj | None:
        """The chunk, once its bytes match its record; else a miss, and the object
        leaves the store. A record of fewer tokens than read (a partial last page) gets
        the chunk's tokens copied into a buffer of their size, hashed again."""
        lay = p.layout
        why = lay.check(self.rec, lay.fingerprint, self.n, self.pages, self.sums)
        if why:
            try:
                got, _ = lay.parse(self.rec, lay.fingerprint, self.pages)
            except FormatError:
                got = self.n
            if got < self.n:
                part = p.allocate_chunk(self.key, got)
                if part is None:
                    return None
                assert self.out is not None
                part.tensor.copy_(self.out.tensor[:, :, :got])
                self.release()
                self.out = part
                sums = [checksum(d) for d in p.pool_views(part)]  # its tokens only
                why = lay.check(self.rec, lay.fingerprint, got, self.pages, sums)
        if why:
            p.drop_chunk(self.key, self.name, why)
            return None
        out, self.out = self.out, None
        return out
