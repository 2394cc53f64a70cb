"""A store's group level (``TieredStore.groups``): for the cache server, which keeps
several tenants' namespaces in one store and names keys in full (``<namespace>/...``).

A group is what enters and leaves a tier whole: a segment (its layer objects and its
manifest) or an object-level object. Here the server stores groups its clients built
(a segment verified first), reads, pins and deletes them by key, and keeps each
tenant's quota by the ledger's own recency (``least_recent``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from hurray_store.format import Manifest
from hurray_store.keys import ObjectKey, SegmentKey
from hurray_store.store.cascade import TierCascade
from hurray_store.store.catalog import PrefixMatch, SegmentCatalog, depth
from hurray_store.store.ledger import Group
from hurray_store.tiers import Blob, Buffer, Range, Reservation, StoredObject


class GroupLevel:
    def __init__(self, cascade: TierCascade, catalogs: Mapping[str, SegmentCatalog]) -> None:
        self._cascade, self._ledger, self._catalogs = cascade, cascade.ledger, catalogs

    @property
    def namespaces(self) -> list[str]:
        return list(self._catalogs)

    # ------------------------------------------------------------------ writes

    def reserve(self, nbytes: int) -> Reservation | None:
        """Space in the tier a new object of ``nbytes`` lands in, to receive it in
        place (None: that tier offers none). Unpublished space goes back with
        ``reservation.tier.unreserve``."""
        got = self._cascade.reserve([nbytes])
        return got[0] if got else None

    async def put_object(
        self,
        key: ObjectKey,
        data: Sequence[Buffer],
        *,
        release: Callable[[], None] | None = None,
        reserved: Reservation | None = None,
    ) -> bool:
        """One object-level object, a group of its own; ``release()`` runs once no tier
        write needs ``data``; ``reserved``: ``data`` lies there, published with no copy."""
        obj = StoredObject(key.stored, data, reserved)
        return bool(await self._cascade.put_group(key, [obj], release=release))

    async def put_segment(
        self,
        seg: SegmentKey,
        m: Manifest,
        manifest: Buffer,
        objects: Mapping[str, Buffer],
        *,
        release: Callable[[], None] | None = None,
        reserved: Mapping[str, Reservation] | None = None,
    ) -> bool:
        """A segment its writer built and the caller verified: its layer objects (by
        key, in the manifest's order), then its manifest, the commit that indexes it in
        ``seg``'s namespace."""
        res = reserved or {}
        keys = [seg.layer(lay.layer_index) for lay in m.layers]
        group = [StoredObject(k, [objects[k]], res.get(k)) for k in keys]
        group.append(StoredObject(seg.manifest, [manifest]))
        catalog = self._catalogs[seg.namespace]
        return bool(
            await self._cascade.put_group(
                seg, group, depth=depth(m), on_committed=lambda: catalog.add(m), release=release
            )
        )

    # ------------------------------------------------------------------ reads

    async def get(self, key: str) -> Blob | None:
        return await self._cascade.reads.get(key)

    async def get_ranges(self, key: str, ranges: Sequence[Range]) -> list[Blob] | None:
        """Views of the tier's bytes: valid while the key's group is pinned."""
        return await self._cascade.reads.get_ranges(key, ranges)

    async def size(self, key: str) -> int | None:
        return await self._cascade.reads.size(key)

    def longest_prefix(self, namespace: str, hashes: Sequence[bytes]) -> PrefixMatch:
        return self._catalogs[namespace].longest_prefix(hashes)

    def cached_manifest(self, seg: SegmentKey) -> Manifest | None:
        """The segment's manifest if its catalog has it in memory (any thread; no I/O)."""
        catalog = self._catalogs.get(seg.namespace)
        return None if catalog is None else catalog.cached_manifest(seg.segment_id)

    async def manifest_bytes(self, namespace: str, segment_id: bytes) -> bytes | None:
        return await self._catalogs[namespace].manifest_bytes(segment_id)

    # ------------------------------------------------------------------ held

    def held(self, group: Group) -> bool:
        """Some tier holds ``group`` READY."""
        return bool(self._ledger.group_holders(group))

    def held_bytes(self, group: Group) -> tuple[int, int]:
        """``(bytes, objects)`` of ``group`` in the tier that holds most of it READY."""
        led = self._ledger
        return max(
            (
                (sum(keys.values()), len(keys))
                for i in led.group_holders(group)
                if (keys := led.group_keys(i, group))
            ),
            default=(0, 0),
        )

    def every_held(self) -> Iterator[tuple[Group, int, int]]:
        """``(group, bytes, objects)`` of every group held READY, once per tier."""
        for i in range(len(self._cascade.tiers)):
            for g, e in self._ledger.entries(i):
                if e.ready:
                    yield g, sum(e.sizes.values()), len(e.sizes)

    def pin(self, keys: Iterable[str]) -> list[Group]:
        """Pin the groups holding ``keys`` (a segment key pins its segment); let go with
        ``TieredStore.unpin``."""
        led = self._ledger
        groups: list[Group] = list(
            dict.fromkeys(
                g for k in keys for i, g in led.groups_of(k).items() if not led.is_writing(i, g)
            )
        )
        led.pin(groups)
        return groups

    def is_pinned(self, group: Group) -> bool:
        return self._ledger.is_pinned(group)

    def touch(self, groups: Iterable[Group]) -> None:
        """Count these groups as used now (eviction and quotas take the least recent)."""
        self._ledger.touch(groups)

    def least_recent(self, namespace: str) -> Iterator[Group]:
        """``namespace``'s groups, least recently used first (consume before awaiting)."""
        return self._ledger.least_recent(namespace)

    def on_left(self, fn: Callable[[Group], None]) -> None:
        """``fn(group)`` once no tier holds ``group`` any more."""
        self._cascade.subscribe(fn)

    async def delete(self, key: str, reason: str = "delete") -> None:
        """Delete ``key`` everywhere, with its whole group; ``reason``: ``delete`` or
        ``quota``."""
        await self._cascade.delete(key, reason)
