"""TierCascade: where a group of bytes lives, and how it moves between tiers.

It knows groups, keys and bytes; it knows no manifests, pools or index. Its primitives:

- ``put_group``: the first tier that takes the group (``policy.place``), written whole;
  then ``on_committed()``; then write-through to the lower tiers in the background, with
  backpressure on the bytes queued. A tier never holds part of a group.
- ``read`` / ``get`` / ``get_ranges`` / ``read_into`` / ``size``: from the fastest tier
  whose ledger says READY, then from shared tiers the ledger does not name.
- ``delete``: a key's whole group, everywhere, after the writes under way for it end.
- ``promote`` / ``flush``: copies up after a read, and down in write-back mode.
- ``report_bad`` / ``missing``: a tier's bytes failed verification (quarantined) or
  were not there (the ledger heals).

Every group that leaves the last tier holding it is announced to the listeners
(``subscribe``): the segment catalog drops what no tier holds any more.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar, cast

from hurray_store.metrics import StoreMetrics
from hurray_store.store.copies import BackgroundCopies
from hurray_store.store.ledger import Group, Ledger
from hurray_store.store.policy import Admission, Policy, Victim
from hurray_store.store.reads import TierReads
from hurray_store.tiers import (
    Reservation,
    Reserves,
    SharedTier,
    Tier,
    blob_nbytes,
    host_view,
    tell_others,
)
from hurray_store.tiers.base import GroupObject, StoredObject

log = logging.getLogger(__name__)
T = TypeVar("T")


class TierCascade:
    def __init__(
        self,
        tiers: Sequence[Tier],
        policy: Policy,
        metrics: StoreMetrics,
        *,
        max_pending_bytes: int,
    ) -> None:
        self.tiers = list(tiers)
        # A tier is shared or not by its kind, and the tiers are fixed: asked per
        # ``contains`` from engines' threads, so worked out once.
        self._shared = any(t.offers(SharedTier) for t in self.tiers)
        self.policy = policy
        self.ledger: Ledger = policy.ledger
        self.metrics = metrics
        self.max_pending_bytes = max_pending_bytes
        self._listeners: list[Callable[[Group], None]] = []
        self.copies = BackgroundCopies()  # write-throughs, promotions, flushes under way
        # Writes under way, by (tier, group): a later write of the same group to the same
        # tier waits for the earlier one, so the last put wins everywhere.
        self._writes: dict[tuple[int, Group], asyncio.Event] = {}
        # (tier, group) deleted while a write of it was under way: that write is undone
        # when it ends (and its put goes no further), instead of ending after the delete.
        self._deleted_while_writing: set[tuple[int, Group]] = set()
        self.pending_bytes = 0
        self._pending_cv = asyncio.Condition()
        # The store's loop, once open; the reads ``read_into_now`` made off it, for the
        # loop to count (``drain_reads_now``), and whether the loop was asked to.
        # Reads from the fastest holder, then shared tiers; what a read finds missing
        # or bad leaves the ledger through ``_left``.
        self.reads = TierReads(self.tiers, self.ledger, metrics, self._left, self.copies.spawn)

    def subscribe(self, on_group_left: Callable[[Group], None]) -> None:
        """``on_group_left(group)`` runs when no tier holds ``group`` any more."""
        self._listeners.append(on_group_left)

    @property
    def shared(self) -> bool:
        return self._shared

    def reachable(self, group: Group) -> bool:
        """Some tier holding the group READY is up now (not in an outage)."""
        return any(self.tiers[i].available for i in self.ledger.group_holders(group))

    def holds(self, group: Group) -> bool:
        """Some tier holds the group READY, or a write of it is on its way."""
        return bool(self.ledger.group_holders(group)) or group in self.copies

    # ------------------------------------------------------------------ writes

    async def put_group(
        self,
        group: Group,
        objects: Sequence[GroupObject],
        *,
        depth: int = 0,
        on_committed: Callable[[], None] | None = None,
        release: Callable[[], None] | None = None,
    ) -> list[int]:
        """Write ``objects`` as ``group`` to the first tier that takes them, run
        ``on_committed()``, then write them through to the lower tiers in the
        background.

        Returns the tiers written or queued (empty: stored nowhere). ``release()`` runs
        once no write needs the objects' bytes any more.
        """
        total = sum(o.nbytes for o in objects)
        start = self.policy.place(total)
        top = None
        if start is not None:
            for i in range(start, len(self.tiers)):
                done = await self._write(i, group, objects, depth)
                if done:
                    top = i
                if done is not False:  # written, or deleted meanwhile: nothing more to do
                    break
        if top is None:
            self.metrics.stored_nowhere(group, total)
            if release is not None:
                release()
            return []
        if on_committed is not None:
            on_committed()
        targets = self.policy.write_through_targets(top)
        if not targets:
            if release is not None:
                release()
            return [top]
        async with self._pending_cv:
            await self._pending_cv.wait_for(
                lambda: (
                    self.pending_bytes == 0 or self.pending_bytes + total <= self.max_pending_bytes
                )
            )
            self.pending_bytes += total
        self.copies.started(group)
        # The lower tiers read the top tier's copy when it was built in place: keep it
        # from being evicted (and its space reused) until they have it.
        self.ledger.pin([group])
        self.copies.spawn(self._write_through(group, objects, depth, targets, total, release))
        return [top, *targets]

    async def _write_through(
        self,
        group: Group,
        objects: Sequence[GroupObject],
        depth: int,
        targets: list[int],
        total: int,
        release: Callable[[], None] | None,
    ) -> None:
        try:
            for i in targets:
                await self._write(i, group, objects, depth)
        finally:
            self.ledger.unpin([group])
            if release is not None:
                release()
            self._copy_ended(group)
            async with self._pending_cv:
                self.pending_bytes -= total
                self._pending_cv.notify_all()

    async def _write(
        self, tier: int, group: Group, objects: Sequence[GroupObject], depth: int
    ) -> bool | None:
        """Room by the policy (victims evicted or demoted), then the tier's group write.
        The ledger shows the group READY only once every byte is written. True: written;
        False: not taken; None: deleted while it was being written (so undone)."""
        t = self.tiers[tier]
        c = self.metrics.tiers[t.name]
        if not t.ready:
            c.skipped_writes += 1
            return False
        sizes = {o.key: o.nbytes for o in objects}
        while (earlier := self._writes.get((tier, group))) is not None:
            await earlier.wait()
        adm = self._take_room(tier, group, sizes, depth)
        if not adm.accepted:
            c.skipped_writes += 1
            log.info("tier %s: skipped %s: %s", t.name, group, adm.reason)
            return False
        done = self._writes[(tier, group)] = asyncio.Event()
        ok = False
        try:
            await self._evict(tier, adm.victims)
            with self.metrics.timed(t.name, "put"):
                ok = await t.put_group(objects)
            if not ok and t.out_of_space:
                t.out_of_space = False
                ok = await self._after_full(tier, group, objects, sizes, depth)
            if ok and (tier, group) in self._deleted_while_writing:
                ok = False
                await t.delete_many(list(sizes))
                log.info("tier %s: %s was deleted while being written; undone", t.name, group)
                return None
            if ok:
                c.bytes_written += sum(sizes.values())
                tell_others(t, added=[objects[-1].key])  # its last key: the group is whole
            else:
                c.skipped_writes += 1
            return ok
        finally:
            self._deleted_while_writing.discard((tier, group))
            self.ledger.complete_write(tier, group, ok)
            del self._writes[(tier, group)]
            done.set()

    async def _after_full(
        self,
        tier: int,
        group: Group,
        objects: Sequence[GroupObject],
        sizes: dict[str, int],
        depth: int,
    ) -> bool:
        """The medium filled up before the tier's budget: the budget becomes what the
        tier holds, and the write is tried once more after evicting for it."""
        t = self.tiers[tier]
        budget = self.policy.lower_budget(tier)
        if budget is None:
            return False
        log.warning(
            "tier %s: the medium is full at %d bytes held; that is its budget now", t.name, budget
        )
        self.ledger.complete_write(tier, group, False)
        adm = self._take_room(tier, group, sizes, depth)
        if not adm.accepted:
            return False
        await self._evict(tier, adm.victims, "budget_lowered")
        return await t.put_group(objects)

    def _take_room(self, tier: int, group: Group, sizes: dict[str, int], depth: int) -> Admission:
        """The policy's plan for this write, applied to the ledger in the same hold of
        their lock (no pin taken in between can make a victim of a pinned group)."""
        with self.ledger.lock:
            adm = self.policy.plan_write(tier, group, sizes, depth=depth)
            if adm.accepted:
                self.ledger.take_room(tier, group, sizes, depth, [v.group for v in adm.victims])
        return adm

    async def _evict(self, tier: int, victims: Iterable[Victim], reason: str = "evict") -> None:
        t = self.tiers[tier]
        for v in victims:
            why = reason
            if v.demote_to is not None:
                objs = await self._read_group(tier, v.sizes)
                if objs is not None and await self._write(
                    v.demote_to, v.group, objs, self.ledger.depth(v.group)
                ):
                    why = "demote"
            await t.delete_many(list(v.sizes))
            tell_others(t, removed=list(v.sizes)[:1])
            self.metrics.tiers[t.name].evictions += len(v.sizes)
            self.metrics.moved(why, t.name, v.group, sum(v.sizes.values()))
            self._left(v.group)

    async def _read_group(self, tier: int, sizes: dict[str, int] | Any) -> list[GroupObject] | None:
        t = self.tiers[tier]
        out: list[GroupObject] = []
        for k, n in sizes.items():
            got = await t.get(k)
            if got is None or blob_nbytes(got) != n:
                return None
            out.append(StoredObject(k, [host_view(got)]))
        return out

    async def _copy_group(
        self, group: Group, src: int, targets: Sequence[int], reason: str
    ) -> None:
        try:
            objs = await self._read_group(src, self.ledger.group_keys(src, group))
            if objs is not None:
                nbytes = sum(o.nbytes for o in objs)
                for i in targets:
                    if await self._write(i, group, objs, self.ledger.depth(group)):
                        self.metrics.moved(reason, self.tiers[i].name, group, nbytes)
        finally:
            self._copy_ended(group)

    def promote(self, group: Group, src: int) -> None:
        """Copy a group read whole from ``src`` into the upper tiers the policy names,
        in the background."""
        targets = self.policy.promote_targets(src, group)
        if targets:
            self.copies.started(group)
            self.copies.spawn(self._copy_group(group, src, targets, "promote"))

    async def flush(self) -> None:
        """Wait for write-through and promotions in flight; in write-back mode, move
        groups that only volatile tiers hold down to the first persistent tier."""
        await self.copies.drain()
        for group, src, dst in self.policy.flush_targets():
            self.copies.started(group)
            await self._copy_group(group, src, [dst], "flush")

    def _copy_ended(self, group: Group) -> None:
        self.copies.ended(group)
        self._left(group)  # the put's top tier may have evicted it meanwhile

    def _left(self, group: Group) -> None:
        if not self.holds(group):
            for fn in self._listeners:
                fn(group)

    # ------------------------------------------------------------------ the rest

    async def delete(self, key: str, reason: str = "delete") -> None:
        """Delete ``key`` everywhere, with its whole group (a tier never keeps part of
        one). Write-throughs of it still under way end first: they would put it back.
        ``reason``: ``delete`` (a caller's) or ``quota`` (a tenant's quota)."""
        for g in set(self.ledger.groups_of(key).values()):
            await self.copies.wait(g)
        holders = self.ledger.groups_of(key)  # again: the ledger moved while it waited
        for i, group in holders.items():
            if self.ledger.is_writing(i, group):
                self._deleted_while_writing.add((i, group))  # undone when its write ends
                continue
            sizes = self.ledger.forget(i, group, reason)
            await self.tiers[i].delete_many(list(sizes) or [key])
            tell_others(self.tiers[i], removed=[key])
            self.metrics.moved(reason, self.tiers[i].name, group, sum(sizes.values()))
            self._left(group)
        for i in self.reads.shared_tiers(skip=list(holders)):
            await self.tiers[i].delete(key)

    def reserve(
        self, sizes: Sequence[int], *, group_bytes: int | None = None
    ) -> list[Reservation] | None:
        """Space for new objects of ``sizes`` in the tier their group (of
        ``group_bytes``, default their sum) would go to, to build or receive them in
        place; None: that tier offers none. Space never published goes back with
        ``reservation.tier.unreserve``."""
        top = self.policy.place(sum(sizes) if group_bytes is None else group_bytes)
        if top is None:
            return None
        if not self.tiers[top].offers(Reserves):
            return None
        t = cast(Reserves, self.tiers[top])
        out: list[Reservation] = []
        for size in sizes:
            r = t.reserve(size)
            if r is None:
                for done in out:
                    t.unreserve(done)
                return None
            out.append(r)
        return out

    @contextmanager
    def pinned(self, groups: Sequence[Group]) -> Iterator[None]:
        """Keep ``groups`` from eviction inside the block."""
        self.ledger.pin(groups)
        try:
            yield
        finally:
            self.ledger.unpin(groups)

    def gauges(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for i, t in enumerate(self.tiers):
            cap = self.policy.tiers[i].capacity_bytes
            out[t.name] = {
                "objects": self.ledger.num_objects(i),
                "bytes": self.ledger.used_bytes(i),
                "capacity_bytes": cap,  # type: ignore[dict-item]
            }
        return out
