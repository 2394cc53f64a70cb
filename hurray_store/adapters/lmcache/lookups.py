"""The plugin's lookups: how many of LMCache's chunks, from the first, a get will find
(``EnginePort.lookup``, which chooses where to ask), pinned for LMCache's engine when it
asks, by the handles the registry keeps, and the unpins and removes that let them go.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from hurray_store.adapters.lmcache.chunks import Chunk, ChunkRegistry, chunk_name
from hurray_store.engine import EnginePort
from hurray_store.store import KeyRef, Pin


class ChunkLookups:
    """Lookups, pins and removes of one engine's chunks (``chunks``) through ``port``."""

    def __init__(self, port: EnginePort, chunks: ChunkRegistry) -> None:
        self.port, self.chunks = port, chunks
        self._unpin_one = port.release_one

    def count(self, keys: Sequence[Any], pin: bool) -> int:
        """How many of ``keys``, from the first, a get will find (pinned with ``pin``)."""
        if pin:
            return self.pin_prefix(keys)
        # lazy: none past a miss
        return self.port.lookup(map(self.chunks.name, keys), asked=len(keys)).n

    async def count_async(self, keys: Sequence[Any], pin: bool) -> int:
        """``count`` from LMCache's event loop, which it never blocks."""
        if not pin:
            return (await self.port.lookup_async(map(self.chunks.name, keys), asked=len(keys))).n
        found: list[Chunk | KeyRef | None] = []
        drops = self.chunks.drops  # before the names are made
        held = await self.port.lookup_async(self._refs(keys, found), pin=True, asked=len(keys))
        self._hold(keys, found, drops, held.pins)
        return held.n

    def pin_prefix(self, keys: Sequence[Any]) -> int:
        """Pin the chunks of ``keys`` a get will find, from the first to the first miss;
        how many. The chunks' handles go to the port one at a time, as it asks: a new
        prompt's lookup names its first chunk only, so a miss costs one name, not one
        per key."""
        found: list[Chunk | KeyRef | None] = []
        drops = self.chunks.drops  # before the names' ``get``: entries leaving after, seen
        held = self.port.lookup(self._refs(keys, found), pin=True, asked=len(keys))
        self._hold(keys, found, drops, held.pins)
        return held.n

    def _refs(self, keys: Sequence[Any], found: list[Chunk | KeyRef | None]) -> Iterator[KeyRef]:
        """The port's handle on each of ``keys``' chunks, made as the port asks for it
        (any thread), each key's entry in ``chunks`` added to ``found`` (where it has
        none, the handle made for it)."""
        find, prefix = self.chunks.find, self.chunks.prefix
        for k in keys:
            if (c := find(k)) is not None:
                found.append(c)
                yield c.ref
            else:
                ref = self.port.ref(chunk_name(prefix, k))
                found.append(ref)
                yield ref

    def _hold(
        self,
        keys: Sequence[Any],
        found: Sequence[Chunk | KeyRef | None],
        drops: int,
        pins: Sequence[Pin],
    ) -> None:
        """The port pinned the chunks of ``keys``, from the first, for this engine: one
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
        return self.port.delete(name)
