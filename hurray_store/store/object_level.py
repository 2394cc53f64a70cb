"""The object level of a store (``TieredStore``'s calls on keyed objects: ``objects.py``
holds the groups and member lists), and its four pin entry points: ``pin``,
``pin_held``, ``unpin``, ``unpin_one``. The engine port and the LMCache adapters build on
it."""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable, Iterable, Sequence

from hurray_store.store.ledger import Entry, Group, KeyRef, Ledger
from hurray_store.store.objects import Data, ObjectStore
from hurray_store.tiers import Blob, Range, RangeIn

# A pin on an object, as the store gave it: given back to ``unpin``. (The group the
# object was in, or the ledger's entry of the copy a handle pinned; opaque to callers.)
Pin = Group | Entry


class ObjectLevel:
    """Mixed into ``TieredStore``, whose ``objects``, ``ledger`` and ``sync`` these use."""

    objects: ObjectStore
    ledger: Ledger
    # ``unpin`` of one pin, as cheap as a call gets: engines let a lookup's pins go one
    # call per chunk (any thread).
    unpin_one: Callable[[Pin], None]
    sync: Callable[[], Awaitable[None]]  # other processes' changes read first

    async def put_object(self, key: str, data: Data, self_checked: bool = False) -> bool:
        """Store one object (the concatenation of ``data`` when it is a list); False:
        stored nowhere. ``self_checked``: the object carries its own checksums, which
        its reader checks (the store then hashes none of its bytes)."""
        await self.sync()
        return await self.objects.put(key, data, self_checked)

    async def put_objects(self, items: Sequence[tuple[str, Data]]) -> bool:
        """Store several objects as one group, the last written after the others (any of
        them may be a ``SelfChecked`` object, as ``put_object`` takes)."""
        await self.sync()
        return await self.objects.put_many(items)

    async def get_object(self, key: str) -> Blob | None:
        await self.sync()
        return await self.objects.get(key)

    async def get_object_ranges(self, key: str, ranges: Sequence[Range]) -> list[Blob] | None:
        await self.sync()
        return await self.objects.get_ranges(key, ranges)

    async def read_object_into(
        self, key: str, ranges: Sequence[Range], buffers: Sequence[memoryview]
    ) -> bool:
        await self.sync()
        return await self.objects.read_into(key, ranges, buffers)

    def read_objects_into_now(
        self,
        items: Sequence[tuple[str, Sequence[Range], Sequence[memoryview]]],
        each: RangeIn | None = None,
    ) -> list[bool]:
        """``read_object_into`` of each ``(key, ranges, buffers)`` on the calling
        thread, from any thread, with no trip to the store's loop, where the fastest
        tier holding the key reads with blocking calls (a disk tier, a single Redis).
        ``each(j, i, sum)`` runs as soon as range ``i`` of item ``j`` is in, on the thread
        that read it (a large read is shared with the tier's helper threads), with
        ``sum`` the ``checksum`` of its bytes, taken while they were in the CPU's
        cache. Per item, False: not read here; call ``read_object_into`` (which also
        says whether it is a miss). The reads are counted, and their
        objects marked used, at the store's next operation."""
        return self.objects.read_into_now(items, each)

    def held_size(self, key: str) -> int | None:
        """``object_size`` from the ledger alone, from any thread (None: the ledger does
        not know it; on a shared tier ``object_size`` may still find it)."""
        return self.objects.known_size(key)

    async def object_size(self, key: str) -> int | None:
        """The object's size in bytes, from the ledger or else a shared tier; None:
        absent (so ``is not None`` is whether a get will find it)."""
        await self.sync()
        return await self.objects.size(key)

    def held(self, key: str) -> bool:
        """Whether a get finds object ``key`` now, from the ledger alone (any thread)."""
        return self.objects.has(key)

    # The four pin entry points: ``pin``, ``pin_held``, ``unpin``, ``unpin_one``.

    def pin(self, keys: Sequence[str]) -> list[Pin]:
        """Keep these objects from eviction until their pins, returned, are given back
        to ``unpin`` (any thread)."""
        return self.objects.pin(keys)

    def pin_held(self, keys: Iterable[str] | Iterable[KeyRef]) -> Sequence[Pin]:
        """From any thread, from the ledger alone: pin the objects of ``keys`` (names, or
        ``ref``'s handles), from the first, that a get finds now, up to the first it
        does not; their pins, for ``unpin``. No key past that first miss is taken from
        ``keys``. A handle pins the copy it last found with no key looked up, while
        that copy is still there (else it finds its key again)."""
        it = iter(keys)
        first = next(it, None)
        if first is None:
            return []
        rest = itertools.chain((first,), it)
        if isinstance(first, KeyRef):
            return self.objects.pin_held_refs(rest)  # type: ignore[arg-type]
        return self.objects.pin_held(rest)  # type: ignore[arg-type]

    def ref(self, key: str) -> KeyRef:
        """A handle on object ``key`` for ``pin_held``: a caller that pins the same
        objects again and again (an engine's lookups) keeps one per object."""
        return self.objects.ref(key)

    def refresh(self, ref: KeyRef) -> None:
        """Point ``ref`` at the copy of its object a get finds now: after a put of it,
        the first pin by the handle then looks nothing up."""
        self.objects.refresh(ref)

    def unpin(self, pins: Sequence[Pin]) -> None:
        """Let go of pins that ``pin`` or ``pin_held`` gave (any thread). A pin holds the
        group the object was in when pinned: rewritten since, its new bytes were never
        pinned, and the old pin still goes."""
        self.ledger.unpin(pins)

    def touch(self, keys: Sequence[str]) -> None:
        """Count these objects as used now, for eviction (no bytes move)."""
        self.objects.touch(keys)

    async def delete_object(self, key: str, reason: str = "delete") -> None:
        """Delete ``key`` everywhere (its group with it); ``reason``: ``delete``, or
        ``rejected`` when a reader's own check failed (``metrics.MOVE_REASONS``)."""
        await self.sync()
        await self.objects.delete(key, reason)
