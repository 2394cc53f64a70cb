"""Every placement, write-through, promotion and eviction decision (layer L2, no I/O).

The store asks, the policy answers with plain values, the store carries them out. The
policy also keeps the books: which tier holds which object, how many bytes each tier
uses, recency, and pins. Eviction works on groups: a segment's layer objects and its
manifest form one group and leave a tier together, so a tier never holds half a
segment; an object put through the object level is a group of one.

Eviction order, per tier (one table, as diskcache keeps its policies):

=========  ================================================================
order      least recently used group first
ties       groups touched by one operation age as one; among them the
           deeper group (pages further into its sequences) is evicted first,
           so a suffix leaves before the prefix it depends on
pinned     never evicted (groups being read by a retrieve)
too big    a group larger than the whole budget is refused, not admitted
=========  ================================================================

Write modes: ``through``: a put lands in its top tier and every lower tier receives
it asynchronously. ``back``: a put lands in its top tier only; a group moves one tier
down when it is evicted (and ``flush`` moves groups held only by volatile tiers down).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TierInfo:
    name: str
    capacity_bytes: int | None  # None: no budget of ours (Redis' maxmemory decides)
    persistent: bool


@dataclass(frozen=True, slots=True)
class Victim:
    """A group the tier gives up; ``demote_to`` is the tier to copy it into first."""

    group: str
    sizes: Mapping[str, int]
    demote_to: int | None


@dataclass(frozen=True, slots=True)
class Admission:
    accepted: bool
    victims: tuple[Victim, ...] = ()
    reason: str = ""


@dataclass(slots=True)
class _Group:
    sizes: dict[str, int]
    depth: int
    nbytes: int = 0


@dataclass(slots=True)
class _Ledger:
    info: TierInfo
    used: int = 0
    groups: OrderedDict[str, _Group] = field(default_factory=OrderedDict)  # LRU first
    key_group: dict[str, str] = field(default_factory=dict)


class Policy:
    def __init__(self, tiers: Sequence[TierInfo], *, write_mode: str = "through", promote_on_hit: bool = True) -> None:
        if write_mode not in ("through", "back"):
            raise ValueError(f"write_mode must be 'through' or 'back', got {write_mode!r}")
        self.tiers = list(tiers)
        self.write_mode = write_mode
        self.promote_on_hit = promote_on_hit
        self._ledgers = [_Ledger(t) for t in self.tiers]
        self._pins: dict[str, int] = {}

    # ------------------------------------------------------------------ queries

    def holders(self, key: str) -> list[int]:
        """Tiers holding ``key``, fastest first."""
        return [i for i, led in enumerate(self._ledgers) if key in led.key_group]

    def group_holders(self, group: str) -> list[int]:
        return [i for i, led in enumerate(self._ledgers) if group in led.groups]

    def group_keys(self, tier: int, group: str) -> dict[str, int]:
        g = self._ledgers[tier].groups.get(group)
        return dict(g.sizes) if g else {}

    def groups(self, tier: int) -> list[str]:
        """Groups of a tier, least recently used first."""
        return list(self._ledgers[tier].groups)

    def used_bytes(self, tier: int) -> int:
        return self._ledgers[tier].used

    def num_objects(self, tier: int) -> int:
        return len(self._ledgers[tier].key_group)

    def is_pinned(self, group: str) -> bool:
        return self._pins.get(group, 0) > 0

    # ------------------------------------------------------------------ decisions

    def place(self, nbytes: int) -> int | None:
        """The tier a new group of ``nbytes`` lands in: the first whose budget can hold
        it at all (a group bigger than a tier's whole budget skips that tier)."""
        for i, t in enumerate(self.tiers):
            if t.capacity_bytes is None or nbytes <= t.capacity_bytes:
                return i
        return None

    def write_through_targets(self, top: int) -> list[int]:
        """Lower tiers that receive a put landing in ``top``, asynchronously."""
        return list(range(top + 1, len(self.tiers))) if self.write_mode == "through" else []

    def promote_targets(self, hit_tier: int, group: str) -> list[int]:
        """Upper tiers a group read whole from ``hit_tier`` is copied into."""
        if not self.promote_on_hit:
            return []
        return [i for i in range(hit_tier) if group not in self._ledgers[i].groups]

    def flush_targets(self) -> list[tuple[str, int, int]]:
        """write-back: ``(group, from_tier, to_tier)`` for groups that no persistent
        tier holds, each to the first persistent tier below where it is."""
        if self.write_mode != "back":
            return []
        out: list[tuple[str, int, int]] = []
        for i, led in enumerate(self._ledgers):
            if led.info.persistent:
                continue
            for g in led.groups:
                if any(self._ledgers[j].info.persistent and g in self._ledgers[j].groups for j in range(len(self.tiers))):
                    continue
                dest = next((j for j in range(i + 1, len(self.tiers)) if self.tiers[j].persistent), None)
                if dest is not None and all(g != o[0] for o in out):
                    out.append((g, i, dest))
        return out

    def admit(self, tier: int, group: str, sizes: Mapping[str, int], *, depth: int = 0) -> Admission:
        """Reserve room for ``group`` in ``tier`` and record it as held there.

        Evicts least-recently-used unpinned groups until it fits; the victims are
        already off the books when this returns (the store deletes their bytes). A group
        already there is replaced (its old bytes are released first).
        """
        led = self._ledgers[tier]
        cap = led.info.capacity_bytes
        need = sum(sizes.values())
        if cap is not None and need > cap:
            return Admission(False, reason=f"{need} bytes exceed the tier's whole budget of {cap}")
        self._drop(tier, group)
        victims: list[Victim] = []
        if cap is not None and led.used + need > cap:
            free = cap - led.used
            chosen = []
            for g, rec in led.groups.items():
                if free >= need:
                    break
                if self._pins.get(g, 0) > 0:
                    continue
                chosen.append(g)
                free += rec.nbytes
            if free < need:
                return Admission(False, reason=f"{need} bytes do not fit: the rest of the {cap}-byte budget is pinned")
            for g in chosen:
                dropped = self._drop(tier, g)
                assert dropped is not None
                victims.append(Victim(g, dropped.sizes, self._demote_target(tier, g)))
        self._add(tier, group, dict(sizes), depth)
        return Admission(True, tuple(victims))

    def _demote_target(self, tier: int, group: str) -> int | None:
        if self.write_mode != "back" or tier + 1 >= len(self.tiers):
            return None
        if any(group in self._ledgers[j].groups for j in range(tier + 1, len(self.tiers))):
            return None
        return tier + 1

    # ------------------------------------------------------------------ book keeping

    def record(self, tier: int, group: str, sizes: Mapping[str, int], *, depth: int = 0) -> None:
        """Note a group found in a tier (restart scan), without eviction."""
        self._drop(tier, group)
        self._add(tier, group, dict(sizes), depth)

    def _add(self, tier: int, group: str, sizes: dict[str, int], depth: int) -> None:
        led = self._ledgers[tier]
        rec = _Group(sizes, depth, sum(sizes.values()))
        led.groups[group] = rec
        led.used += rec.nbytes
        for k in sizes:
            led.key_group[k] = group

    def _drop(self, tier: int, group: str) -> _Group | None:
        led = self._ledgers[tier]
        rec = led.groups.pop(group, None)
        if rec is not None:
            led.used -= rec.nbytes
            for k in rec.sizes:
                led.key_group.pop(k, None)
        return rec

    def forget(self, tier: int, group: str) -> dict[str, int]:
        """The group left the tier (deleted, expired, or found missing)."""
        rec = self._drop(tier, group)
        return rec.sizes if rec else {}

    def group_of(self, tier: int, key: str) -> str | None:
        return self._ledgers[tier].key_group.get(key)

    def depth(self, group: str) -> int:
        for led in self._ledgers:
            if group in led.groups:
                return led.groups[group].depth
        return 0

    def touch(self, groups: Iterable[str]) -> None:
        """Mark groups used now, in every tier holding them. Groups touched together
        age together; the deeper ones are placed as the older, so they go first."""
        gs = list(dict.fromkeys(groups))
        for led in self._ledgers:
            held = [g for g in gs if g in led.groups]
            held.sort(key=lambda g: -led.groups[g].depth)
            for g in held:
                led.groups.move_to_end(g)

    def pin(self, groups: Iterable[str]) -> None:
        for g in groups:
            self._pins[g] = self._pins.get(g, 0) + 1

    def unpin(self, groups: Iterable[str]) -> None:
        for g in groups:
            n = self._pins.get(g, 0) - 1
            if n <= 0:
                self._pins.pop(g, None)
            else:
                self._pins[g] = n
