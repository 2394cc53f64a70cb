"""SegmentReader: how stored pages come back into a pool.

``lookup``: tokens per sequence the index can deliver. ``start`` returns a
``RetrieveRun``: its ``layers()`` yields a ``RetrievedLayer`` as each layer lands in the
pool, and its ``result`` is the ``RetrieveResult``.

A run: hash; discover on shared tiers; match in the index; pin the segments; read and
check their manifests (``catalog.manifest``); plan (``plan.read_plan``); allocate the
pool pages (one per distinct stored page: sharing survives); then per layer, per
segment, read the pages' bytes from the fastest tier holding them (one job read ahead),
verify and scatter them (``page_io.verify_and_scatter``), and on bad bytes report the
tier and try the next one. Sequences are cut at their first page no tier had good;
segments one lower tier served whole are promoted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

import torch

from hurray_store.buffers import BufferPool
from hurray_store.keys import SegmentKey, page_hashes, token_array
from hurray_store.page_io import run_ranges, verify_and_scatter
from hurray_store.paging import PagedKVPool, allocate_shared, release_shared
from hurray_store.spec import KVSpec
from hurray_store.store.cascade import TierCascade
from hurray_store.store.catalog import SegmentCatalog
from hurray_store.store.plan import Match, ReadPlan, SegmentRead, cut_at_bad, read_plan
from hurray_store.store.results import RetrievedLayer, RetrieveResult
from hurray_store.tiers import Blob, blob_nbytes


@dataclass(slots=True)
class _Job:
    """One layer object's pages to load."""

    layer: int
    lay_pos: int  # its position in the manifest's layers
    read: SegmentRead
    seg: SegmentKey
    holders: list[int]  # tiers holding the segment when the run began
    borrowed: list[bytearray] = field(default_factory=list)


@dataclass(slots=True)
class _Got:
    """A tier's bytes of a job (None: a miss there)."""

    tier: int
    parts: list[Blob] | None
    whole: bool


class SegmentReader:
    def __init__(
        self,
        cascade: TierCascade,
        catalog: SegmentCatalog,
        buffers: BufferPool,
        quantization: str | None = None,
    ) -> None:
        self.quantization = quantization  # its pages are hashed in a space of their own
        self.cascade = cascade
        self.catalog = catalog
        self.buffers = buffers

    async def lookup(
        self, spec: KVSpec, token_ids: Sequence[Sequence[int]], salts: Sequence[bytes]
    ) -> list[int]:
        q = self.quantization
        hashes = [
            page_hashes(spec, t, salt=s, quantization=q)
            for t, s in zip(token_ids, salts, strict=True)
        ]
        await self.catalog.discover(spec, hashes, claim=False)
        out = []
        reachable: dict[bytes, bool] = {}
        for hs in hashes:
            mt = self.catalog.longest_prefix(hs)
            # A segment only a tier that is down holds counts for nothing: a lookup never
            # promises what retrieve cannot deliver now.
            n = mt.num_pages
            for j, seg in enumerate(mt.segment_ids):
                if seg not in reachable:
                    reachable[seg] = self.cascade.reachable(self.catalog.key(seg))
                if not reachable[seg]:
                    n = j
                    break
            out.append(n * spec.page_size)
        return out

    def start(
        self,
        pool: PagedKVPool,
        token_ids: Sequence[Sequence[int]],
        salts: Sequence[bytes],
        skip: Sequence[int] | None = None,
    ) -> RetrieveRun:
        return RetrieveRun(self, pool, token_ids, salts, skip)


