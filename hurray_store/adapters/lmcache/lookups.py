"""The plugin's lookups: how many of LMCache's chunks, from the first, a get will find,
pinned for LMCache's engine when it asks, and the unpins and removes that let them go.

Without a shared tier the ledger is read on the calling thread, with no trip to the
store's loop; pins are taken there too, from the ledger, in one step under its lock. A
cache server shared with other engines is asked on the store's loop when the ledger says
no, as LMCache's remote backend asks. Either way, what other processes sharing the
store's disk folder changed is read first (``sync_others``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any

from hurray_store.adapters.lmcache.chunks import Chunk, ChunkRegistry, chunk_name
from hurray_store.adapters.store_thread import StoreThread, held_prefix, pin_held_prefix
from hurray_store.store import KeyRef, Pin, TieredStore


class ChunkLookups:
    """Lookups, pins and removes of one engine's chunks (``chunks``) in ``store``."""

    def __init__(self, store: TieredStore, runner: StoreThread, chunks: ChunkRegistry) -> None:
        self.store, self.runner, self.chunks = store, runner, chunks
        self._unpin_one = store.unpin_one

    def sync_others(self) -> None:
        """Before the ledger is read on this thread: what other processes sharing a
        tier's medium (a disk folder) committed or removed since the store last read
        their changes, read on the store's loop, as each of the store's own operations
        does first. Asking costs one ``fstat`` a disk tier; the trip to the loop is made
        only when there is something to read."""
        if self.store.others_changed():
            self.runner.call(self.store.sync())

    def will_find(self, name: str) -> bool:
        """A get of chunk ``name`` will find it: the ledger says so, or a shared tier."""
        return self.store.has_object(name) or (
            self.store.shared and self.runner.call(self.store.contains_object(name))
        )

    def count(self, keys: Sequence[Any], pin: bool) -> int:
        """How many of ``keys``, from the first, a get will find (pinned with ``pin``),
        once the store has read the others' changes."""
        if pin:
            return self.pin_prefix(keys)
        n = 0
        for key in keys:
            if not self.will_find(self.chunks.name(key)):
                break
            n += 1
        return n

    async def count_async(self, keys: Sequence[Any], pin: bool) -> int:
        """``count`` from LMCache's event loop. With no shared tier, as ``count``, here
        (the ledger and the pins need no trip to the store's loop); with one, one task on
        the store's loop, which asks the shared tier about all of them at once."""
        if not self.store.shared:
            if self.store.others_changed():  # as ``sync_others``, without blocking this loop
                await asyncio.wrap_future(self.runner.submit(self.store.sync()))
            return self.count(keys, pin)
        if not pin:
            names = map(self.chunks.name, keys)  # lazy, as with ``pin``
            return await asyncio.wrap_future(self.runner.submit(held_prefix(self.store, names)))
        found: list[Chunk | KeyRef | None] = []
        drops, lazy = self.chunks.drops, self._names(keys, found)  # made on the store's loop
        pins = await asyncio.wrap_future(self.runner.submit(pin_held_prefix(self.store, lazy)))
        self._hold(keys, found, drops, pins)
        return len(pins)

    def pin_prefix(self, keys: Sequence[Any]) -> int:
        """Pin the chunks of ``keys`` a get will find, from the first to the first miss;
        how many. The chunks' handles go to the store one at a time, as it asks (by
        name on the store's loop with a shared tier): a new prompt's lookup names its
        first chunk only, so a miss costs one name, not one per key."""
        found: list[Chunk | KeyRef | None] = []
        drops = self.chunks.drops  # before the names' ``get``: entries leaving after, seen
        pins: Sequence[Pin]
        if self.store.shared:  # asked on the store's loop, by name
            pins = self.runner.pin_prefix(self._names(keys, found))
        else:
            pins = self.store.pin_held_refs(self._names(keys, found, refs=True))
        self._hold(keys, found, drops, pins)
        return len(pins)

    def _names(
        self,
        keys: Sequence[Any],
        found: list[Chunk | KeyRef | None],
        refs: bool = False,
    ) -> Iterator[Any]:
        """The store's name of each of ``keys`` (with ``refs``, its handle), made as
        the store asks for it (any thread), each key's entry in ``chunks`` added to
        ``found`` (where it has none, the handle made for it, or None)."""
        find, prefix = self.chunks.find, self.chunks.prefix
        for k in keys:
            if (c := find(k)) is not None:
                found.append(c)
                yield c.ref if refs else c.name
            else:
                name = chunk_name(prefix, k)
                ref = self.store.object_ref(name) if refs else None
                found.append(ref)
                yield ref if ref is not None else name

    def _hold(
        self,
        keys: Sequence[Any],
        found: Sequence[Chunk | KeyRef | None],
        drops: int,
        pins: Sequence[Pin],
    ) -> None:
        """The store pinned the chunks of ``keys``, from the first, for this engine: one
        pin more each, in its entry of ``found`` (made where there was none, with the
        handle the pin was taken by) while ``chunks.drops`` is still ``drops``; else in the
        entry found or made again."""
        with self.chunks.lock:
            for k, c, pin in zip(keys, found, pins, strict=False):
                # ``drops`` again each time: making an entry may drop others
                if c.__class__ is not Chunk or self.chunks.drops != drops:
                    c = self.chunks.entry(k, c if isinstance(c, KeyRef) else None)
                c.append(pin)

    def unpin(self, key: Any) -> bool:
        """Let one pin of a chunk go, here on the caller's thread (LMCache lets a
        lookup's chunks go one call per chunk), with no lock (see ``chunks.py``)."""
        c = self.chunks.find(key)
        if c is None:
            return False
        try:
            self._unpin_one(c.pop())
        except IndexError:
            return False
        return True

    def remove(self, key: Any, force: bool) -> bool:
        """Delete a chunk; a pinned one only with ``force``, its pins let go with it
        (else a chunk put again under the key would stay pinned)."""
        with self.chunks.lock:
            c = self.chunks.find(key)
            if c is not None and c and not force:
                return False
            self.chunks.remove(key)
        name = c.name if c is not None else chunk_name(self.chunks.prefix, key)
        while c is not None:  # pin by pin: an unpin may be popping from the same list
            try:
                self._unpin_one(c.pop())
            except IndexError:
                break
        return self.runner.call(self._remove(name))

    async def _remove(self, name: str) -> bool:
        had = await self.store.contains_object(name)
        await self.store.delete_object(name)
        return had
