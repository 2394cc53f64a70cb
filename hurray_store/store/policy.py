"""Every placement, write-through, promotion, eviction and verification decision (no I/O).

The store asks, the policy answers with plain values, the store carries them out. The
ledger it decides over (which tier holds which group, sizes, recency, pins, WRITING or
READY) are the ``Ledger``'s. Eviction works on groups: a segment's layer objects and its
manifest form one group and leave a tier together, so a tier never holds half a
segment; an object put through the object level is a group of one.

Eviction order, per tier (one table, as diskcache keeps its policies):

=========  ================================================================
order      least recently used group first
ties       groups touched by one operation age as one; among them the
           deeper group (pages further into its sequences) is evicted first,
           so a suffix leaves before the prefix it depends on
pinned     never evicted (groups being read by a retrieve)
writing    never evicted (a group whose write has not completed)
too big    a group larger than the whole budget is refused, not admitted
=========  ================================================================

Write modes: ``through``: a put lands in its top tier and every lower tier receives
it asynchronously. ``back``: a put lands in its top tier only; a group moves one tier
down when it is evicted (and ``flush`` moves groups held only by volatile tiers down).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Literal

from hurray_store.store.ledger import Group, Ledger, TierInfo

WriteMode = Literal["through", "back"]

__all__ = ["Admission", "Policy", "TierInfo", "Victim", "WriteMode", "quota_victims"]


@dataclass(frozen=True, slots=True)
class Victim:
    """A group the tier gives up; ``demote_to`` is the tier to copy it into first."""

    group: Group
    sizes: Mapping[str, int]
    demote_to: int | None


@dataclass(frozen=True, slots=True)
class Admission:
    accepted: bool
    victims: tuple[Victim, ...] = ()
    reason: str = ""


class Policy:
    def __init__(
        self, ledger: Ledger, *, write_mode: WriteMode = "through", promote_on_hit: bool = True
    ) -> None:
        if write_mode not in ("through", "back"):
            raise ValueError(f"write_mode must be 'through' or 'back', got {write_mode!r}")
        self.ledger = ledger
        self.tiers = ledger.tiers
        self.write_mode = write_mode
        self.promote_on_hit = promote_on_hit

    def place(self, nbytes: int) -> int | None:
        """The tier a new group of ``nbytes`` lands in: the first whose budget can hold
        it at all (a group bigger than a tier's whole budget skips that tier)."""
        for i, t in enumerate(self.tiers):
            if t.capacity_bytes is None or nbytes <= t.capacity_bytes:
                return i
        return None

    def plan_write(
        self, tier: int, group: Group, sizes: Mapping[str, int], *, depth: int = 0
    ) -> Admission:
        """Whether ``group`` may be written to ``tier``, and its victims: least recently
        used groups that are neither pinned nor being written, until it fits (a group
        already there is replaced, its room counted free). Decides only: the ledger is
        not touched. The cascade applies an accepted plan with ``ledger.take_room``
        (the victims leave the ledger, the group is WRITING) in the same hold of the
        ledger's lock, so nothing is pinned in between; it deletes the victims' bytes,
        demoting them first where ``demote_to`` says, and ends the write with
        ``ledger.complete_write``.
        """
        led = self.ledger
        with led.lock:
            cap = self.tiers[tier].capacity_bytes
            need = led.charged(tier, sizes)
            if cap is not None and need > cap:
                return Admission(
                    False, reason=f"{need} bytes exceed the tier's whole budget of {cap}"
                )
            if led.is_writing(tier, group):
                return Admission(False, reason="the group is being written to this tier already")
            used = led.used_bytes(tier) - led.group_bytes(tier, group)
            chosen: list[tuple[Group, Mapping[str, int]]] = []
            if cap is not None and used + need > cap:
                free = cap - used
                for g, e in led.entries(tier):
                    if free >= need:
                        break
                    if g == group or not e.ready or led.is_pinned(g):
                        continue
                    chosen.append((g, e.sizes))
                    free += e.nbytes
                if free < need:
                    return Admission(
                        False,
                        reason=f"{need} bytes do not fit: the rest of the {cap}-byte budget is "
                        "pinned or being written",
                    )
            victims = tuple(Victim(g, sz, self._demote_target(tier, g)) for g, sz in chosen)
            return Admission(True, victims)

    def lower_budget(self, tier: int) -> int | None:
        """The tier's medium is full before its budget: make what it holds now (less
        what is being written) its budget, so later writes evict first. Returns the new
        budget, None when there is nothing to lower to."""
        held = sum(e.nbytes for _, e in self.ledger.entries(tier) if e.ready)
        info = self.tiers[tier]
        if held <= 0 or (info.capacity_bytes is not None and held >= info.capacity_bytes):
            return None
        self.tiers[tier] = replace(info, capacity_bytes=held)
        return held

    def _demote_target(self, tier: int, group: Group) -> int | None:
        if self.write_mode != "back" or tier + 1 >= len(self.tiers):
            return None
        if any(self.ledger.has_entry(j, group) for j in range(tier + 1, len(self.tiers))):
            return None
        return tier + 1

    def write_through_targets(self, top: int) -> list[int]:
        """Lower tiers that receive a put landing in ``top``, asynchronously."""
        return list(range(top + 1, len(self.tiers))) if self.write_mode == "through" else []

    def promote_targets(self, hit_tier: int, group: Group) -> list[int]:
        """Upper tiers a group read whole from ``hit_tier`` is copied into."""
        if not self.promote_on_hit:
            return []
        return [i for i in range(hit_tier) if not self.ledger.has_entry(i, group)]

    def read_whole(self, tier: int, group: Group, *, every_page: bool, on_device: bool) -> bool:
        """Read a whole object instead of its pages' ranges: when the read wants every
        page anyway and the group will be promoted (so the copy up needs no second
        read). A device tier is read by ranges (its slices are free)."""
        return every_page and not on_device and bool(self.promote_targets(tier, group))

    def promote_after_read(self, tiers_read: set[int | None]) -> int | None:
        """The tier to promote a segment from after a retrieve read its layer objects,
        each whole from a tier or by ranges (None): only when one lower tier served
        every one of them whole (a segment partly read is not worth the copy)."""
        if len(tiers_read) == 1:
            (t,) = tiers_read
            return t if t is not None and t > 0 else None
        return None

    def verify_reads(self, tier: int) -> bool:
        """Check every page read from ``tier`` against its checksum. In-process memory
        only this process writes is trusted, as the engine's own pool is."""
        return not self.tiers[tier].trusted

    def scan_at_open(self, tier: int) -> bool:
        """Rebuild the ledger from the tier at open: persistent tiers only this store
        writes. A shared tier is asked per request, as other engines keep adding to it."""
        t = self.tiers[tier]
        return t.persistent and not t.shared

    def flush_targets(self) -> list[tuple[Group, int, int]]:
        """write-back: ``(group, from_tier, to_tier)`` for groups that no persistent
        tier holds, each to the first persistent tier below where it is."""
        if self.write_mode != "back":
            return []
        persisted: set[Group] = set()
        for j, t in enumerate(self.tiers):
            if t.persistent:
                persisted.update(self.ledger.groups(j))
        out: list[tuple[Group, int, int]] = []
        for i, t in enumerate(self.tiers):
            if t.persistent:
                continue
            dest = next(
                (j for j in range(i + 1, len(self.tiers)) if self.tiers[j].persistent), None
            )
            if dest is None:
                continue
            for g in self.ledger.groups(i):
                if g not in persisted and not self.ledger.is_writing(i, g):
                    persisted.add(g)
                    out.append((g, i, dest))
        return out


def quota_victims(
    groups: Iterable[tuple[Group, int]],
    used: int,
    quota: int,
    need: int,
    pinned: Callable[[Group], bool],
) -> list[Group] | None:
    """A tenant's quota: which of its groups (``(group, bytes)``, least recently used
    first) to delete so ``need`` more bytes fit under ``quota`` with ``used`` held now.
    Pinned groups (being sent) stay. None: they cannot be made to fit (the object alone
    exceeds the quota, or what is left is pinned)."""
    if need > quota:
        return None
    out: list[Group] = []
    for g, n in groups:
        if used + need <= quota:
            break
        if not pinned(g):
            out.append(g)
            used -= n
    return out if used + need <= quota else None