class RetrieveRun:
    def __init__(
        self,
        reader: SegmentReader,
        pool: PagedKVPool,
        token_ids: Sequence[Sequence[int]],
        salts: Sequence[bytes],
        skip: Sequence[int] | None = None,
    ) -> None:
        self.reader = reader
        self.skip = skip  # per sequence, its leading pages not read (``read_plan``)
        self.cascade = reader.cascade
        self.pool = pool
        self.token_ids = token_ids
        self.salts = salts  # one per sequence
        self.result: RetrieveResult | None = None
        # (tier, segment) whose bytes failed in this run: its other layers skip that tier.
        self._failed: set[tuple[int, bytes]] = set()

    async def layers(self) -> AsyncGenerator[RetrievedLayer, None]:
        """Each layer as it lands in the pool; ``self.result`` is set at the end.
        Closing the iteration early gives every allocated page back to the pool."""
        spec = self.pool.spec
        catalog = self.reader.catalog
        toks = [token_array(t) for t in self.token_ids]
        q = self.reader.quantization
        hashes = [
            page_hashes(spec, t, salt=s, quantization=q)  # type: ignore[arg-type]
            for t, s in zip(toks, self.salts, strict=True)
        ]
        await catalog.discover(spec, hashes, claim=False)
        found = [catalog.longest_prefix(hs) for hs in hashes]
        matches = [Match(mt.segment_ids, mt.seqs.tolist(), mt.pages.tolist()) for mt in found]
        seg_ids = list(dict.fromkeys(s for mt in matches for s in mt.segment_ids))
        with self.cascade.pinned([catalog.key(s) for s in seg_ids]):
            manifests = {s: await catalog.manifest(s, spec) for s in seg_ids}
            plan = read_plan(matches, manifests, toks, spec.page_size, self.skip)
            for seg, why in plan.rejected.items():
                catalog.reject(seg, why)
            load = self._load(plan)
            try:
                async for layer in load:
                    yield layer
            finally:
                await load.aclose()  # an early close gives the pages back now

    async def _load(self, plan: ReadPlan) -> AsyncGenerator[RetrievedLayer, None]:
        pool, spec = self.pool, self.pool.spec
        P = spec.page_size
        new_ids = allocate_shared(pool, plan.tables, plan.num_pages)
        self.cascade.ledger.touch(self.reader.catalog.key(r.segment_id) for r in plan.segments)
        bad: set[int] = set()
        read_bytes = 0
        # Per segment, the tier each layer object was read whole from (None: by ranges).
        whole_from: dict[bytes, set[int | None]] = {}
        jobs = [self._job(li, r) for li in range(spec.num_layers) for r in plan.segments if r.pages]
        ahead: asyncio.Future[_Got | None] | None = None
        k = 0
        try:
            dst = torch.tensor(new_ids, dtype=torch.long, device=pool.device)
            # Read one job ahead: the next layer's bytes arrive (a disk read runs in a
            # thread) while this one is verified and copied.
            ahead = asyncio.ensure_future(self._first_read(jobs[0])) if jobs else None
            for li in range(spec.num_layers):
                while k < len(jobs) and jobs[k].layer == li:
                    job = jobs[k]
                    assert ahead is not None
                    got = await ahead
                    k += 1
                    ahead = (
                        asyncio.ensure_future(self._first_read(jobs[k])) if k < len(jobs) else None
                    )
                    try:
                        nb, whole_tier = await self._load_job(job, dst, bad, got)
                    finally:
                        self._give_back(job)
                    read_bytes += nb
                    whole_from.setdefault(job.read.segment_id, set()).add(whole_tier)
                tables, _ = cut_at_bad(plan.tables, bad)
                yield RetrievedLayer(
                    li, [[new_ids[d] for d in t] for t in tables], [len(t) * P for t in tables]
                )
        except BaseException:
            if ahead is not None:
                ahead.cancel()
                await asyncio.gather(ahead, return_exceptions=True)
                if k < len(jobs):
                    self._give_back(jobs[k])
            release_shared(pool, new_ids, plan.tables)
            raise
        tables, lost = cut_at_bad(plan.tables, bad)
        if lost:
            pool.free([new_ids[d] for d in lost])
        for seg, tiers in whole_from.items():
            src = self.cascade.policy.promote_after_read(tiers)
            if src is not None:
                self.cascade.promote(self.reader.catalog.key(seg), src)
        delivered = len({d for t in tables for d in t} - {plan.skipped})
        out = [[new_ids[d] for d in t] for t in tables]
        self.result = RetrieveResult(
            out,
            [len(t) * P for t in out],
            read_bytes,
            delivered * spec.roles * spec.num_layers * spec.page_bytes,
        )

    def _job(self, li: int, r: SegmentRead) -> _Job:
        seg = self.reader.catalog.key(r.segment_id)
        lay_pos = next(i for i, lay in enumerate(r.manifest.layers) if lay.layer_index == li)
        return _Job(li, lay_pos, r, seg, self.cascade.ledger.group_holders(seg))

    def _give_back(self, job: _Job) -> None:
        for b in job.borrowed:
            self.reader.buffers.release(b)
        job.borrowed.clear()

    async def _read(self, job: _Job, tier: int) -> _Got:
        """One tier's bytes of the job's pages (or the whole object, when the policy
        says so). A tier that copies reads into a borrowed resident buffer."""
        c = self.cascade
        t = c.tiers[tier]
        m = job.read.manifest
        key = m.layers[job.lay_pos].key
        whole = c.policy.read_whole(
            tier, job.seg, every_page=job.read.every_page, on_device=t.caps.on_device
        )
        with c.metrics.timed(t.name, "get_ranges"):
            if whole:
                blob = await t.get(key)
                return _Got(tier, None if blob is None else [blob], True)
            ranges = run_ranges(m, job.lay_pos, job.read.runs)
            into = None
            if not t.caps.trusted:
                into = self.reader.buffers.acquire(sum(ln for _, ln in ranges))
                job.borrowed.append(into)
            return _Got(tier, await t.get_ranges(key, ranges, into), False)

    def _tiers(self, job: _Job) -> list[int]:
        return [t for t in job.holders if (t, job.read.segment_id) not in self._failed]

    async def _first_read(self, job: _Job) -> _Got | None:
        tiers = self._tiers(job)
        return await self._read(job, tiers[0]) if tiers else None

    async def _load_job(
        self, job: _Job, dst: torch.Tensor, bad: set[int], got: _Got | None
    ) -> tuple[int, int | None]:
        """Verify and copy a job's pages into the pool from the fastest tier with good
        bytes (``got``: the first holder's, read ahead). A tier whose bytes fail is
        reported (quarantined) and the next is tried; pages no tier has good go into
        ``bad``. Returns (bytes read, the tier when the object was read whole)."""
        c = self.cascade
        r = job.read
        m = r.manifest
        key = m.layers[job.lay_pos].key
        rows = dst[r.dest]
        nread = 0
        failed: list[int] | None = None  # of the last tier whose bytes are in the pool
        for tier in self._tiers(job):
            if got is None or got.tier != tier:
                got = await self._read(job, tier)
            parts, whole = got.parts, got.whole
            got = None
            if parts is None:
                c.reads.missing(tier, key)
                continue
            n = sum(blob_nbytes(p) for p in parts)
            nread += n
            c.reads.hit(tier, n)
            check = c.policy.verify_reads(tier)
            result = verify_and_scatter(
                self.pool.layers[job.layer],
                self.pool.spec,
                m,
                job.lay_pos,
                r.runs,
                parts,
                rows,
                whole=whole,
                check=check,
            )
            if result is None or result:
                what = "object size" if result is None else f"{len(result)} page checksum(s)"
                c.reads.report_bad(tier, job.seg, key, f"layer {job.layer}: {what} differ")
                self._failed.add((tier, r.segment_id))
                if result is not None:
                    failed = result
                continue
            return nread, (tier if whole else None)
        # No tier had every page good: the pool holds the last tier's bytes (or none);
        # its failed pages, or all, are misses.
        bad.update(r.dest if failed is None else (r.dest[j] for j in failed))
        return nread, None
