"""The chunks one LMCache engine named lately, and the store's pins it holds on them:
the plugin's registry (``ChunkRegistry``), with one lookup (``find``) by LMCache's key.

Each entry keeps a chunk's name in the store, the store's handle on it (which a lookup
pins by: it keeps the ledger's entry of the copy a get finds, so a pin looks nothing up
while that copy stays), and the store's pins this engine holds on it (LMCache may pin
a chunk twice, for two lookups of one prefix, and lets each go once). Entries are found
by the key's chunk hash, an int: LMCache's key hashes in Python (its ``__hash__`` builds
a tuple of its fields, as much as the rest of a pin), and the key an unpin names is the
very object its lookup named, so the entry's own key matches it by identity, with no
comparison. A key whose chunk hash is taken by another key (the same tokens under other
tags) is kept by the whole key. An unpin takes no lock: it pops a pin from a chunk's
deque. Entries are added, and pins too, only under ``lock``, and entries leave under it:
a removed one, and the unpinned ones when there are too many (``drops`` counts the times
any left).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from hurray_store.format import checksum
from hurray_store.store import KeyRef, Pin

_HASH_MASK = 2**64 - 1  # LMCache's chunk hashes are Python ints, possibly negative
# Entries kept before the unpinned ones are dropped: a chunk is named on its put, each
# lookup, get and unpin, and finding its entry again is cheaper than naming it anew.
KEPT = 8192


def chunk_name(prefix: str, key: Any) -> str:
    """The store's name of LMCache's chunk ``key`` (a ``CacheEngineKey``), under the
    layout's ``prefix``. A key with tags (LMCache's ``lmcache.tag.*`` request configs,
    which keep one tenant's chunks apart from another's: its keys differ by them) names
    its tags' xxh3-64 too, of fixed length whatever the tags."""
    name = (
        f"{prefix}{key.model_name}@{key.world_size}@{key.worker_id}"
        f"@{key.chunk_hash & _HASH_MASK:016x}@{str(key.dtype).removeprefix('torch.')}"
    )
    if tags := getattr(key, "tags", None):
        name += f"@t{checksum(repr(tags).encode()):016x}"
    return name + "/c"


class Chunk(deque[Pin]):
    """A chunk LMCache named lately: LMCache's key, its name in the store, the store's
    handle on it (``EnginePort.ref``), and, as its items, the store's pins this
    engine holds on it. A deque, not a list: a list emptied by its last ``pop`` gives
    its storage back and takes it again on the next pin, a ``malloc`` and a ``free`` a
    pin."""

    __slots__ = ("key", "name", "ref")

    def __init__(self, key: Any, name: str, ref: KeyRef) -> None:
        super().__init__()
        self.key, self.name, self.ref = key, name, ref


class ChunkRegistry:
    def __init__(self, prefix: str, object_ref: Callable[[str], KeyRef]) -> None:
        self.prefix = prefix
        self._object_ref = object_ref
        self.by_hash: dict[int, Chunk] = {}
        self.others: dict[Any, Chunk] = {}  # keys whose chunk hash another key has
        self.lock = threading.Lock()
        self._cap = KEPT
        self.drops = 0

    def __len__(self) -> int:
        return len(self.by_hash) + len(self.others)

    def entries(self) -> list[Chunk]:
        return [*self.by_hash.values(), *self.others.values()]

    def find(self, key: Any) -> Chunk | None:
        """``key``'s entry; None: none (any thread, no lock)."""
        c = self.by_hash.get(key.chunk_hash)
        if c is None or (c.key is not key and c.key != key):
            # a key of another's chunk hash, its entry made while that one's was here
            c = self.others.get(key) if self.others else None
        return c

    def name(self, key: Any) -> str:
        """The store's name of ``key``'s chunk (its entry's, else made)."""
        c = self.find(key)
        return c.name if c is not None else chunk_name(self.prefix, key)

    def entry(self, key: Any, ref: KeyRef | None = None) -> Chunk:
        """``key``'s entry, made if new, with ``ref`` as its handle where that is one (a
        lookup's, already pointing at the copy it pinned). Under ``lock``."""
        if (c := self.find(key)) is not None:
            return c
        if len(self) >= self._cap:
            # New dicts, not deletions in place: an unpin reading the old ones finds
            # the same entries. The pinned ones stay.
            self.by_hash = {h: c for h, c in self.by_hash.items() if c}
            self.others = {k: c for k, c in self.others.items() if c}
            self._cap = max(KEPT, 2 * len(self))
            self.drops += 1
        name = chunk_name(self.prefix, key)
        c = Chunk(key, name, ref if ref is not None else self._object_ref(name))
        if self.by_hash.setdefault(key.chunk_hash, c) is not c:
            self.others[key] = c  # its chunk hash is another key's
        return c

    def rename(self, prefix: str) -> list[Chunk]:
        """Name chunks under ``prefix`` from now on (a new identity of the weights):
        every entry is forgotten, so no lookup finds a chunk under its old name; the
        entries, for the caller to let their pins go (an unpin that comes later for one
        finds nothing, as after ``remove``). Lookups under way start over (``drops``)."""
        with self.lock:
            old = self.entries()
            self.prefix = prefix
            self.by_hash, self.others = {}, {}
            self.drops += 1
        return old

    def remove(self, key: Any) -> Chunk | None:
        """Take ``key``'s entry out (its pins stay in it, for the caller). Under
        ``lock``."""
        c = self.find(key)
        if c is not None:
            if self.by_hash.get(key.chunk_hash) is c:
                del self.by_hash[key.chunk_hash]
            else:
                del self.others[key]
            self.drops += 1
        return c
