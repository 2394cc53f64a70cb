"""Chunk objects: the one byte format of a page or chunk as one object, for LMCache's
chunks and SGLang's pages alike (pure). Per layer a key and a value block-paged
descriptor with its pool (or, ``fused``, one descriptor of kv_role ``fused``: an MLA
latent, which serves as both), then the chunk record (``HSLC``, ``records.py``), the
commit point (docs/format.md, "Chunk objects"). ``ChunkFormat`` lays one out per page
count, makes its parts and record, and checks one read against its record."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hurray_store.errors import FormatError
from hurray_store.format.encode import plan_layer
from hurray_store.format.layout import LayerPlan, Placeholder
from hurray_store.format.records import (
    ChunkLayer,
    chunk_record_bytes,
    chunk_record_of,
    parse_chunk_record,
)
from hurray_store.format.wire import blob_descriptor

Pools = list[tuple[int, int]]  # per layer, where its key and value pools start


class ChunkFormat:
    """Chunk objects of ``num_layers`` layers of ``[tokens, num_kv_heads, head_size]``
    keys and values of ``dtype`` (``fused``: one latent per layer), in pages of
    ``page_size``, of up to ``max_tokens`` tokens. What it computes per page count is
    made once and never changed (readers take it from their threads).

    Pools are numbered in stream order: layer 0 key, layer 0 value, layer 1 key, ...;
    fused, one per layer. The record keeps a key and a value entry per layer whatever
    the form: a fused layer's names its one pool, and that pool's checksum, as both."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
        page_size: int,
        dtype: torch.dtype,
        max_tokens: int,
        fused: bool = False,
    ) -> None:
        if min(num_layers, num_kv_heads, head_size, page_size, max_tokens) < 1:
            raise ValueError("a chunk object has at least one layer, head, page and token")
        self.fused = fused
        self.roles: tuple[str, ...] = ("fused",) if fused else ("key", "value")
        self.num_layers, self.num_kv_heads, self.head_size = num_layers, num_kv_heads, head_size
        self.page_size, self.dtype, self.max_tokens = page_size, dtype, max_tokens
        self.max_pages = -(-max_tokens // page_size)
        self.record_bytes = chunk_record_bytes(num_layers)
        self.record_descriptor = blob_descriptor(self.record_bytes)
        self.record_of = chunk_record_of(num_layers)
        self._plans: dict[tuple[int, int], LayerPlan] = {}
        self._layouts: dict[int, tuple[Pools, int]] = {}
        self._templates: dict[int, list[int | bytes]] = {}
        self._reads: dict[int, list[tuple[int, int]]] = {}
        self._pages: dict[int, int] | None = None  # object size -> page count

    def token_bytes(self, n: int) -> int:
        """The bytes of ``n`` tokens of one layer's keys (or values)."""
        return n * self.num_kv_heads * self.head_size * self.dtype.itemsize

    def plan(self, layer: int, pages: int) -> LayerPlan:
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
                roles=self.roles,
            )
        return plan

    def layout(self, pages: int) -> tuple[Pools, int]:
        """Where each layer's key and value pools start in an object of ``pages`` pages,
        and the object's size (made once per page count)."""
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

    def template(self, pages: int) -> list[int | bytes]:
        """The object of ``pages`` pages up to its record, as parts: each pool by its
        index (layer 0 key, layer 0 value, layer 1 key, ...), the bytes between two
        pools (descriptors) joined into one, the record's descriptor last."""
        got = self._templates.get(pages)
        if got is None:
            got = []
            for li in range(self.num_layers):
                for part in self.plan(li, pages).parts:
                    if isinstance(part, Placeholder):
                        got.append(len(self.roles) * li + (part.role == "value"))
                    elif got and isinstance(got[-1], bytes):
                        got[-1] += bytes(part)
                    else:
                        got.append(bytes(part))
            if isinstance(got[-1], bytes):
                got[-1] += self.record_descriptor
            else:
                got.append(self.record_descriptor)
            self._templates[pages] = got
        return got

    def parts(self, pages: int, pools: Sequence[Any]) -> list[Any]:
        """The object's parts up to its record, ``pools[i]`` for pool ``i``."""
        return [pools[t] if isinstance(t, int) else t for t in self.template(pages)]

    def pool_offsets(self, pages: int) -> list[int]:
        """Where each pool starts in an object of ``pages`` pages, in pool order."""
        pools, _ = self.layout(pages)
        return [k for k, _ in pools] if self.fused else [off for pair in pools for off in pair]

    def _pairs(self, sums: Sequence[Any]) -> list[Any]:
        """Per-pool checksums as the record keeps them: a key and a value per layer."""
        return [x for s in sums for x in (s, s)] if self.fused else list(sums)

    def record(self, fingerprint: bytes, tokens: int, pages: int, sums: Sequence[int]) -> bytes:
        """The record that closes an object of ``pages`` pages holding ``tokens`` tokens
        whose pools' token bytes hash to ``sums`` (in pool order)."""
        pools, size = self.layout(pages)
        return self.record_of(fingerprint, tokens, size, pools, self._pairs(sums))

    def ranges_of(self, pages: int) -> list[tuple[int, int]]:
        """What a reader of an object of ``pages`` pages takes: each pool's token bytes
        (as many tokens as the pages hold, up to ``max_tokens``), then the record."""
        got = self._reads.get(pages)
        if got is None:
            pools, size = self.layout(pages)
            nb = self.token_bytes(min(pages * self.page_size, self.max_tokens))
            got = self._reads[pages] = [
                *((off, nb) for off in self.pool_offsets(pages)),
                (size - self.record_bytes, self.record_bytes),
            ]
        return got

    def pages_of(self, size: int) -> int | None:
        """The page count of an object of ``size`` bytes (None: no such object)."""
        by_size = self._pages
        if by_size is None:  # made whole, then published: readers take it at once
            by_size = {self.layout(p)[1]: p for p in range(1, self.max_pages + 1)}
            self._pages = by_size
        return by_size.get(size)

    def parse(
        self, record: bytes | bytearray | memoryview, fingerprint: bytes, pages: int
    ) -> tuple[int, list[ChunkLayer]]:
        """The token count and layers of ``record``, read from an object of ``pages``
        pages; FormatError when it is no record of this format and fingerprint, or of
        another object (size, pools, or a token count its pages cannot hold)."""
        tokens, size, layers = parse_chunk_record(
            record, fingerprint, self.num_layers, self.max_tokens, self.token_bytes
        )
        pools, want = self.layout(pages)
        if size != want or [(x.key_pool_offset, x.value_pool_offset) for x in layers] != pools:
            raise FormatError(f"the record describes another object ({size} bytes, not {want})")
        if not (pages - 1) * self.page_size < tokens <= pages * self.page_size:
            raise FormatError(f"{tokens} tokens in a chunk object of {pages} pages")
        return tokens, layers

    def check(
        self,
        record: bytes | bytearray | memoryview,
        fingerprint: bytes,
        tokens: int,
        pages: int,
        sums: Sequence[int | None],
    ) -> str:
        """Why the object read (its ``record``, and ``sums``: the xxh3-64 of each pool's
        first ``tokens`` tokens as read, layer 0 key first) is not the object of
        ``tokens`` tokens in ``pages`` pages under ``fingerprint``; "" when it is. The
        record it should have is made and compared at once; another is parsed, for the
        reason it differs."""
        if None not in sums and record == self.record(fingerprint, tokens, pages, sums):  # type: ignore[arg-type]
            return ""
        sums = self._pairs(sums)
        try:
            got, layers = self.parse(record, fingerprint, pages)
        except FormatError as e:
            return str(e)
        if got != tokens:
            return f"{got} tokens, not {tokens}"
        for li, lay in enumerate(layers):
            if (lay.key_tokens_checksum, lay.value_tokens_checksum) != tuple(
                sums[2 * li : 2 * li + 2]
            ):
                return f"layer {li}: its bytes differ from the record"
        return "the record differs"
