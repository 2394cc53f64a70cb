"""SegmentWriter: how a batch of paged sequences becomes committed segments.

``put``: validate; hash the full pages; ask shared tiers what they hold; wait for
concurrent puts of the same pages (``InflightPages``), so a page is written once; split
what is left into segments (``plan.split_segments``); per segment, lay out its layer
objects and manifest and hand them to ``cascade.put_group`` with ``catalog.add`` as
the commit hook. The layer objects are ``LayerObject``s: a tier builds each one (pages
gathered out of the pool by ``page_io.gather_layer``) when it is ready to write it;
the ``ManifestObject`` comes last, built from the layers' checksums.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from hurray_store.buffers import BufferPool
from hurray_store.errors import PagingError
from hurray_store.format import LayerPlan, Manifest, ManifestLayer, ManifestSeq, plan_layer
from hurray_store.keys import page_hashes, token_array
from hurray_store.page_io import gather_layer
from hurray_store.paging import PagedKVPool, check_tables, compact
from hurray_store.spec import KVSpec
from hurray_store.store.cascade import TierCascade
from hurray_store.store.catalog import SegmentCatalog, depth
from hurray_store.store.plan import segment_id, split_segments
from hurray_store.store.results import PutResult
from hurray_store.store.space import ObjectSpace
from hurray_store.tiers import Buffer, Reservation
from hurray_store.tiers.base import GroupObject


def check_batch(
    pool: PagedKVPool,
    token_ids: Sequence[Sequence[int]],
    block_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int] | None,
) -> list[int]:
    """Each sequence's valid token count, after checking the batch against the pool;
    PagingError names the first thing wrong."""
    if len(token_ids) != len(block_tables):
        raise PagingError(f"{len(token_ids)} token lists but {len(block_tables)} block tables")
    lens = [len(t) for t in token_ids] if seq_lens is None else list(seq_lens)
    if len(lens) != len(token_ids):
        raise PagingError(f"{len(token_ids)} sequences but {len(lens)} seq_lens")
    for s, (seq_toks, n) in enumerate(zip(token_ids, lens, strict=True)):
        if not 0 <= n <= len(seq_toks):
            raise PagingError(f"sequence {s}: seq_len {n} outside [0, {len(seq_toks)} tokens]")
    check_tables(pool, block_tables, lens, full_pages=True)
    return lens


class InflightPages:
    """Pages some put is writing now: a later put of the same pages waits for it, then
    finds them in the index instead of writing them again."""

    def __init__(self) -> None:
        self._futs: dict[bytes, asyncio.Future[None]] = {}

    async def wait_for(self, hashes: Sequence[Sequence[bytes]]) -> None:
        while True:
            waits = {self._futs[h] for hs in hashes for h in hs if h in self._futs}
            if not waits:
                return
            await asyncio.gather(*(asyncio.shield(w) for w in waits), return_exceptions=True)

    @contextmanager
    def claim(self, pages: Sequence[bytes]) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        mine = {h: loop.create_future() for h in pages}
        self._futs.update(mine)
        try:
            yield
        finally:
            for h, fut in mine.items():
                self._futs.pop(h, None)
                fut.set_result(None)


class LayerObject(GroupObject):
    """A segment's layer object, built in its final place (``out``) on first use:
    descriptors, then the pages gathered out of the pool and hashed."""

    __slots__ = ("kv", "idx", "plan", "out", "layer", "built")

    def __init__(
        self,
        key: str,
        kv: torch.Tensor,
        idx: torch.Tensor,
        plan: LayerPlan,
        out: memoryview,
        layer: ManifestLayer,
        reservation: Reservation | None,
    ) -> None:
        super().__init__(key, plan.nbytes, reservation)
        self.kv, self.idx, self.plan, self.out, self.layer = kv, idx, plan, out, layer
        self.built: ManifestLayer | None = None

    def buffers(self) -> Sequence[Buffer]:
        if self.built is None:
            self.plan.write_fixed(self.out)
            obj_sum, kc, vc = gather_layer(self.kv, self.idx, self.plan, self.out)
            self.built = dataclasses.replace(
                self.layer, object_checksum=obj_sum, key_page_checksums=kc, value_page_checksums=vc
            )
        return [self.out]


class ManifestObject(GroupObject):
    """A segment's manifest, the commit point: built from its layers' checksums, so it
    is written after them."""

    __slots__ = ("skeleton", "layers", "manifest", "blob")

    def __init__(self, key: str, skeleton: Manifest, layers: Sequence[LayerObject]) -> None:
        super().__init__(key, skeleton.encoded_size())
        self.skeleton, self.layers = skeleton, layers
        self.manifest: Manifest | None = None
        self.blob: bytes | None = None

    def buffers(self) -> Sequence[Buffer]:
        if self.blob is None:
            built = [lay.built for lay in self.layers]
            if any(b is None for b in built):
                raise RuntimeError("a manifest was asked for before every layer object was built")
            self.manifest = dataclasses.replace(self.skeleton, layers=tuple(built))  # type: ignore[arg-type]
            self.blob = self.manifest.to_bytes()
        return [self.blob]


class SegmentWriter:
    def __init__(
        self,
        cascade: TierCascade,
        catalog: SegmentCatalog,
        buffers: BufferPool,
        *,
        quantization: str | None,
        max_segment_bytes: int,
    ) -> None:
        self.cascade = cascade
        self.catalog = catalog
        self.buffers = buffers
        self.quantization = quantization
        self.max_segment_bytes = max_segment_bytes
        self.inflight = InflightPages()

    async def put(
        self,
        pool: PagedKVPool,
        token_ids: Sequence[Sequence[int]],
        block_tables: Sequence[Sequence[int]],
        seq_lens: Sequence[int] | None,
        salts: Sequence[bytes],
        from_page: Sequence[int] | None = None,
    ) -> PutResult:
        spec = pool.spec
        P = spec.page_size
        lens = check_batch(pool, token_ids, block_tables, seq_lens)
        toks = [token_array(t[: (n // P) * P]) for t, n in zip(token_ids, lens, strict=True)]
        hashes = [
            page_hashes(spec, t, salt=s, quantization=self.quantization)  # type: ignore[arg-type]
            for t, s in zip(toks, salts, strict=True)
        ]
        await self.catalog.discover(spec, hashes, claim=True)
        await self.inflight.wait_for(hashes)
        firsts = []
        already = unreachable = 0
        for s, hs in enumerate(hashes):
            present = self.catalog.contains_many(hs)
            missing = np.flatnonzero(~present)
            firsts.append(int(missing[0]) if missing.size else len(hs))
            already += int(present.sum())
            if from_page is not None and firsts[s] < min(from_page[s], len(hs)):
                # A page the caller left out of the pool is not stored (evicted since
                # it looked): the pages after it could never be reached; none written.
                unreachable += len(hs) - from_page[s]
                firsts[s] = len(hs)
        # A page is written from the pool page of its hash's first use (inside the
        # batch too), so equal content is one page even when the engine did not share it.
        first_use: dict[bytes, tuple[int, int]] = {}
        for s, hs in enumerate(hashes):
            for i in range(firsts[s], len(hs)):
                first_use.setdefault(hs[i], (s, i))
        tiers = self.cascade.tiers
        bytes_per_tier = {t.name: 0 for t in tiers}
        written = nseg = lost = 0
        with self.inflight.claim(list(first_use)):
            page_cost = spec.roles * spec.page_bytes * spec.num_layers
            for seqs in split_segments(hashes, firsts, page_cost, self.max_segment_bytes):
                tables = [
                    [
                        int(block_tables[cs][ci])
                        for cs, ci in (first_use[h] for h in hashes[s][firsts[s] :])
                    ]
                    for s in seqs
                ]
                n, where, total = await self._put_segment(pool, seqs, tables, toks, hashes, firsts)
                written += n if where else 0
                lost += 0 if where else n
                nseg += 1 if n else 0
                for i in where:  # written, or queued for write-through
                    bytes_per_tier[tiers[i].name] += total
        return PutResult(
            sum(len(hs) for hs in hashes), written, already, nseg, bytes_per_tier, unreachable, lost
        )

    async def _put_segment(
        self,
        pool: PagedKVPool,
        seqs: list[int],
        tables: list[list[int]],
        toks: list[np.ndarray],
        hashes: list[list[bytes]],
        firsts: list[int],
    ) -> tuple[int, list[int], int]:
        """One segment: its layer objects, then its manifest. Returns (pages, tiers
        written or queued: none when no tier took it, bytes)."""
        spec = pool.spec
        distinct, compacted, inverse = compact(tables)
        n = int(distinct.numel())
        seq_ptr = torch.tensor(np.cumsum([0] + [len(r) for r in tables]), dtype=torch.long)
        plans = [
            plan_layer(
                li,
                inverse,
                seq_ptr,
                num_pages=n,
                page_size=spec.page_size,
                heads=spec.num_kv_heads,
                dim=spec.head_dim,
                dtype=spec.dtype,
                quantization=self.quantization,
                roles=spec.role_names,
            )
            for li in range(spec.num_layers)
        ]
        seg = self.catalog.key(segment_id([hashes[s][-1] for s in seqs], [firsts[s] for s in seqs]))
        skeleton = _skeleton(
            spec,
            seg.segment_id,
            self.quantization,
            plans,
            [seg.layer(li) for li in range(spec.num_layers)],
            [
                (toks[s], firsts[s], hashes[s][firsts[s] :], compacted[j])
                for j, s in enumerate(seqs)
            ],
            n,
        )
        # Each object is built in its final place: space reserved in the tier the group
        # lands in (the cpu arena: pages go from the pool straight into the tier), else
        # a resident buffer borrowed until every tier write is done.
        sizes = [p.nbytes for p in plans]
        reserved = self.cascade.reserve(sizes, group_bytes=sum(sizes) + skeleton.encoded_size())
        with ObjectSpace(self.buffers, sizes, reserved) as space:
            idx = distinct.to(pool.device)
            layers = [
                LayerObject(
                    seg.layer(li),
                    pool.layers[li],
                    idx,
                    plans[li],
                    space.views[li],
                    skeleton.layers[li],
                    None if reserved is None else reserved[li],
                )
                for li in range(spec.num_layers)
            ]
            manifest = ManifestObject(seg.manifest, skeleton, layers)

            def committed() -> None:
                assert manifest.manifest is not None
                self.catalog.add(manifest.manifest)

            where = await self.cascade.put_group(
                seg,
                [*layers, manifest],
                depth=depth(skeleton),
                on_committed=committed,
                release=space.release,
            )
        return n, where, sum(sizes) + skeleton.encoded_size()


def _skeleton(
    spec: KVSpec,
    seg_id: bytes,
    quantization: str | None,
    plans: list[LayerPlan],
    keys: list[str],
    seqs: list[tuple[np.ndarray, int, Sequence[bytes], Sequence[int]]],
    n: int,
) -> Manifest:
    """The manifest without its checksums: its size is known now, its checksums once
    the layers are built."""
    return Manifest(
        fingerprint=spec.fingerprint(),
        segment_id=seg_id,
        quantization=quantization,
        page_size=spec.page_size,
        num_pages=n,
        page_bytes=plans[0].page_bytes,
        scale_bytes=plans[0].scale_bytes,
        sequences=tuple(
            ManifestSeq(tuple(t.tolist()), first, int(t.size), tuple(hs), tuple(table))
            for t, first, hs, table in seqs
        ),
        layers=tuple(
            ManifestLayer(
                li,
                keys[li],
                p.nbytes,
                0,
                p.key_pool_offset,
                p.value_pool_offset,
                p.key_scales_offset,
                p.value_scales_offset,
                (0,) * n,
                (0,) * n,
            )
            for li, p in enumerate(plans)
        ),
    )
