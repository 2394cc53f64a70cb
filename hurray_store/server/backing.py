"""ServedStore: what the cache server needs from a store, and nothing else.

It takes keys as ``access.authorize`` made them of a client's (``ServedKey``: parsed
once, inside the tenant's namespace). Writes are charged to the tenant's quota.

- ``reserve`` / ``buffers``: where a put's bytes land (tier space, else a resident buffer).
- ``put_key``: one object-level object. ``commit_segment``: a segment, verified first.
- ``get_key`` / ``get_key_ranges`` / ``key_size`` / ``pin_keys`` / ``delete_key``.
- ``find_segments``: the prefix lookup other engines ask for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hurray_store.errors import ChecksumError, FormatError
from hurray_store.format import Manifest
from hurray_store.keys import SegmentKey
from hurray_store.server.access import ServedKey
from hurray_store.server.tenants import Tenant, Tenants, charge
from hurray_store.store import Group, TieredStore
from hurray_store.tiers import Blob, Buffer, Range, Reservation

# Sequences of one lookup matched (or claim-checked) between two turns of the event loop.
SEQS_PER_STEP = 64


class ServedStore:
    def __init__(self, store: TieredStore, tenants: Tenants) -> None:
        """``store`` keeps every tenant's namespace (``TieredStore(namespaces=...)``)."""
        self.store = store
        self.tenants = tenants
        self.buffers = store.buffers
        self.registry = store.metrics.registry
        self.groups = store.groups
        missing = set(tenants.namespaces) - set(self.groups.namespaces)
        if missing:
            raise ValueError(f"the store does not keep the tenants' namespaces {sorted(missing)}")

    @property
    def tier_names(self) -> list[str]:
        return [t.name for t in self.store.tiers]

    @property
    def namespaces(self) -> dict[str, Tenant]:
        """The tenants by namespace (what ``access.authorize`` is given)."""
        return self.tenants.by_namespace

    def reserve(self, nbytes: int) -> Reservation | None:
        """Space in the tier a new object of ``nbytes`` lands in, to receive it in
        place (None: that tier offers none). Unpublished space goes back with
        ``reservation.tier.unreserve``."""
        return self.groups.reserve(nbytes)

    async def put_key(
        self,
        k: ServedKey,
        data: Sequence[Buffer],
        tenant: Tenant,
        release: Callable[[], None] | None = None,
        reserved: Reservation | None = None,
    ) -> bool:
        """Store one object-level object of the tenant (a group of its own); ``release()``
        runs once no tier write needs ``data``. ``reserved``: ``data`` lies there, and the
        top tier publishes it without a copy. Raises FormatError (nothing stored) for a
        segment object or past the tenant's quota."""
        obj = k.obj
        try:
            if obj is None:
                raise FormatError(
                    f"{k.stored} is a segment object: it is stored by commit_segment with "
                    "its manifest"
                )
            nbytes = charge(sum(memoryview(d).nbytes for d in data), 1)
            why = await self.tenants.admit(tenant, obj, nbytes)
            if why:
                raise FormatError(why)
        except BaseException:
            if release is not None:
                release()
            raise
        try:
            return await self.groups.put_object(obj, data, release=release, reserved=reserved)
        finally:
            self.tenants.written(tenant, obj, nbytes)

    async def get_key(self, k: ServedKey) -> Blob | None:
        return await self.groups.get(k.stored)

    async def get_key_ranges(self, k: ServedKey, ranges: Sequence[Range]) -> list[Blob] | None:
        """Views of the tier's bytes: valid while the key's group is pinned."""
        return await self.groups.get_ranges(k.stored, ranges)

    async def key_size(self, k: ServedKey) -> int | None:
        return await self.groups.size(k.stored)

    def pin_keys(self, keys: Sequence[ServedKey]) -> list[Group]:
        """Pin the groups holding ``keys`` (a segment key pins its segment; they count
        as used for their tenant's quota); returns them, for ``unpin_groups``."""
        groups = self.groups.pin(k.stored for k in keys)
        self.groups.touch(groups)
        return groups

    def unpin_groups(self, groups: Sequence[Group]) -> None:
        self.store.unpin(groups)

    async def delete_key(self, k: ServedKey) -> None:
        """Delete a stored key everywhere, with its whole group."""
        await self.groups.delete(k.stored)

    async def commit_segment(
        self,
        seg: SegmentKey,
        manifest: Buffer,
        objects: Mapping[str, Buffer],
        tenant: Tenant,
        release: Callable[[], None] | None = None,
        reserved: Mapping[str, Reservation] | None = None,
        *,
        parsed: Manifest | None = None,
    ) -> bool:
        """Store a segment a client built: its layer objects, then its manifest (the
        commit). Everything is verified first: the manifest's checksum and key, each
        object's size and every page's checksum.

        Raises FormatError (nothing stored) when any of it is wrong, or when it does not
        fit the tenant's quota. Returns False when no tier took it, True when stored or
        already held (a committed segment is never replaced). ``parsed``:
        ``Manifest.from_bytes(manifest)``, when the caller has it already.
        """
        try:
            m = parsed if parsed is not None else Manifest.from_bytes(manifest)
            if m.segment_id != seg.segment_id:
                raise FormatError(
                    f"manifest names segment {m.segment_id.hex()}, committed as {seg.hex}"
                )
            want = {seg.layer(lay.layer_index): pos for pos, lay in enumerate(m.layers)}
            if len(want) != len(m.layers) or set(want) != set(objects):
                missing = sorted(set(want) - set(objects))
                extra = sorted(set(objects) - set(want))
                raise FormatError(
                    f"segment {seg.hex}: layer objects missing {missing[:3]} or not in the "
                    f"manifest {extra[:3]}"
                )
            for k, pos in want.items():
                why = m.verify_object(pos, objects[k])
                if why:
                    raise ChecksumError(f"segment {seg.hex}: {why}")
        except BaseException:
            if release is not None:
                release()
            raise
        if self.groups.held(seg):
            if release is not None:
                release()
            self.groups.touch([seg])
            return True
        nbytes = charge(
            memoryview(manifest).nbytes + sum(memoryview(b).nbytes for b in objects.values()),
            len(objects) + 1,
        )
        why = await self.tenants.admit(tenant, seg, nbytes)
        if why:
            if release is not None:
                release()
            raise FormatError(why)
        try:
            return await self.groups.put_segment(
                seg, m, manifest, objects, release=release, reserved=reserved
            )
        finally:
            self.tenants.written(tenant, seg, nbytes)

    async def find_segments(
        self, seqs: Sequence[tuple[int, Sequence[bytes]]], max_bytes: int, tenant: Tenant
    ) -> tuple[list[int], list[bytes]]:
        """Per sequence (pages the asker has, page hashes): the leading pages the
        tenant's namespace holds, and the manifests of the segments holding them past
        what the asker has (at most ``max_bytes`` of them; a sequence's match stops where
        they stop)."""
        ns = tenant.namespace
        matched: list[int] = []
        wanted: dict[bytes, None] = {}
        runs: list[Sequence[bytes]] = []
        for i, (have, hashes) in enumerate(seqs):
            if i and not i % SEQS_PER_STEP:
                await asyncio.sleep(0)  # a large lookup lets other requests in between
            mt = self.groups.longest_prefix(ns, hashes)
            matched.append(mt.num_pages)
            runs.append(mt.segment_ids)
            for sid in mt.segment_ids[have:]:
                wanted.setdefault(sid)
        out: dict[bytes, bytes] = {}
        total = 0
        self.groups.touch(SegmentKey(ns, sid) for sid in wanted)
        for sid in wanted:
            blob = await self.groups.manifest_bytes(ns, sid)
            if blob is None or total + len(blob) > max_bytes:
                continue
            out[sid] = blob
            total += len(blob)
        for s, (have, _) in enumerate(seqs):
            ids = runs[s]
            cut = next((j for j in range(have, len(ids)) if ids[j] not in out), len(ids))
            matched[s] = min(matched[s], cut)
        return matched, list(out.values())

    def stats(self) -> dict[str, Any]:
        return self.store.stats()

    async def close(self) -> None:
        await self.store.close()
