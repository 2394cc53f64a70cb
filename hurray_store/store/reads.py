"""TierReads: a stored key read from the fastest tier whose ledger says READY (a tier
that lost it is a miss there: on to the next), then from shared tiers the ledger does
not name; on the store's loop, or on the calling thread where that tier reads with
blocking calls (``read_into_now``). What a read finds missing leaves the ledger there
(the ledger heals); what fails verification is quarantined (``report_bad``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from typing import Any, TypeVar, cast

from hurray_store.metrics import StoreMetrics
from hurray_store.store.ledger import Group, Ledger
from hurray_store.tiers import (
    Blob,
    NowRead,
    Range,
    RangeIn,
    ReadsNow,
    SharedTier,
    Tier,
    Unhashed,
    blob_nbytes,
    host_view,
    tell_others,
)
from hurray_store.tiers.types import ReadInto

log = logging.getLogger(__name__)
T = TypeVar("T")
# Reads made off the loop reach the ledger at the loop's next operation, or when this
# many wait (the loop is then woken for them).
_READS_NOW_UNTOLD = 32


class TierReads:
    """The cascade's reads over ``tiers``. ``left(group)``: a group left a tier (the
    cascade tells its listeners when it left the last); ``spawn(coro)``: run in the
    background, waited for by the cascade's ``flush``."""

    def __init__(
        self,
        tiers: list[Tier],
        ledger: Ledger,
        metrics: StoreMetrics,
        left: Callable[[Group], None],
        spawn: Callable[[Awaitable[Any]], None],
    ) -> None:
        self.tiers, self.ledger, self.metrics = tiers, ledger, metrics
        self._left, self._spawn = left, spawn
        self.loop: asyncio.AbstractEventLoop | None = None  # the store's, once open
        self._reads_now: deque[tuple[int, list[tuple[str, int]], float]] = deque()
        self._drain_asked = False
        # The tiers' capabilities, fixed with the tiers, asked per read from any thread.
        self._shared = [i for i, t in enumerate(tiers) if t.offers(SharedTier)]
        self._now = [cast(ReadsNow, t) if t.offers(ReadsNow) else None for t in tiers]

    async def read(
        self,
        key: str,
        op: str,
        read: Callable[[Tier, str], Awaitable[T | None]],
        nbytes: Callable[[Any], int],
    ) -> T | None:
        """``read`` a stored key from the fastest tier holding it READY (a tier that
        lost it is a miss there: on to the next), then from shared tiers the ledger does
        not name (other engines write to them)."""
        holders = self.ledger.holders(key)
        for i in holders:
            with self.metrics.timed(self.tiers[i].name, op):
                got = await read(self.tiers[i], key)
            if got is None:
                self.missing(i, key)
                continue
            if (
                op == "get"
                and self.tiers[i].caps.persistent
                and nbytes(got) != self.ledger.size_in(i, key)
            ):
                # Another process replaced it with an object of another size: not what
                # the ledger knows (the journal brings the new one).
                log.info(
                    "tier %s: %s is not the size the ledger says; a miss", self.tiers[i].name, key
                )
                self.missing(i, key)
                continue
            self.hit(i, nbytes(got))
            self.ledger.touch([self.ledger.group_of(i, key) or key])
            return got
        for i in self.shared_tiers(skip=holders):
            with self.metrics.timed(self.tiers[i].name, op):
                got = await read(self.tiers[i], key)
            if got is not None:
                self.hit(i, nbytes(got))
                return got
            self.metrics.tiers[self.tiers[i].name].misses += 1
        return None

    def shared_tiers(self, skip: Sequence[int] = ()) -> list[int]:
        """Shared tiers a call would reach now."""
        return [i for i in self._shared if self.tiers[i].ready and i not in skip]

    async def get(self, key: str) -> Blob | None:
        got: Blob | None = await self.read(key, "get", lambda t, k: t.get(k), blob_nbytes)
        return got

    async def get_ranges(
        self, key: str, ranges: Sequence[Range], into: ReadInto = None
    ) -> list[Blob] | None:
        """Views of the tier's bytes (valid while the key's group is pinned) or of
        ``into``."""
        return await self.read(
            key,
            "get_ranges",
            lambda t, k: t.get_ranges(k, ranges, into),
            lambda parts: sum(blob_nbytes(b) for b in parts),
        )

    async def read_into(
        self, key: str, ranges: Sequence[Range], buffers: Sequence[memoryview]
    ) -> bool:
        """Fill ``buffers[i]`` with range ``i`` of ``key``; False: a miss."""
        got = await self.get_ranges(key, ranges, list(buffers))
        if got is None:
            return False
        for dst, src in zip(buffers, got, strict=True):
            if src is not dst:  # a tier that did not read into the buffers
                dst[:] = host_view(src)
        return True

    def read_into_now(
        self,
        items: Sequence[tuple[str, Sequence[Range], Sequence[memoryview]]],
        each: RangeIn | None = None,
    ) -> list[bool]:
        """``read_into`` of each ``(key, ranges, buffers)`` on the calling thread, from
        any thread, where the fastest tier holding the key reads with blocking calls
        (a disk tier, a single Redis): no trip to the store's loop and no pin;
        ``each(j, i, sum)`` runs once range ``i`` of item ``j`` is in (see
        ``Tier.read_into_now``). Per item, False: not read here; ``read_into`` on the
        loop decides (another tier first, a miss, the ledger to heal). The hits, their
        time and their recency reach the ledger on the loop, at its next operation
        (``drain_reads_now``)."""
        out = [False] * len(items)
        if self.loop is None:
            return out
        by_tier: dict[int, list[tuple[int, int]]] = {}  # tier -> (item, size)
        for j, (key, _, _) in enumerate(items):
            try:
                # The ledger is the loop's: read them, never change them, from here. A
                # change under way shows as a KeyError or RuntimeError: the loop reads.
                holders = self.ledger.holders(key)
                if holders and self._now[holders[0]] is not None:
                    size = self.ledger.size_in(holders[0], key)
                    if size is not None:
                        by_tier.setdefault(holders[0], []).append((j, size))
            except (KeyError, RuntimeError):
                pass
        for i, js in by_tier.items():
            reads = [NowRead(items[j][0], items[j][1], items[j][2], n) for j, n in js]
            t0 = time.perf_counter()
            now = self._now[i]
            assert now is not None
            got = now.read_into_now(reads, _renumbered(each, [j for j, _ in js]))
            done = []
            for (j, _), r, ok in zip(js, reads, got, strict=True):
                if ok:
                    out[j] = True
                    done.append((r.key, sum(ln for _, ln in r.ranges)))
            self._reads_now.append((i, done, time.perf_counter() - t0))
        if len(self._reads_now) >= _READS_NOW_UNTOLD and not self._drain_asked:
            self._drain_asked = True
            with suppress(RuntimeError):  # the loop is closed: the store is closing
                self.loop.call_soon_threadsafe(self.drain_reads_now)
        return out

    def drain_reads_now(self) -> None:
        """On the loop: count the reads ``read_into_now`` made, and mark their groups
        used now (the eviction order), before the operation that calls it."""
        self._drain_asked = False
        while self._reads_now:
            tier, done, seconds = self._reads_now.popleft()
            self.metrics.observe(self.tiers[tier].name, "read_now", seconds)
            for key, nbytes in done:
                self.hit(tier, nbytes)
                if (group := self.ledger.group_of(tier, key)) is not None:
                    self.ledger.touch([group])

    async def size(self, key: str) -> int | None:
        """Size of a stored key from the ledger, else from a shared tier; None: absent."""
        n = self.ledger.key_size(key)
        if n is not None:
            return n
        for i in self.shared_tiers():
            n = (await self.tiers[i].sizes([key]))[0]
            if n is not None:
                return n
        return None

    def hit(self, tier: int, nbytes: int) -> None:
        c = self.metrics.tiers[self.tiers[tier].name]
        c.hits += 1
        c.bytes_read += nbytes

    def missing(self, tier: int, key: str) -> None:
        """A tier the ledger says holds ``key`` READY does not have it (expired, evicted
        by Redis, deleted by hand): its group leaves the ledger there, unless the tier
        is down (then nothing is known)."""
        self.metrics.tiers[self.tiers[tier].name].misses += 1
        if self.tiers[tier].available:
            self.lost(tier, key)

    def lost(self, tier: int, key: str, reason: str = "lost") -> None:
        """``key`` is gone from ``tier`` (another process removed it: ``other_process``,
        or a read found it missing): its group leaves the ledger there, unless this store
        is writing it."""
        group = self.ledger.group_of(tier, key)
        if group is not None and not self.ledger.is_writing(tier, group):
            sizes = self.ledger.forget(tier, group, reason)
            self.metrics.moved(reason, self.tiers[tier].name, group, sum(sizes.values()))
            self._left(group)

    def report_bad(self, tier: int, group: Group, key: str, why: str) -> None:
        """``key`` in ``tier`` failed verification: quarantine it, delete the rest of
        its group there, count it."""
        t = self.tiers[tier]
        self.metrics.tiers[t.name].verification_failures += 1
        log.warning(
            "tier %s: %s failed verification (%s); quarantined, treated as a miss", t.name, key, why
        )
        sizes = self.ledger.forget(tier, group, "quarantine")
        self.metrics.moved("quarantine", t.name, group, sum(sizes.values()))
        self._spawn(self._quarantine(tier, key, [k for k in sizes if k != key]))
        self._left(group)

    async def _quarantine(self, tier: int, key: str, others: list[str]) -> None:
        t = self.tiers[tier]
        await t.quarantine(key)
        tell_others(t, removed=[key])
        if others:
            await t.delete_many(others)


def _renumbered(each: RangeIn | None, items: list[int]) -> RangeIn | None:
    """``each`` for a tier's share of the items: its read ``j`` is item ``items[j]``."""
    if each is None:
        return None
    if isinstance(each, Unhashed):
        f = each.arrived
        return Unhashed(lambda j, i: f(items[j], i))
    return lambda j, i, s: each(items[j], i, s)
