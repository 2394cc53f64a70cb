"""The ledger: which tier holds which group, how big, how recent, pinned (no I/O).

A group (a segment's layer objects and manifest, or an object-level group) enters and
leaves a tier as one. In a tier it is in one of two states, as vLLM's offloading
manager marks a block allocated but not yet ready:

=========  ===================================================================
WRITING    its room is taken from the tier's budget and it is never chosen as
           a victim, but no reader sees it: ``holders`` leaves it out
READY      every byte is where a get finds it (the group's last object, its
           commit record, included)
=========  ===================================================================

``begin_write`` records a group as WRITING; ``complete_write`` makes it READY or drops
it. ``record`` notes a READY group found in a tier (restart scan, discovery).

Group ids are opaque hashable values to the ledger (``keys.SegmentKey``,
``keys.ObjectKey``); keys are the stored strings the tiers know.

The store's loop is the only writer of the ledger. Other threads read them (``holders``)
and take and let go pins (``pin_ready``, ``pin_refs``, ``pin``, ``unpin``): every change of what a
tier holds, and every pin, is made under ``lock`` (a pin let go is counted off under it
when the pins are next read), which the policy holds too while it
chooses its victims and takes them off the ledger, so a group another thread finds
READY and pins under the lock is never a victim after that, and one chosen as a victim
is off the ledger before any thread can pin it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

Group = Hashable
# A ledger watcher: ``(kind, tier, group, reason)`` (``Ledger.watch``).
Watcher = Callable[[str, int, Group, str], None]
# Pins let go that wait to be counted off before a pin counts them (a write's eviction
# counts them first, whatever their number): a lookup right after another then does
# not pay for counting off the other's unpins, each one a cache miss.
_RELEASED_KEPT = 1024


@dataclass(frozen=True, slots=True)
class TierInfo:
    name: str
    capacity_bytes: int | None  # None: no budget of ours (Redis' maxmemory decides)
    persistent: bool
    trusted: bool = False  # in-process memory only this process writes
    shared: bool = False  # other processes write to it (a cache server)
    # What the tier's budget is charged for an object of n bytes: n, plus what the
    # medium really spends per object (``Tier.charge``).
    charge: Callable[[int], int] = int


@dataclass(slots=True, eq=False)
class Entry:
    """A group in one tier. ``ready`` turns false for good when it leaves the tier's
    ledger. ``pins``: pins taken on this tier's copy (``pin_refs``); while it is in the
    ledger, they pin the group as ``pin`` does (``is_pinned``). ``moved``: a key of it
    has since been written in another group of the tier, so a handle holding this
    entry (``KeyRef``) may be stale: it looks its key up again."""

    sizes: dict[str, int]
    depth: int
    nbytes: int  # what the tier's budget is charged for it (``TierInfo.charge``)
    ready: bool
    pins: int = 0
    moved: bool = False


class KeyRef:
    """A caller's handle on one key for ``Ledger.pin_refs``: the key and the ledger's
    entry it was last found READY in. A caller that pins the same keys again and again
    (an engine's lookups) keeps one per key: while that entry is still READY, a pin
    is made on it with no key looked up or group hashed (a few cache misses fewer a
    key, which is what a lookup right after a store is made of)."""

    __slots__ = ("key", "entry")

    def __init__(self, key: str) -> None:
        self.key = key
        self.entry: Entry | None = None


@dataclass(slots=True)
class _TierEntries:
    info: TierInfo
    used: int = 0
    groups: OrderedDict[Group, Entry] = field(default_factory=OrderedDict)  # LRU first
    key_group: dict[str, Group] = field(default_factory=dict)


class Ledger:
    def __init__(self, tiers: Sequence[TierInfo]) -> None:
        self.tiers = list(tiers)
        self._tiers = [_TierEntries(t) for t in self.tiers]
        self._pins: dict[Group, int] = {}
        # Pins let go and not yet counted off: ``unpin`` only appends here (a deque's
        # append is atomic), and whoever reads the pins counts them off first, under
        # ``lock``. An engine lets go of a lookup's pins one call per chunk.
        self._released: deque[Group] = deque()
        # ``unpin`` of one group: the deque's own append, a C call with no Python frame.
        self.unpin_one: Callable[[Group], None] = self._released.append
        self.lock = threading.RLock()
        # Called under ``lock`` for every group that becomes READY in a tier or leaves
        # it READY: ``(kind, tier, group, reason)``, kind ``stored`` or ``removed``
        # (``watch``). Kept cheap: a watcher only notes the change.
        self._watchers: list[Watcher] = []
        # Per namespace, its groups that some tier holds (or is writing), least recently
        # used first: the one recency a tenant's quota evicts by (``least_recent``).
        # Changed on the store's loop only, as the tiers' own orders are.
        self._recent: dict[str | None, OrderedDict[Group, None]] = {}
        # Per tier, whether it serves now (a tier behind a service in an outage does
        # not): what a get "finds now" is only in tiers that do (``serving``).
        self._up: list[Callable[[], bool]] = [_always] * len(self._tiers)

    def serving(self, up: Sequence[Callable[[], bool]]) -> None:
        """``up[i]()``: whether tier ``i`` serves now. A tier that does not is left out
        of every answer about what a get finds now (``holders``, the pins of a lookup):
        a lookup never promises what a down tier holds."""
        assert len(up) == len(self._tiers)
        self._up = list(up)

    def _live(self) -> list[bool]:
        return [f() for f in self._up]

    def watch(self, fn: Watcher) -> Callable[[], None]:
        """Call ``fn(kind, tier, group, reason)`` for every group that becomes READY in
        a tier (``stored``: ``write``, ``found``) or leaves one READY (``removed``:
        ``evict``, ``rewrite``, or ``forget``'s reason), under ``lock``; the call that
        stops it."""
        with self.lock:
            self._watchers = [*self._watchers, fn]

        def stop() -> None:
            with self.lock:
                self._watchers = [w for w in self._watchers if w is not fn]

        return stop

    def _changed(self, kind: str, tier: int, group: Group, reason: str) -> None:
        for fn in self._watchers:
            fn(kind, tier, group, reason)

    # ------------------------------------------------------------------ readers' view

    def holders(self, key: str) -> list[int]:
        """Tiers where a get of ``key`` finds it now (READY), fastest first."""
        out = []
        for i, (b, up) in enumerate(zip(self._tiers, self._up, strict=True)):
            g = b.key_group.get(key)
            # ``get`` twice: from another thread, the group may leave in between.
            if g is not None and (e := b.groups.get(g)) is not None and e.ready and up():
                out.append(i)
        return out

    def group_holders(self, group: Group) -> list[int]:
        """Tiers holding ``group`` READY, fastest first."""
        return [
            i
            for i, b in enumerate(self._tiers)
            if (e := b.groups.get(group)) is not None and e.ready
        ]

    def groups_of(self, key: str) -> dict[int, Group]:
        """Per tier whose ledger knows ``key`` (READY or WRITING), the group it is in."""
        return {i: g for i, b in enumerate(self._tiers) if (g := b.key_group.get(key)) is not None}

    def first_group(self, key: str) -> Group | None:
        """The group of ``key`` in the fastest tier whose ledger knows it (READY or
        WRITING)."""
        for b in self._tiers:
            if (g := b.key_group.get(key)) is not None:
                return g
        return None

    def group_of(self, tier: int, key: str) -> Group | None:
        return self._tiers[tier].key_group.get(key)

    def group_keys(self, tier: int, group: Group) -> dict[str, int]:
        e = self._tiers[tier].groups.get(group)
        return dict(e.sizes) if e else {}

    def charged(self, tier: int, sizes: Mapping[str, int]) -> int:
        """What ``tier``'s budget is charged for a group of objects of ``sizes``."""
        return sum(map(self.tiers[tier].charge, sizes.values()))

    def group_bytes(self, tier: int, group: Group) -> int:
        """The bytes the ledger charges ``group`` in ``tier`` (0: not there)."""
        e = self._tiers[tier].groups.get(group)
        return e.nbytes if e else 0

    def size_in(self, tier: int, key: str) -> int | None:
        """The size the ledger gives ``key`` in ``tier`` (None: not there)."""
        b = self._tiers[tier]
        g = b.key_group.get(key)
        return None if g is None else b.groups[g].sizes[key]

    def key_size(self, key: str) -> int | None:
        """The size of ``key`` in the fastest tier holding it READY."""
        for i in self.holders(key):
            b = self._tiers[i]
            return b.groups[b.key_group[key]].sizes[key]
        return None

    def depth(self, group: Group) -> int:
        for b in self._tiers:
            e = b.groups.get(group)
            if e is not None:
                return e.depth
        return 0

    # ------------------------------------------------------------------ the policy's view

    def groups(self, tier: int) -> list[Group]:
        """Groups of a tier, WRITING ones included, least recently used first."""
        return list(self._tiers[tier].groups)

    def entries(self, tier: int) -> Iterator[tuple[Group, Entry]]:
        """``(group, entry)`` of a tier, least recently used first."""
        return iter(self._tiers[tier].groups.items())

    def has_entry(self, tier: int, group: Group) -> bool:
        """The group is in the tier, READY or WRITING."""
        return group in self._tiers[tier].groups

    def is_writing(self, tier: int, group: Group) -> bool:
        e = self._tiers[tier].groups.get(group)
        return e is not None and not e.ready

    def used_bytes(self, tier: int) -> int:
        return self._tiers[tier].used

    def num_objects(self, tier: int) -> int:
        return len(self._tiers[tier].key_group)

    def is_pinned(self, group: Group) -> bool:
        """Pinned as a group, or in some tier (``pin_refs``)."""
        if self._released:
            self._count_released()
        if self._pins.get(group, 0) > 0:
            return True
        return any((e := b.groups.get(group)) is not None and e.pins > 0 for b in self._tiers)

    # ------------------------------------------------------------------ changes

    def take_room(
        self,
        tier: int,
        group: Group,
        sizes: Mapping[str, int],
        depth: int,
        victims: Iterable[Group],
    ) -> None:
        """Apply an accepted ``policy.plan_write``: its victims leave the ledger and the
        group's room is taken (WRITING; readers do not see it yet)."""
        with self.lock:
            for g in victims:
                self._drop(tier, g, "evict")
            self.begin_write(tier, group, sizes, depth)

    def begin_write(self, tier: int, group: Group, sizes: Mapping[str, int], depth: int) -> None:
        """The group's room is taken in ``tier``; readers do not see it yet."""
        with self.lock:
            self._drop(tier, group, "rewrite")
            self._add(tier, group, dict(sizes), depth, ready=False)

    def complete_write(self, tier: int, group: Group, ok: bool) -> None:
        """The write ``begin_write`` announced ended: READY, or gone when it failed."""
        with self.lock:
            e = self._tiers[tier].groups.get(group)
            if e is None:
                return
            if ok:
                e.ready = True
                if self._watchers:
                    self._changed("stored", tier, group, "write")
            else:
                self._drop(tier, group)  # never READY: no reader saw it

    def add_ready(
        self, tier: int, group: Group, sizes: Mapping[str, int], *, depth: int = 0
    ) -> None:
        """Note a READY group found in a tier (restart scan, discovery)."""
        with self.lock:
            was = self._tiers[tier].groups.get(group)
            ready = was is not None and was.ready
            same = ready and was.sizes == sizes  # type: ignore[union-attr]
            self._drop(tier, group, "rewrite" if ready and not same else "")
            self._add(tier, group, dict(sizes), depth, ready=True)
            if self._watchers and not same:
                self._changed("stored", tier, group, "found")

    def forget(self, tier: int, group: Group, reason: str = "lost") -> dict[str, int]:
        """The group left the tier (evicted, deleted, found missing: ``reason``, one of
        ``metrics.MOVE_REASONS``, for the watchers); its sizes."""
        with self.lock:
            e = self._drop(tier, group, reason)
        return e.sizes if e else {}

    def touch(self, groups: Iterable[Group]) -> None:
        """Mark groups used now, in every tier holding them. Groups touched together
        age together; the deeper ones are placed as the older, so they go first."""
        gs = list(dict.fromkeys(groups))
        for b in self._tiers:
            held = [g for g in gs if g in b.groups]
            held.sort(key=lambda g: -b.groups[g].depth)
            for g in held:
                b.groups.move_to_end(g)
        for g in gs:
            r = self._recent.get(getattr(g, "namespace", None))
            if r is not None and g in r:
                r.move_to_end(g)

    def least_recent(self, namespace: str) -> Iterator[Group]:
        """The groups of ``namespace`` that a tier holds or is writing, least recently
        used (written or touched) first. On the store's loop, consumed before it
        awaits."""
        return iter(self._recent.get(namespace, ()))

    def pin(self, groups: Iterable[Group]) -> None:
        with self.lock:
            if len(self._released) >= _RELEASED_KEPT:  # or they pile up while none evicts
                self._count_released()
            for g in groups:
                self._pins[g] = self._pins.get(g, 0) + 1

    def unpin(self, groups: Iterable[Group]) -> None:
        """Let one pin of each group go, from any thread, taking no lock: counted off
        when the pins are next read."""
        self._released.extend(groups)

    def _count_released(self) -> None:
        with self.lock:
            released, pins = self._released, self._pins
            while released:
                g = released.popleft()
                if type(g) is Entry:  # a pin of ``pin_refs``
                    g.pins -= 1
                    continue
                n = pins.get(g, 0) - 1
                if n <= 0:
                    pins.pop(g, None)
                else:
                    pins[g] = n

    def pin_ready(self, keys: Iterable[str]) -> list[Group]:
        """From any thread: pin the group of each of ``keys``, from the first, that a
        get finds now (READY in some tier), up to the first that it does not; the groups
        pinned, to ``unpin`` later. The check and the pin are one step under ``lock``: no
        victim is chosen between. ``keys`` is taken one at a time, none past the first
        miss (a lazy caller makes no more)."""
        tiers, groups = [b for b, up in zip(self._tiers, self._live(), strict=True) if up], []
        with self.lock:
            for k in keys:  # each key's group in the fastest tier holding it READY
                for b in tiers:
                    if (g := b.key_group.get(k)) is not None and b.groups[g].ready:
                        groups.append(g)
                        break
                else:
                    break
            self.pin(groups)
            return groups

    def pin_refs(self, refs: Iterable[KeyRef]) -> list[Entry]:
        """``pin_ready`` by handles: from any thread, pin the copy a get finds now of each of
        ``refs``' keys, from the first, up to the first that has none; the entries
        pinned, to ``unpin`` later. A ref whose entry left the ledger, is not READY
        or had a key move to another group (``Entry.moved``) is looked up again by
        its key (the fastest tier holding it READY) and keeps the entry found. Such
        a pin holds the group as ``pin`` does while that entry is in the ledger; a
        group written again has a new entry, which it does not hold (as a ``pin``
        does not hold the new bytes, see ``TieredStore.unpin``)."""
        out: list[Entry] = []
        # A tier down: every handle is looked up again (its entry may be in that tier).
        some_down = not all(self._live())
        with self.lock:
            if len(self._released) >= _RELEASED_KEPT:
                self._count_released()
            for r in refs:
                e = r.entry
                if e is None or not e.ready or e.moved or some_down:
                    if (e := self._ready_entry(r.key)) is None:
                        break
                    r.entry = e
                e.pins += 1
                out.append(e)
        return out

    def refresh(self, ref: KeyRef) -> None:
        """Point ``ref`` at the copy of its key a get finds now (None: none)."""
        with self.lock:
            ref.entry = self._ready_entry(ref.key)

    def _ready_entry(self, key: str) -> Entry | None:
        """The entry of ``key``'s group in the fastest serving tier holding it READY."""
        for b, up in zip(self._tiers, self._up, strict=True):
            if (g := b.key_group.get(key)) is not None and (e := b.groups[g]).ready and up():
                return e
        return None

    def _add(
        self, tier: int, group: Group, sizes: dict[str, int], depth: int, *, ready: bool
    ) -> None:
        b = self._tiers[tier]
        e = Entry(sizes, depth, self.charged(tier, sizes), ready)
        b.groups[group] = e
        b.used += e.nbytes
        r = self._recent.setdefault(getattr(group, "namespace", None), OrderedDict())
        r[group] = None
        r.move_to_end(group)
        for k in sizes:
            old = b.key_group.get(k)
            if old is not None and old != group and (was := b.groups.get(old)) is not None:
                was.moved = True  # its handles of ``k`` are stale
            b.key_group[k] = group

    def _drop(self, tier: int, group: Group, reason: str = "") -> Entry | None:
        """Take ``group`` out of ``tier``; a READY one is a ``removed`` change for
        ``reason`` ("": none is told, the caller tells its own)."""
        b = self._tiers[tier]
        e = b.groups.pop(group, None)
        if e is not None:
            if e.ready and reason and self._watchers:
                self._changed("removed", tier, group, reason)
            e.ready = False  # for the handles still holding it (``KeyRef``)
            b.used -= e.nbytes
            for k in e.sizes:
                if b.key_group.get(k) == group:
                    del b.key_group[k]
            if not any(group in t.groups for t in self._tiers):
                r = self._recent.get(getattr(group, "namespace", None))
                if r is not None:
                    r.pop(group, None)
        return e


def _always() -> bool:
    return True
