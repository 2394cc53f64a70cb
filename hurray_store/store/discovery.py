"""What a store finds that it did not write: at open, a persistent tier's objects
(``rebuild``: the ledger and the index again, what was never committed deleted), and
at every operation, what other processes sharing a tier's medium committed and removed
(``sync``, from the tier's ``changes``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

from hurray_store.keys import MemberListKey, ObjectKey, SegmentKey, SegmentPart, parse_key
from hurray_store.store.catalog import SegmentCatalog
from hurray_store.store.objects import ObjectStore
from hurray_store.store.reads import TierReads
from hurray_store.tiers import SharedMedium, Tier

log = logging.getLogger(__name__)


class Discovery:
    """Per namespace, its segment catalog and object level, found again in ``tiers``."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        catalogs: dict[str, SegmentCatalog],
        object_levels: dict[str, ObjectStore],
        reads: TierReads,
    ) -> None:
        self.tiers, self.reads = tiers, reads
        self.catalogs, self.object_levels = catalogs, object_levels

    async def rebuild(self, tier: int) -> None:
        """The ledger and the index from what a persistent tier holds; what was never committed
        (a writer killed mid-segment or mid-group) is deleted."""
        segs: dict[str, dict[SegmentKey, dict[str, int]]] = {ns: {} for ns in self.catalogs}
        objs: dict[str, dict[str, int]] = {ns: {} for ns in self.catalogs}
        member_lists: dict[str, dict[ObjectKey, int]] = {ns: {} for ns in self.catalogs}
        async for key, size in self.tiers[tier].scan():
            k = parse_key(key)
            if isinstance(k, SegmentPart) and k.segment.namespace in segs:
                segs[k.segment.namespace].setdefault(k.segment, {})[key] = size
            elif isinstance(k, ObjectKey) and k.namespace in objs:
                objs[k.namespace][key] = size
            elif isinstance(k, MemberListKey) and k.group.namespace in member_lists:
                member_lists[k.group.namespace][k.group] = size
        orphans: list[str] = []
        for ns, catalog in self.catalogs.items():
            orphans += await catalog.rebuild(tier, segs[ns])
            orphans += await self.object_levels[ns].rebuild(tier, objs[ns], member_lists[ns])
        t = self.tiers[tier]
        if t.offers(SharedMedium):  # another process may still be committing some
            orphans = await cast(SharedMedium, t).removable_orphans(orphans)
        if orphans:
            await self.tiers[tier].delete_many(orphans)
        log.info("tier %s: removed %d uncommitted objects", self.tiers[tier].name, len(orphans))

    async def sync(self) -> None:
        """What other processes sharing a tier's medium committed and removed since the
        last call: their segments join the index, their objects the ledger; what they
        removed leaves the ledger."""
        for i, t in enumerate(self.tiers):
            if not t.offers(SharedMedium):
                continue
            for added, key in cast(SharedMedium, t).changes():
                if not added:
                    self.reads.lost(i, key, "other_process")
                    continue
                k = parse_key(key)
                if (
                    isinstance(k, SegmentPart)
                    and k.is_manifest
                    and k.segment.namespace in self.catalogs
                ):
                    await self.catalogs[k.segment.namespace].adopt(i, k.segment)
                elif isinstance(k, ObjectKey) and k.namespace in self.object_levels:
                    await self.object_levels[k.namespace].adopt(i, k)
