"""Puts on their way into the cache server's store: the in-flight byte budget, where a
put's bytes land, staged segment objects, claims, and the commit of a segment."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TypeVar

from hurray_store.config import ServerConfig
from hurray_store.errors import FormatError
from hurray_store.format import Manifest
from hurray_store.keys import SegmentKey
from hurray_store.server.access import authorize
from hurray_store.server.backing import SEQS_PER_STEP, ServedStore
from hurray_store.server.tenants import Tenant
from hurray_store.store.space import ObjectSpace
from hurray_store.transport import Err

log = logging.getLogger(__name__)
K = TypeVar("K")
# What the server keeps per object in flight besides its bytes (its buffer, the put's
# state, the staged entry), with a margin: tests/test_server_hostile.py checks that an
# empty staged object costs no more. Counted against max_inflight_put_bytes and the
# tenant's quota, so many empty puts are not free.
PER_OBJECT_BYTES = 2048
# Manifests larger than this are parsed in a worker thread.
_PARSE_ON_LOOP_BYTES = 256 << 10


def _count_down(counts: dict[K, int], key: K) -> None:
    """One fewer for ``key``; gone at zero (the counts hold live claims only)."""
    n = counts[key] - 1
    if n:
        counts[key] = n
    else:
        del counts[key]


def manifest_limit(staged_bytes: int) -> int:
    """The largest manifest accepted for a segment whose staged layer objects hold
    ``staged_bytes``: 1 MiB (a long prompt's token ids for a small segment), or 16
    bytes for each staged byte (a manifest's page entries are a few dozen bytes per
    page, a page is kilobytes of every layer)."""
    return max(1 << 20, 16 * staged_bytes)


class PutBudget:
    """Bytes of puts in flight (received or staged), at most ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._cv = asyncio.Condition()
        self._wakes: set[asyncio.Task[None]] = set()

    async def take(self, n: int, timeout: float) -> bool:
        async with self._cv:
            try:
                async with asyncio.timeout(timeout):
                    await self._cv.wait_for(lambda: self.used + n <= self.limit)
            except TimeoutError:
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        self.used -= n
        task = asyncio.ensure_future(self._wake())
        self._wakes.add(task)  # owned until done: no task is left unreferenced
        task.add_done_callback(self._wakes.discard)

    async def _wake(self) -> None:
        async with self._cv:
            self._cv.notify_all()


class PutBuffer:
    """Where a put's bytes are received, and the budget they hold: space reserved in
    the store's top tier (the object is then published there without a copy), else a
    resident buffer borrowed from the store's pool."""

    __slots__ = ("budget", "cost", "res", "space", "view", "released", "tenant")

    def __init__(
        self, store: ServedStore, budget: PutBudget, nbytes: int, cost: int, tenant: Tenant
    ) -> None:
        self.budget = budget
        self.cost = cost  # what it holds of the budget and of the tenant's staging
        self.tenant = tenant
        tenant.staged += cost
        self.res = store.reserve(nbytes)
        self.space = ObjectSpace(store.buffers, [nbytes], None if self.res is None else [self.res])
        self.view = self.space.views[0]
        self.released = False

    def grow(self, k: int) -> None:
        """``k`` more bytes received (taken from the budget, room made under the
        tenant's quota): counted in its staging until released."""
        self.cost += k
        self.tenant.staged += k

    def release(self) -> None:
        """Once no tier write needs the bytes (space a tier published stays there)."""
        if not self.released:
            self.released = True
            self.space.release()
            self.budget.give(self.cost)
            self.tenant.staged -= self.cost


@dataclass(eq=False, slots=True)
class Staged:
    objects: dict[str, PutBuffer] = field(default_factory=dict)
    since: float = field(default_factory=time.monotonic)


@dataclass(eq=False, slots=True)
class ClaimSet:
    """The pages one claiming lookup reserved for its connection."""

    owner: object  # the connection that claimed
    namespace: str
    fut: asyncio.Future[None]  # done when the last of them ends
    deadline: float
    pages: list[tuple[str, bytes]]  # (namespace, page hash); emptied once all ended
    left: int


class SegmentStaging:
    """Segments on their way in: staged layer objects until their X_COMMIT, and the
    claims that make a page stored once across clients.

    Claims are bounded: a connection holds at most ``max_claims_per_connection`` pages
    claimed, a tenant at most ``max_claims_per_tenant`` (a lookup past either claims
    what fits, leading pages first; the rest are answered but not claimed, so another
    client may write them too). Claims expire oldest first, in O(expired)."""

    def __init__(self, store: ServedStore, cfg: ServerConfig) -> None:
        self.store = store
        self.cfg = cfg
        # A segment's staged layer objects, oldest first (a segment keeps its place).
        self.staged: dict[SegmentKey, Staged] = {}
        self.claims: dict[tuple[str, bytes], ClaimSet] = {}  # (namespace, page hash)
        self._claim_order: deque[ClaimSet] = deque()  # by deadline (one timeout for all)
        self._claims_of: dict[object, set[ClaimSet]] = {}  # live claim sets per connection
        self.claimed_by_owner: dict[object, int] = {}
        self.claimed_by_namespace: dict[str, int] = {}

    def stage(self, seg: SegmentKey, key: str, buffer: PutBuffer) -> None:
        """Hold a segment's layer object until its commit (a second put of it replaces
        the first)."""
        st = self.staged.setdefault(seg, Staged())
        old = st.objects.pop(key, None)
        if old is not None:
            old.release()
        st.objects[key] = buffer

    def expire(self, now: float) -> None:
        """Drop staged segments that saw no commit in time, and claims past their
        deadline; both oldest first, stopping at the first that is still in time."""
        while self.staged:
            seg, st = next(iter(self.staged.items()))
            if now - st.since <= self.cfg.staging_timeout_s:
                break
            log.warning(
                "segment %s: %d staged layer objects saw no commit in %.0f s; dropped",
                seg.hex,
                len(st.objects),
                self.cfg.staging_timeout_s,
            )
            self.drop_staged(seg)
        while self._claim_order and self._claim_order[0].deadline <= now:
            self._end_set(self._claim_order.popleft())

    def clear(self) -> None:
        for seg in list(self.staged):
            self.drop_staged(seg)

    def drop_staged(self, seg: SegmentKey) -> None:
        st = self.staged.pop(seg, None)
        for buffer in st.objects.values() if st else ():
            buffer.release()

    def end_claim(self, h: tuple[str, bytes]) -> None:
        c = self.claims.pop(h, None)
        if c is None:
            return
        c.left -= 1
        _count_down(self.claimed_by_owner, c.owner)
        _count_down(self.claimed_by_namespace, c.namespace)
        if c.left <= 0:
            c.pages = []
            sets = self._claims_of.get(c.owner)
            if sets is not None:
                sets.discard(c)
                if not sets:
                    del self._claims_of[c.owner]
            if not c.fut.done():
                c.fut.set_result(None)

    def _end_set(self, c: ClaimSet) -> None:
        for h in c.pages:
            if self.claims.get(h) is c:
                self.end_claim(h)

    def end_claims_of(self, owner: object) -> None:
        for c in list(self._claims_of.get(owner, ())):
            self._end_set(c)

    async def lookup(
        self,
        session: object,
        claim: bool,
        wait_s: float,
        seqs: list[tuple[int, list[bytes]]],
        max_bytes: int,
        tenant: Tenant,
    ) -> tuple[list[int], list[bytes]]:
        """Matched pages and manifests of the tenant's namespace; with ``claim``, first
        wait (at most ``wait_s``) for pages other connections of the namespace claimed,
        then claim what is still missing."""
        ns = tenant.namespace
        deadline = time.monotonic() + min(wait_s, self.cfg.request_timeout_s)
        while True:
            matched, manifests = await self.store.find_segments(seqs, max_bytes, tenant)
            if not claim:
                return matched, manifests
            now = time.monotonic()
            waits: set[asyncio.Future[None]] = set()
            for i, ((_, hs), m) in enumerate(zip(seqs, matched, strict=True)):
                if i and not i % SEQS_PER_STEP:
                    await asyncio.sleep(0)  # other requests in between
                for h in hs[m:]:
                    c = self.claims.get((ns, h))
                    if c is not None and c.owner is not session and c.deadline > now:
                        waits.add(c.fut)
            if not waits or now >= deadline:
                break
            await asyncio.wait(waits, timeout=max(0.0, deadline - now))
        room = min(
            self.cfg.max_claims_per_connection - self.claimed_by_owner.get(session, 0),
            self.cfg.max_claims_per_tenant - self.claimed_by_namespace.get(ns, 0),
        )
        todo: dict[tuple[str, bytes], None] = {}  # leading pages first
        for (_, hs), m in zip(seqs, matched, strict=True):
            if len(todo) >= room:
                break
            for h in hs[m:]:
                if len(todo) >= room:
                    break
                if (ns, h) not in self.claims:
                    todo[(ns, h)] = None
        if todo:
            cs = ClaimSet(
                session,
                ns,
                asyncio.get_running_loop().create_future(),
                time.monotonic() + self.cfg.claim_timeout_s,
                list(todo),
                len(todo),
            )
            for page in todo:
                self.claims[page] = cs
            self._claim_order.append(cs)
            self._claims_of.setdefault(session, set()).add(cs)
            self.claimed_by_owner[session] = self.claimed_by_owner.get(session, 0) + len(todo)
            self.claimed_by_namespace[ns] = self.claimed_by_namespace.get(ns, 0) + len(todo)
        return matched, manifests

    async def commit(
        self, manifest_key: str, manifest: memoryview, tenant: Tenant
    ) -> tuple[int, str] | None:
        """Store a segment of the tenant from its manifest and staged objects; None when
        stored, else (error code, why)."""
        d = authorize(tenant, "commit", manifest_key, self.store.namespaces)
        seg = d.key.segment if d.key is not None else None
        if not d.allowed or seg is None:
            return Err.REJECTED, d.why
        st = self.staged.pop(seg.segment, None)
        if st is None or not st.objects:
            return (
                Err.REJECTED,
                f"segment {seg.segment.hex}: no staged layer objects to commit (send them "
                "with TENSOR_PUT first; staged objects wait staging_timeout_s)",
            )
        buffers = st.objects

        def release() -> None:
            for buffer in buffers.values():
                buffer.release()

        # A manifest describes its staged objects: checked against them before it is
        # parsed (a parse costs ~15x its size in memory and time on the loop).
        staged = sum(v.view.nbytes for v in buffers.values())
        limit = manifest_limit(staged)
        if manifest.nbytes > limit:
            release()
            return (
                Err.REJECTED,
                f"a manifest of {manifest.nbytes} bytes for {staged} bytes of staged layer "
                f"objects; at most {limit}",
            )
        data = bytes(manifest)
        try:
            # Parsed once: the store checks it, the claims end by it. A large one is
            # parsed off the loop, which serves the other connections meanwhile.
            if len(data) > _PARSE_ON_LOOP_BYTES:
                m = await asyncio.to_thread(Manifest.from_bytes, data)
            else:
                m = Manifest.from_bytes(data)
        except FormatError as e:
            release()
            return Err.REJECTED, str(e)
        try:
            reserved = {k: v.res for k, v in buffers.items() if v.res is not None}
            views = {k: v.view for k, v in buffers.items()}
            ok = await self.store.commit_segment(
                seg.segment, data, views, tenant, release, reserved, parsed=m
            )
        except FormatError as e:
            return Err.REJECTED, str(e)
        finally:
            for h in (h for sq in m.sequences for h in sq.page_hashes):
                self.end_claim((tenant.namespace, h))
        return None if ok else (Err.NOT_STORED, "no tier of the server took the segment")
