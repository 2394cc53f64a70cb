"""Puts on their way into the cache server's store: the in-flight byte budget, where a
put's bytes land, staged segment objects, claims, and the commit of a segment."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from hurray_store.config import ServerConfig
from hurray_store.errors import FormatError
from hurray_store.format import Manifest
from hurray_store.keys import SegmentKey
from hurray_store.server.backing import ServedStore
from hurray_store.server.tenants import Tenant
from hurray_store.store.space import ObjectSpace
from hurray_store.transport import Err

log = logging.getLogger(__name__)
# What the server keeps per object in flight besides its bytes (bookkeeping, buffers):
# counted against max_inflight_put_bytes, so many empty puts are not free.
PER_OBJECT_BYTES = 1024


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


class Landing:
    """Where a put's bytes are received, and the budget they hold: space reserved in
    the store's top tier (the object is then published there without a copy), else a
    resident buffer borrowed from the store's pool."""

    __slots__ = ("budget", "cost", "res", "space", "view", "released")

    def __init__(self, store: ServedStore, budget: PutBudget, nbytes: int, cost: int) -> None:
        self.budget = budget
        self.cost = cost  # what it holds of the budget: its bytes and its overhead
        self.res = store.reserve(nbytes)
        self.space = ObjectSpace(store.buffers, [nbytes], None if self.res is None else [self.res])
        self.view = self.space.views[0]
        self.released = False

    def release(self) -> None:
        """Once no tier write needs the bytes (space a tier published stays there)."""
        if not self.released:
            self.released = True
            self.space.release()
            self.budget.give(self.cost)


@dataclass(eq=False, slots=True)
class Staged:
    objects: dict[str, Landing] = field(default_factory=dict)
    since: float = field(default_factory=time.monotonic)


@dataclass(eq=False, slots=True)
class ClaimSet:
    owner: object  # the connection that claimed
    fut: asyncio.Future[None]
    deadline: float
    left: int


class SegmentDesk:
    """Segments on their way in: staged layer objects until their X_COMMIT, and the
    claims that make a page stored once across clients."""

    def __init__(self, store: ServedStore, cfg: ServerConfig) -> None:
        self.store = store
        self.cfg = cfg
        self.staged: dict[SegmentKey, Staged] = {}  # a segment's staged layer objects
        self.claims: dict[tuple[str, bytes], ClaimSet] = {}  # (namespace, page hash)

    def stage(self, seg: SegmentKey, key: str, landing: Landing) -> None:
        """Hold a segment's layer object until its commit (a second put of it replaces
        the first)."""
        st = self.staged.setdefault(seg, Staged())
        old = st.objects.pop(key, None)
        if old is not None:
            old.release()
        st.objects[key] = landing

    def expire(self, now: float) -> None:
        """Drop staged segments that saw no commit in time, and claims past their deadline."""
        for seg, st in list(self.staged.items()):
            if now - st.since > self.cfg.staging_timeout_s:
                log.warning(
                    "segment %s: %d staged layer objects saw no commit in %.0f s; dropped",
                    seg.hex,
                    len(st.objects),
                    self.cfg.staging_timeout_s,
                )
                self.drop_staged(seg)
        for h, c in list(self.claims.items()):
            if c.deadline <= now:
                self.end_claim(h)

    def clear(self) -> None:
        for seg in list(self.staged):
            self.drop_staged(seg)

    def drop_staged(self, seg: SegmentKey) -> None:
        st = self.staged.pop(seg, None)
        for landing in st.objects.values() if st else ():
            landing.release()

    def end_claim(self, h: tuple[str, bytes]) -> None:
        c = self.claims.pop(h, None)
        if c is not None:
            c.left -= 1
            if c.left <= 0 and not c.fut.done():
                c.fut.set_result(None)

    def end_claims_of(self, owner: object) -> None:
        for h in [h for h, c in self.claims.items() if c.owner is owner]:
            self.end_claim(h)

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
            waits = {
                c.fut
                for (_, hs), m in zip(seqs, matched, strict=True)
                for h in hs[m:]
                if (c := self.claims.get((ns, h))) is not None
                and c.owner is not session
                and c.deadline > now
            }
            if not waits or now >= deadline:
                break
            await asyncio.wait(waits, timeout=max(0.0, deadline - now))
        todo = {
            (ns, h)
            for (_, hs), m in zip(seqs, matched, strict=True)
            for h in hs[m:]
            if (ns, h) not in self.claims
        }
        if todo:
            cs = ClaimSet(
                session,
                asyncio.get_running_loop().create_future(),
                time.monotonic() + self.cfg.claim_timeout_s,
                len(todo),
            )
            for h in todo:
                self.claims[h] = cs
        return matched, manifests

    async def commit(
        self, manifest_key: str, manifest: memoryview, tenant: Tenant
    ) -> tuple[int, str] | None:
        """Store a segment of the tenant from its manifest and staged objects; None when
        stored, else (error code, why)."""
        seg = self.store.key(manifest_key, tenant, write=True).segment
        if seg is None or not seg.is_manifest:
            return (
                Err.REJECTED,
                f"{manifest_key!r} is not a manifest key of this client's namespace "
                f"({tenant.namespace!r})",
            )
        st = self.staged.pop(seg.segment, None)
        landings = st.objects if st else {}
        data = bytes(manifest)

        def release() -> None:
            for landing in landings.values():
                landing.release()

        try:
            m = Manifest.from_bytes(data)  # parsed once: the store checks it, the claims end by it
        except FormatError as e:
            release()
            return Err.REJECTED, str(e)
        try:
            reserved = {k: v.res for k, v in landings.items() if v.res is not None}
            views = {k: v.view for k, v in landings.items()}
            ok = await self.store.commit_segment(
                seg.segment, data, views, tenant, release, reserved, parsed=m
            )
        except FormatError as e:
            return Err.REJECTED, str(e)
        finally:
            for h in (h for sq in m.sequences for h in sq.page_hashes):
                self.end_claim((tenant.namespace, h))
        return None if ok else (Err.NOT_STORED, "no tier of the server took the segment")
