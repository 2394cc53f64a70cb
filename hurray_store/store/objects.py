"""ObjectStore: the object level (what the LMCache adapters build on).

Keyed objects through the cascade: ``put`` (a group of one), ``put_many`` (one group:
written together, the last after the others, evicted and deleted together), ``get``,
``get_ranges``, ``read_into``, ``contains`` / ``has``, ``pin`` / ``unpin``, ``delete``.

A group of several objects also stores its member list (``<ns>/g/<last name>``, written
with the others, before the last), so a restart finds the group again; a group whose
members are not all there (a writer killed mid-group) is deleted whole at restart.

Reads are checked: a whole read must have the size the ledger gives (another process on
the same folder may have replaced the object), and an object this store ``put`` is
checked against the xxh3-64 it had (kept while the store holds it). A mismatch is a
miss, and the object leaves the ledger. Objects put ``self_checked`` carry their own
checks (the LMCache adapters' objects end in a record with their checksums).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch

from hurray_store.format import checksum
from hurray_store.keys import ObjectKey, decode_member_list, encode_member_list, object_stored
from hurray_store.store.cascade import TierCascade
from hurray_store.store.ledger import Entry, Group, KeyRef
from hurray_store.tiers import Blob, Buffer, Range, RangeIn, host_view
from hurray_store.tiers.base import GroupObject, StoredObject
from hurray_store.tiers.self_checked import SelfChecked, SelfCheckedObject

log = logging.getLogger(__name__)

Data = Buffer | Sequence[Buffer] | SelfChecked


def _bufs(data: Data) -> list[Buffer]:
    return list(data) if isinstance(data, list | tuple) else [data]  # type: ignore[list-item]


class ObjectStore:
    def __init__(self, namespace: str, cascade: TierCascade) -> None:
        self.namespace = namespace
        self.cascade = cascade
        # An object's stored key is this and its name (``object_stored``), made with no
        # call for the ledger's lookups from engines' threads.
        self._stored = object_stored(namespace, "")
        self._sums: dict[str, int] = {}  # stored key -> xxh3-64, for objects put here
        cascade.subscribe(self._on_group_left)

    def _on_group_left(self, group: object) -> None:
        if isinstance(group, ObjectKey) and group.namespace == self.namespace:
            self._sums.pop(group.stored, None)

    def key(self, name: str) -> ObjectKey:
        return ObjectKey(self.namespace, name)

    async def put(self, name: str, data: Data, self_checked: bool = False) -> bool:
        """Store one object (the concatenation of ``data`` when it is a list; a
        ``SelfChecked`` object ends in its own checksums, hashed as a disk tier writes it) in
        the top tier that can hold it, and write-through below. False: stored nowhere.

        ``self_checked``: the object carries its own checksums and its reader checks
        them (the LMCache adapters' objects end in their record), so the store hashes
        none of its bytes and ``get`` checks nothing for it."""
        k = self.key(name)
        obj = self._member(k.stored, data)
        # A self-checked object checks itself, hashed where it is written.
        sum_ = (
            None
            if self_checked or isinstance(data, SelfChecked)
            else checksum(*(host_view(b) for b in obj.buffers()))
        )
        ok = bool(await self.cascade.put_group(k, [obj]))
        if ok and sum_ is not None:
            self._sums[k.stored] = sum_
        elif ok:
            self._sums.pop(k.stored, None)
        return ok

    async def put_many(self, items: Sequence[tuple[str, Data]]) -> bool:
        """Store several objects as one group: they enter and leave every tier together,
        and the last one is written after all the others (make it the commit record).
        On Redis the group is one pipeline. False: stored nowhere."""
        if not items:
            return True
        if len(items) == 1:
            return await self.put(*items[0])
        group = self.key(items[-1][0])
        members = [self._member(self.key(n).stored, d) for n, d in items]
        record = encode_member_list([(o.key, o.nbytes) for o in members])
        return bool(
            await self.cascade.put_group(
                group, [StoredObject(group.member_list, [record]), *members]
            )
        )

    @staticmethod
    def _member(stored: str, data: Data) -> GroupObject:
        return (
            SelfCheckedObject(stored, data)
            if isinstance(data, SelfChecked)
            else StoredObject(stored, _bufs(data))
        )

    async def get(self, name: str) -> Blob | None:
        key = self.key(name).stored
        got = await self.cascade.reads.get(key)
        want = self._sums.get(key)
        if got is not None and want is not None and checksum(host_view(got)) != want:
            log.warning(
                "object %s: not the bytes this store put (replaced elsewhere); a miss", name
            )
            for i in self.cascade.ledger.holders(key):
                self.cascade.reads.lost(i, key, "other_process")
            return None
        return got

    async def get_ranges(self, name: str, ranges: Sequence[Range]) -> list[Blob] | None:
        got = await self.cascade.reads.get_ranges(self.key(name).stored, ranges)
        # Copies: a memory tier's views are only valid until its object is evicted.
        return (
            None
            if got is None
            else [b.clone() if isinstance(b, torch.Tensor) else bytes(b) for b in got]
        )

    async def read_into(
        self, name: str, ranges: Sequence[Range], buffers: Sequence[memoryview]
    ) -> bool:
        """Fill ``buffers[i]`` with range ``i`` of the object, from the fastest tier
        holding it (a disk tier reads straight into them). False: a miss."""
        return await self.cascade.reads.read_into(self.key(name).stored, ranges, buffers)

    def read_into_now(
        self,
        items: Sequence[tuple[str, Sequence[Range], Sequence[memoryview]]],
        each: RangeIn | None = None,
    ) -> list[bool]:
        """``read_into`` of each ``(name, ranges, buffers)`` on the calling thread, any
        thread, where the fastest tier holding the object reads with blocking calls
        (a disk tier, a single Redis); ``each(j, i)`` once range ``i`` of item ``j`` is
        in. Per item, False: not read; ``read_into`` decides."""
        return self.cascade.reads.read_into_now(
            [(self.key(n).stored, r, b) for n, r, b in items], each
        )

    async def contains(self, name: str) -> bool:
        return await self.size(name) is not None

    async def size(self, name: str) -> int | None:
        """The object's size in bytes (from the ledger, else a shared tier); None: absent."""
        return await self.cascade.reads.size(self.key(name).stored)

    def has(self, name: str) -> bool:
        """``contains`` from the ledger alone (no I/O): true only once a get of it will
        find it, the whole group written. Safe from another thread (membership tests of
        dicts are atomic in CPython)."""
        return bool(self.cascade.ledger.holders(self._stored + name))

    def known_size(self, name: str) -> int | None:
        """``size`` from the ledger alone (no I/O), from any thread: None when they do
        not know it (or changed under the call)."""
        try:
            return self.cascade.ledger.key_size(self._stored + name)
        except (KeyError, RuntimeError):
            return None

    def pin(self, names: Sequence[str]) -> list[Group]:
        """Keep the groups of these objects from eviction (any thread); the groups, each
        pinned once more, for the ledger's ``unpin``."""
        led = self.cascade.ledger
        with led.lock:
            groups = self._groups(names)
            led.pin(groups)
            return groups

    def pin_held(self, names: Iterable[str]) -> list[Group]:
        """From any thread: pin the objects of ``names``, from the first, that a get
        will find now, up to the first it will not; their groups, for the ledger's
        ``unpin``. Nothing is evicted between the check and the pin (the ledger's lock)."""
        return self.cascade.ledger.pin_ready(map(self._stored.__add__, names))  # lazy

    def ref(self, name: str) -> KeyRef:
        """A handle on object ``name`` for ``TieredStore.pin_held``, kept by a caller that
        pins the same objects again and again."""
        return KeyRef(self._stored + name)

    def refresh(self, ref: KeyRef) -> None:
        self.cascade.ledger.refresh(ref)

    def pin_held_refs(self, refs: Iterable[KeyRef]) -> list[Entry]:
        """``pin_held`` by ``ref``'s handles: each pin keeps the copy a get finds."""
        return self.cascade.ledger.pin_refs(refs)

    def touch(self, names: Sequence[str]) -> None:
        """Mark these objects' groups used now (eviction takes the least recent)."""
        self.cascade.ledger.touch(self._groups(names))

    def _groups(self, names: Sequence[str]) -> list[Group]:
        """The group of each named object (itself when no tier holds it)."""
        first, at = self.cascade.ledger.first_group, self._stored
        return [first(at + n) or self.key(n) for n in names]

    async def delete(self, name: str, reason: str = "delete") -> None:
        """Delete an object everywhere; an object stored with ``put_many`` takes its
        whole group with it. ``reason``: ``delete``, or ``rejected`` (its reader's
        check failed)."""
        await self.cascade.delete(self.key(name).stored, reason)

    async def adopt(self, tier: int, obj: ObjectKey) -> None:
        """Another process stored the group ``obj`` ends (a single object, or the last
        of a ``put_many`` group with its member list) in ``tier``: record what the tier
        holds of it now, in place of what the ledger knew."""
        t = self.cascade.tiers[tier]
        led = self.cascade.ledger
        old = led.group_of(tier, obj.stored)
        if old is not None and led.is_writing(tier, old):
            return  # this store is writing it too: its own write decides
        blob = await t.get(obj.member_list)
        members = None
        if blob is not None:
            members = decode_member_list(bytes(host_view(blob)))
            if not members or members[-1][0] != obj.stored:
                members = None  # a member list of an older group of that name
        keys = [k for k, _ in members] if members else [obj.stored]
        have = await t.sizes(keys)
        if members and [n for _, n in members] != have:
            return  # not all there (yet, or any more)
        if have[0] is None:
            return
        sizes = dict(zip(keys, have, strict=True))
        if members:
            sizes[obj.member_list] = len(host_view(blob))  # type: ignore[arg-type]
        if old is not None:
            self.cascade.reads.lost(tier, obj.stored, "other_process")
        for k in sizes:  # a key of another group the ledger knows: that group is gone
            if (g := led.group_of(tier, k)) is not None and g != obj:
                self.cascade.reads.lost(tier, k, "other_process")
        led.add_ready(tier, obj, sizes)  # type: ignore[arg-type]

    async def rebuild(
        self, tier: int, objects: dict[str, int], records: dict[ObjectKey, int]
    ) -> list[str]:
        """Books from the object keys a restart scan found in ``tier``: each group of
        several objects from its member list, every other object a group of one.
        Returns the keys of incomplete groups (the caller deletes them)."""
        t = self.cascade.tiers[tier]
        groups = list(records)
        blobs = await t.get_many([g.member_list for g in groups]) if groups else []
        claimed: set[str] = set()
        orphans: list[str] = []
        for g, blob in zip(groups, blobs, strict=True):
            members = (
                None
                if blob is None
                else decode_member_list(bytes(blob) if isinstance(blob, torch.Tensor) else blob)
            )
            whole = (
                members is not None
                and bool(members)
                and members[-1][0] == g.stored
                and all(objects.get(k) == n for k, n in members)
            )
            if not whole or members is None:
                log.warning("tier %s: object group %s is incomplete; deleted", t.name, g.name)
                orphans.append(g.member_list)
                orphans += [k for k, _ in members or () if k in objects]
                claimed.update(k for k, _ in members or ())
                continue
            sizes = dict(members)
            sizes[g.member_list] = records[g]
            self.cascade.ledger.add_ready(tier, g, sizes)
            claimed.update(sizes)
        for k, n in objects.items():
            if k not in claimed:
                self.cascade.ledger.add_ready(
                    tier, ObjectKey(self.namespace, k[len(self.namespace) + 3 :]), {k: n}
                )
        log.info("tier %s: found %d objects", t.name, len(objects))
        return orphans
