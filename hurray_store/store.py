"""TieredStore: the one orchestrator (layer L4).

Two levels. The object level moves keyed objects through the tiers under the policy
(``put_object``, ``get_object``, ``get_object_ranges``, ``contains_object``,
``delete_object``); the LMCache adapter and the server build on it. The prefix level,
on top, stores batches of paged sequences as segments and hands them back re-paged::

    put(pool, token_ids, block_tables)      full pages the store lacks -> segments
      per segment: layer objects (all tiers), then the manifest: the commit point
    lookup(spec, token_ids)                 index only: tokens retrieve can deliver
    retrieve(pool, token_ids)               index -> manifests (verified) -> page byte
                                            ranges (verified) -> pages of ``pool``

Keys, inside the configured namespace ``ns``::

    ns/s/{<segment id hex>}/<layer>     layer object     } one policy group: they
    ns/s/{<segment id hex>}/m           manifest         } enter and leave a tier together
    ns/o/<key>                          object-level key   (a group of its own)

The ``{...}`` is a Redis Cluster hash tag: a segment's objects share one slot.

Everything runs on one event loop; the index and the policy books are only touched
between awaits, so concurrent puts and retrieves on one store are safe. Nothing a tier
does (down, full, corrupt) raises into ``put``/``retrieve``: it is a miss or a skipped
write, counted and logged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
from collections import OrderedDict
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
import xxhash

from hurray_store import keys as keymod
from hurray_store.buffers import BufferPool
from hurray_store.config import StoreConfig, load_config
from hurray_store.errors import ChecksumError, FormatError, PagingError
from hurray_store.format import (
    LayerPlan,
    Manifest,
    ManifestLayer,
    ManifestSeq,
    Slot,
    object_checksum,
    plan_layer,
    quantize_int8,
)
from hurray_store.index import PrefixIndex
from hurray_store.metrics import StoreMetrics
from hurray_store.paging import PagedKVPool, allocate_shared, compact, release_shared
from hurray_store.policy import Policy, TierInfo, Victim
from hurray_store.spec import KVSpec
from hurray_store.tiers import (
    Blob,
    Buffer,
    Range,
    Reservation,
    Tier,
    blob_nbytes,
    host_view,
    open_tier,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
_MANIFEST_CACHE = 1024


@dataclass(frozen=True, slots=True)
class PutResult:
    pages_referenced: int  # full pages over all sequences (a shared page once per sequence)
    pages_written: int  # distinct pages this put wrote
    pages_already_stored: int  # full pages the store held before this put
    segments: int
    bytes_per_tier: dict[str, int]


@dataclass(frozen=True, slots=True)
class RetrieveResult:
    block_tables: list[list[int]]  # per sequence, the pool pages holding its delivered tokens
    num_tokens: list[int]  # per sequence, tokens delivered (whole pages)
    bytes_read: int = 0  # from the tiers
    bytes_delivered: int = 0  # into the pool


@dataclass(frozen=True, slots=True)
class RetrievedLayer:
    """One layer is in the pool. ``block_tables``/``num_tokens`` are as known now; a
    verification failure in a later layer can still shorten them, so the last item
    yielded is the final word."""

    layer_index: int
    block_tables: list[list[int]]
    num_tokens: list[int]


class _Lazy:
    """Buffers built on first use: the store builds a segment's layer objects while
    the previous one is being written (a disk write runs in a worker thread)."""

    __slots__ = ("fn", "value")

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.value: Sequence[Buffer] | None = None

    def get(self) -> Sequence[Buffer]:
        if self.value is None:
            self.value = self.fn()
        return self.value


Items = Mapping[str, "Sequence[Buffer] | _Lazy"]


def _bufs(v: Sequence[Buffer] | _Lazy) -> Sequence[Buffer]:
    return v.get() if isinstance(v, _Lazy) else v


@dataclass(slots=True)
class _Job:
    """One layer object's pages to load for a retrieve."""

    li: int
    seg: bytes
    pl: _Planned
    lay_pos: int
    group: str
    runs: list[tuple[int, int]]
    whole_ok: bool
    borrowed: list[bytearray] = field(default_factory=list)


@dataclass(slots=True)
class _Planned:
    """What a retrieve needs from one segment."""

    manifest: Manifest
    tiers: list[int] = field(default_factory=list)  # holders when the retrieve began
    pages: list[int] = field(default_factory=list)  # segment page ids needed, sorted
    dest: dict[int, int] = field(default_factory=dict)  # segment page -> local dest index
    failed: list[tuple[int, str, str]] = field(default_factory=list)  # (tier, key, why)
    failed_groups: set[tuple[int, str]] = field(default_factory=set)


class TieredStore:
    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.tiers: list[Tier] = [open_tier(t) for t in config.tiers]
        for t in self.tiers:
            t.namespace = config.namespace
        self.policy = Policy(
            [TierInfo(t.name, getattr(c, "capacity_bytes", None), t.persistent) for t, c in zip(self.tiers, config.tiers, strict=True)],
            write_mode=config.policy.write_mode,
            promote_on_hit=config.policy.promote_on_hit,
        )
        self.index = PrefixIndex()
        self.metrics = StoreMetrics([t.name for t in self.tiers], self._gauges)
        self.ns = config.namespace
        self.quantization = None if config.quantization == "none" else config.quantization
        self._manifests: OrderedDict[bytes, Manifest] = OrderedDict()
        self._inflight: dict[bytes, asyncio.Future[None]] = {}
        self._writing: set[tuple[int, str]] = set()
        self._through: dict[str, int] = {}  # group -> write-throughs queued or running
        self._tasks: set[asyncio.Task[None]] = set()
        self._pending_bytes = 0
        self._pending_cv = asyncio.Condition()
        self.buffers = BufferPool()
        self._opened = False

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> TieredStore:
        for t in self.tiers:
            await t.open()
        for i, t in enumerate(self.tiers):
            # A shared tier (a cache server) is not scanned: what it holds is found per
            # request (``_discover``), as other engines keep adding to it.
            if t.persistent and not t.shared:
                await self._rebuild(i)
        self._opened = True
        return self

    async def close(self) -> None:
        try:
            await self.flush()
        finally:
            for t in self.tiers:
                await t.close()

    async def __aenter__(self) -> TieredStore:
        if not self._opened:
            await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def flush(self) -> None:
        """Wait for write-through and promotions in flight; in write-back mode, move
        groups that only volatile tiers hold down to the first persistent tier."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        for group, src, dst in self.policy.flush_targets():
            await self._copy_group(group, src, dst)

    # ------------------------------------------------------------------ keys

    def _layer_key(self, seg_hex: str, layer: int) -> str:
        return keymod.layer_key(self.ns, seg_hex, layer)

    def _manifest_key(self, seg_hex: str) -> str:
        return keymod.manifest_key(self.ns, seg_hex)

    def _obj_key(self, key: str) -> str:
        return keymod.object_key(self.ns, key)

    @staticmethod
    def _seg_group(seg_hex: str) -> str:
        return f"s:{seg_hex}"

    def _salt(self, salt: bytes | str | None) -> bytes:
        s = self.config.salt if salt is None else salt
        b = s.encode() if isinstance(s, str) else bytes(s)
        # int8 pages are not the exact pages: keep them in a hash space of their own.
        return b + b"\x00int8" if self.quantization else b

    # ------------------------------------------------------------------ object level

    async def put_object(self, key: str, data: Buffer | Sequence[Buffer]) -> bool:
        """Store one object (the concatenation of ``data`` when it is a list) in the
        top tier that can hold it, and write-through below. False: stored nowhere."""
        bufs: list[Buffer] = list(data) if isinstance(data, list | tuple) else [data]  # type: ignore[list-item]
        k = self._obj_key(key)
        return bool(await self._put_group(k, {k: bufs}, {k: sum(memoryview(b).nbytes for b in bufs)}, depth=0))

    async def put_objects(self, items: Sequence[tuple[str, Buffer | Sequence[Buffer]]]) -> bool:
        """Store several objects as one group: they enter and leave every tier together,
        and the last one is written after all the others (make it the commit record).
        Redis gets the others in one pipeline. False: stored nowhere."""
        if not items:
            return True
        objs: dict[str, Sequence[Buffer]] = {}
        for key, data in items:
            objs[self._obj_key(key)] = list(data) if isinstance(data, list | tuple) else [data]  # type: ignore[list-item]
        sizes = {k: sum(memoryview(b).nbytes for b in bufs) for k, bufs in objs.items()}
        group = self._obj_key(items[-1][0])
        return bool(await self._put_group(group, objs, sizes, depth=0))

    async def _from_first_holder(self, k: str, op: str, read: Callable[[Tier, str], Awaitable[T | None]], nbytes: Callable[[Any], int]) -> T | None:
        """``read`` a stored key from the fastest tier holding it, with the books and
        metrics kept (a tier that lost it is a miss there: on to the next). A shared
        tier the books do not name is asked last: other engines write to it."""
        holders = self.policy.holders(k)
        for i in holders:
            with self.metrics.timed(self.tiers[i].name, op):
                got = await read(self.tiers[i], k)
            if got is None:
                self._missing(i, k)
                continue
            self._hit(i, nbytes(got))
            self.policy.touch([self.policy.group_of(i, k) or k])
            return got
        for i, t in enumerate(self.tiers):
            if t.shared and i not in holders and t.ready:
                with self.metrics.timed(t.name, op):
                    got = await read(t, k)
                if got is not None:
                    self._hit(i, nbytes(got))
                    return got
        self._miss_all(k)
        return None

    async def get_object(self, key: str) -> Blob | None:
        return await self.get_key(self._obj_key(key))

    async def get_object_ranges(self, key: str, ranges: Sequence[Range]) -> list[Blob] | None:
        got = await self.get_key_ranges(self._obj_key(key), ranges)
        # Copies: a memory tier's views are only valid until its object is evicted.
        return None if got is None else [b.clone() if isinstance(b, torch.Tensor) else bytes(b) for b in got]

    async def contains_object(self, key: str) -> bool:
        return await self.key_size(self._obj_key(key)) is not None

    @property
    def shared(self) -> bool:
        """True when a tier is shared with other processes (a cache server): the books
        then do not know everything the store can read."""
        return any(t.shared for t in self.tiers)

    def has_object(self, key: str) -> bool:
        """``contains_object`` from the books alone, without a trip to the store's loop
        or a shared tier: safe from another thread (membership tests of dicts are
        atomic in CPython)."""
        return bool(self.policy.holders(self._obj_key(key)))

    async def read_object_into(self, key: str, ranges: Sequence[Range], buffers: Sequence[memoryview]) -> bool:
        """Fill ``buffers[i]`` with range ``i`` of an object-level object, from the
        fastest tier holding it (a disk tier reads straight into them). False: a miss."""
        got = await self._from_first_holder(
            self._obj_key(key), "get_ranges", lambda t, k: t.get_ranges(k, ranges, list(buffers)), lambda _: sum(len(b) for b in buffers)
        )
        if got is None:
            return False
        for dst, src in zip(buffers, got, strict=True):
            if src is not dst:  # a tier that did not read into the buffers
                dst[:] = host_view(src)
        return True

    def pin_objects(self, keys: Sequence[str]) -> None:
        """Keep object-level keys from eviction until ``unpin_objects`` (LMCache's pin)."""
        self.policy.pin(self._obj_key(k) for k in keys)

    def unpin_objects(self, keys: Sequence[str]) -> None:
        self.policy.unpin(self._obj_key(k) for k in keys)

    async def delete_object(self, key: str) -> None:
        """Delete an object-level key everywhere; a key stored with ``put_objects``
        takes its whole group with it."""
        await self.delete_key(self._obj_key(key))

    # ------------------------------------------------------------------ stored keys
    #
    # What the cache server serves: keys as the tiers store them. A client's segment
    # keys in this store's namespace are kept as they are (so a restart finds them as
    # segments); any other key a client names is kept as an object-level key.

    def storage_key(self, client_key: str) -> str:
        seg = keymod.parse_segment_key(client_key)
        return client_key if seg is not None and seg[0] == self.ns else self._obj_key(client_key)

    async def get_key(self, k: str) -> Blob | None:
        return await self._from_first_holder(k, "get", lambda t, kk: t.get(kk), blob_nbytes)

    async def get_key_ranges(self, k: str, ranges: Sequence[Range], into: Any = None) -> list[Blob] | None:
        """Views of the tier's bytes (valid while the key's group is pinned) or of
        ``into``."""
        return await self._from_first_holder(
            k, "get_ranges", lambda t, kk: t.get_ranges(kk, ranges, into), lambda parts: sum(blob_nbytes(b) for b in parts)
        )

    async def key_size(self, k: str) -> int | None:
        """Size of a stored key from the books, else from a shared tier; None: absent."""
        for i in self.policy.holders(k):
            g = self.policy.group_of(i, k)
            if g is not None:
                return self.policy.group_keys(i, g).get(k)
        for t in self.tiers:
            if t.shared and t.ready:
                n = (await t.sizes([k]))[0]
                if n is not None:
                    return n
        return None

    def pin_keys(self, keys: Sequence[str]) -> list[str]:
        """Pin the groups holding ``keys`` (a segment key pins its segment); returns
        them, for ``unpin_groups``."""
        groups = list(dict.fromkeys(self.policy.group_of(i, k) or k for k in keys for i in self.policy.holders(k)))
        self.policy.pin(groups)
        return groups

    def unpin_groups(self, groups: Sequence[str]) -> None:
        self.policy.unpin(groups)

    def reserve(self, nbytes: int) -> Reservation | None:
        """Space in the tier a new object of ``nbytes`` lands in, to build or receive it
        in place; pass it to ``put_key``/``commit_segment`` (None: that tier offers
        none). Space never published goes back with ``reservation.tier.unreserve``."""
        got = self._reserve(self.policy.place(nbytes), [nbytes])
        return got[0] if got else None

    async def put_key(
        self, k: str, data: Sequence[Buffer], release: Callable[[], None] | None = None, reserved: Reservation | None = None,
    ) -> bool:
        """Store one object under a stored key (a group of its own); ``release()`` runs
        once no tier write needs ``data`` any more. ``reserved``: ``data`` lies in this
        reservation, which the top tier then publishes without a copy."""
        seg = keymod.parse_segment_key(k)
        if seg is not None and seg[0] == self.ns:
            if release is not None:
                release()
            raise FormatError(f"{k} is a segment object: it is stored by commit_segment with its manifest")
        return bool(await self._put_group(
            k, {k: data}, {k: sum(memoryview(b).nbytes for b in data)}, depth=0, release=release,
            reserved={k: reserved} if reserved is not None else None,
        ))

    async def delete_key(self, k: str) -> None:
        """Delete a stored key everywhere, with its whole group."""
        groups = {self.policy.group_of(i, k) or k for i in self.policy.holders(k)}
        # A write-through of this object still in flight would put it back in a lower
        # tier after the delete: let it land first, then delete everywhere.
        while groups & self._through.keys():
            await asyncio.sleep(0.001)
        holders = self.policy.holders(k)
        for i in holders:
            group = self.policy.group_of(i, k) or k
            # The whole group: a tier never keeps part of one (see put_objects).
            for kk in self.policy.forget(i, group) or {k: 0}:
                await self.tiers[i].delete(kk)
            self._after_group_left(group)
        for i, t in enumerate(self.tiers):
            if t.shared and i not in holders and t.ready:
                await t.delete(k)

    async def commit_segment(
        self, manifest_key: str, manifest: Buffer, objects: Mapping[str, Buffer], release: Callable[[], None] | None = None,
        reserved: Mapping[str, Reservation] | None = None, *, parsed: Manifest | None = None,
    ) -> bool:
        """Store a segment a client built: its layer objects, then its manifest (the
        commit). Everything is verified first: the manifest's checksum and key, each
        object's size and every page's checksum. Raises FormatError (nothing stored)
        when any of it is wrong; returns False when no tier took it, True when stored
        or already held. ``parsed``: ``Manifest.from_bytes(manifest)``, when the caller
        has it already."""
        try:
            seg = keymod.parse_segment_key(manifest_key)
            if seg is None or seg[2] != keymod.MANIFEST_PART:
                raise FormatError(f"{manifest_key!r} is not a segment manifest key")
            if seg[0] != self.ns:
                raise FormatError(f"namespace {seg[0]!r} is not this store's ({self.ns!r})")
            m = parsed if parsed is not None else Manifest.from_bytes(manifest)
            seg_hex = m.segment_id.hex()
            if seg_hex != seg[1]:
                raise FormatError(f"manifest names segment {seg_hex}, committed as {seg[1]}")
            want = {self._layer_key(seg_hex, lay.layer_index): pos for pos, lay in enumerate(m.layers)}
            if len(want) != len(m.layers) or set(want) != set(objects):
                missing = sorted(set(want) - set(objects))
                extra = sorted(set(objects) - set(want))
                raise FormatError(f"segment {seg_hex}: layer objects missing {missing[:3]} or not in the manifest {extra[:3]}")
            for k, pos in want.items():
                why = m.verify_object(pos, objects[k])
                if why:
                    raise ChecksumError(f"segment {seg_hex}: {why}")
        except BaseException:
            if release is not None:
                release()
            raise
        group = self._seg_group(seg_hex)
        if self.policy.group_holders(group):
            if release is not None:
                release()
            return True
        items: dict[str, Sequence[Buffer]] = {k: [objects[k]] for k in want}
        items[manifest_key] = [manifest]
        sizes = {k: memoryview(v[0]).nbytes for k, v in items.items()}

        def commit() -> None:
            self._index_manifest(m)
            self._cache_manifest(m)

        return bool(await self._put_group(group, items, sizes, depth=_depth(m), commit=commit, release=release, reserved=reserved))

    async def find_segments(self, seqs: Sequence[tuple[int, Sequence[bytes]]], max_bytes: int) -> tuple[list[int], list[bytes]]:
        """Per sequence (pages the asker has, page hashes): the leading pages this store
        holds, and the manifests of the segments holding them past what the asker has
        (at most ``max_bytes`` of them; a sequence's match stops where they stop)."""
        matched: list[int] = []
        wanted: dict[bytes, None] = {}
        runs: list[list[bytes]] = []
        for have, hashes in seqs:
            mt = self.index.longest_prefix(list(hashes))
            matched.append(mt.num_pages)
            runs.append(mt.segment_ids)
            for sid in mt.segment_ids[have:]:
                wanted.setdefault(sid)
        out: dict[bytes, bytes] = {}
        total = 0
        for sid in wanted:
            blob = await self._manifest_bytes(sid)
            if blob is None or total + len(blob) > max_bytes:
                continue
            out[sid] = blob
            total += len(blob)
        for s, (have, _) in enumerate(seqs):
            ids = runs[s]
            cut = next((j for j in range(have, len(ids)) if ids[j] not in out), len(ids))
            matched[s] = min(matched[s], cut)
        return matched, list(out.values())

    async def _manifest_bytes(self, seg: bytes) -> bytes | None:
        m = self._manifests.get(seg)
        if m is not None:
            return m.to_bytes()
        got = await self._read_manifest(seg.hex())
        if got is None:
            return None
        self._cache_manifest(got[0])
        return bytes(host_view(got[1]))

    async def _read_manifest(self, seg_hex: str) -> tuple[Manifest, Blob] | None:
        """A segment's manifest (parsed, checked against its key) and its bytes, from
        the fastest tier holding a good one."""
        key = self._manifest_key(seg_hex)
        for i in self.policy.holders(key):
            blob = await self.tiers[i].get(key)
            if blob is None:
                self._missing(i, key)
                continue
            self._hit(i, blob_nbytes(blob))
            m = self._parse_manifest(i, seg_hex, blob)
            if m is not None:
                return m, blob
        return None

    async def _discover(self, spec: KVSpec, hashes: Sequence[Sequence[bytes]], *, claim: bool) -> None:
        """Ask each shared tier (a cache server other engines write to) for the segments
        holding pages past what the index knows, and index them as held there. With
        ``claim``, the server also reserves the pages nobody holds for this put (another
        engine's put of them waits for it, so a page is stored once)."""
        for i, t in enumerate(self.tiers):
            if not t.shared or not t.ready:
                continue
            have = [self.index.longest_prefix(list(hs)).num_pages for hs in hashes]
            ask = [(h, list(hs)) for h, hs in zip(have, hashes, strict=True)]
            if all(h == len(hs) for h, hs in ask):
                return  # the index knows every page already
            got = await t.lookup_prefix(ask, claim=claim)
            if got is None:
                continue
            for blob in got:
                try:
                    m = Manifest.from_bytes(blob)
                except FormatError as e:
                    self.metrics.tiers[t.name].verification_failures += 1
                    log.warning("tier %s: a manifest it sent is invalid (%s); ignored", t.name, e)
                    continue
                seg_hex = m.segment_id.hex()
                if _mismatch(m, spec) or any(lay.key != self._layer_key(seg_hex, lay.layer_index) for lay in m.layers):
                    continue  # another model's, or foreign keys: not ours to read
                group = self._seg_group(seg_hex)
                if i in self.policy.group_holders(group):
                    continue
                sizes = {lay.key: lay.object_size for lay in m.layers}
                sizes[self._manifest_key(seg_hex)] = len(blob)
                self.policy.record(i, group, sizes, depth=_depth(m))
                self._index_manifest(m)
                self._cache_manifest(m)

    def _hit(self, tier: int, nbytes: int) -> None:
        c = self.metrics.tiers[self.tiers[tier].name]
        c.hits += 1
        c.bytes_read += nbytes

    def _miss_all(self, key: str) -> None:
        for t in self.tiers:
            self.metrics.tiers[t.name].misses += 1

    def _missing(self, tier: int, key: str) -> None:
        """A tier the books say holds ``key`` does not have it (expired, evicted by
        Redis, deleted by hand): drop the books' entry unless a write is on its way."""
        self.metrics.tiers[self.tiers[tier].name].misses += 1
        group = self.policy.group_of(tier, key)
        if group is not None and (tier, group) not in self._writing and self.tiers[tier].available:
            self.policy.forget(tier, group)
            self._after_group_left(group)

    # ------------------------------------------------------------------ groups

    async def _put_group(
        self, group: str, items: Items, sizes: dict[str, int], *, depth: int, commit: Any = None, release: Any = None,
        reserved: Mapping[str, Reservation] | None = None,
    ) -> list[int]:
        """Write a group to the first tier that takes it, run ``commit()`` (the index
        insert), then write it through to the lower tiers in the background. Returns
        the tiers written or queued (empty: stored nowhere). ``release()`` runs when no
        write needs the buffers any more."""
        total = sum(sizes.values())
        start = self.policy.place(total)
        top = None
        if start is not None:
            for i in range(start, len(self.tiers)):
                if await self._write_group(i, group, items, sizes, depth, reserved):
                    top = i
                    break
        if top is None:
            log.warning("group %s (%d bytes) stored in no tier", group, total)
            if release is not None:
                release()
            return []
        if commit is not None:
            commit()
        targets = self.policy.write_through_targets(top)
        if targets:
            async with self._pending_cv:
                await self._pending_cv.wait_for(
                    lambda: self._pending_bytes == 0 or self._pending_bytes + total <= self.config.policy.max_pending_bytes
                )
                self._pending_bytes += total
            self._through[group] = self._through.get(group, 0) + 1
            # The lower tiers read the top tier's copy when it was built in place: keep
            # it from being evicted (and its space reused) until they have it.
            self.policy.pin([group])
            self._spawn(self._write_through(group, items, sizes, depth, targets, total, release))
        elif release is not None:
            release()
        return [top, *targets]

    async def _write_through(self, group: str, items: Items, sizes: dict[str, int], depth: int, targets: list[int], total: int, release: Any) -> None:
        try:
            for i in targets:
                await self._write_group(i, group, items, sizes, depth)
        finally:
            self.policy.unpin([group])
            if release is not None:
                release()
            n = self._through.pop(group, 1) - 1
            if n:
                self._through[group] = n
            self._after_group_left(group)  # the put's top tier may have evicted it meanwhile
            async with self._pending_cv:
                self._pending_bytes -= total
                self._pending_cv.notify_all()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write_group(
        self, tier: int, group: str, items: Items, sizes: dict[str, int], depth: int,
        reserved: Mapping[str, Reservation] | None = None,
    ) -> bool:
        """Admit, evict what the policy says, write the objects: all but the last
        together (a thread each on disk, one pipeline on Redis), then the last, the
        group's commit point. On any failure the tier holds none of it."""
        t = self.tiers[tier]
        c = self.metrics.tiers[t.name]
        if not t.ready:
            c.skipped_writes += 1
            return False
        adm = self.policy.admit(tier, group, sizes, depth=depth)
        if not adm.accepted:
            c.skipped_writes += 1
            log.info("tier %s: skipped %s: %s", t.name, group, adm.reason)
            return False
        self._writing.add((tier, group))
        keys = list(items)
        ok = False
        try:
            await self._evict(tier, adm.victims)
            for batch in (keys[:-1], keys[-1:]):
                tasks: list[asyncio.Future[bool]] = []
                try:
                    for k in batch:
                        bufs = _bufs(items[k])  # a lazy object is built now, beside the last write
                        res = reserved.get(k) if reserved else None
                        if res is not None and res.tier is t and not res.committed:
                            tasks.append(asyncio.ensure_future(t.put_reserved(k, res)))
                        else:
                            tasks.append(asyncio.ensure_future(self._timed_put(t, k, bufs)))
                        await asyncio.sleep(0)  # let the write start (a disk write goes to a thread)
                finally:
                    oks = await asyncio.gather(*tasks, return_exceptions=True)
                errs = [o for o in oks if isinstance(o, BaseException)]
                if errs or not all(oks):
                    self.policy.forget(tier, group)
                    await t.delete_many(keys)
                    if errs:
                        raise errs[0]
                    c.skipped_writes += 1
                    return False
            c.bytes_written += sum(sizes.values())
            ok = True
            return True
        finally:
            self._writing.discard((tier, group))
            if not ok and group in self.policy.groups(tier):  # an exception left it half-written
                self.policy.forget(tier, group)
                await t.delete_many(keys)

    async def _timed_put(self, t: Tier, key: str, bufs: Sequence[Buffer]) -> bool:
        with self.metrics.timed(t.name, "put"):
            return await t.put(key, bufs)

    async def _evict(self, tier: int, victims: Iterable[Victim]) -> None:
        t = self.tiers[tier]
        for v in victims:
            if v.demote_to is not None:
                items = await self._read_group(tier, v.sizes)
                if items is not None:
                    await self._write_group(v.demote_to, v.group, items, dict(v.sizes), self.policy.depth(v.group))
            for k in v.sizes:
                await t.delete(k)
            self.metrics.tiers[t.name].evictions += len(v.sizes)
            self._after_group_left(v.group)

    async def _read_group(self, tier: int, sizes: Mapping[str, int]) -> dict[str, list[Buffer]] | None:
        t = self.tiers[tier]
        out: dict[str, list[Buffer]] = {}
        for k, n in sizes.items():
            got = await t.get(k)
            if got is None or blob_nbytes(got) != n:
                return None
            out[k] = [host_view(got)]
        return out

    async def _copy_group(self, group: str, src: int, dst: int) -> None:
        sizes = self.policy.group_keys(src, group)
        items = await self._read_group(src, sizes)
        if items is not None:
            await self._write_group(dst, group, items, sizes, self.policy.depth(group))

    def _after_group_left(self, group: str) -> None:
        """A group left a tier; a segment no tier holds leaves the index."""
        if group.startswith("s:") and not self.policy.group_holders(group) and group not in self._through:
            seg = bytes.fromhex(group[2:])
            self.index.remove_segment(seg)
            self._manifests.pop(seg, None)

    # ------------------------------------------------------------------ restart

    async def _rebuild(self, tier: int) -> None:
        """Books and index from what a persistent tier holds: committed segments are
        recorded; layer objects without a manifest (a writer killed before its commit)
        are deleted; bad manifests are quarantined."""
        t = self.tiers[tier]
        seg_root = f"{self.ns}/s/{{"
        obj_root = f"{self.ns}/o/"
        segs: dict[str, dict[str, int]] = {}
        n_obj = 0
        async for key, size in t.scan():
            if key.startswith(seg_root):
                seg_hex = key[len(seg_root) :].split("}", 1)[0]
                segs.setdefault(seg_hex, {})[key] = size
            elif key.startswith(obj_root):
                self.policy.record(tier, key, {key: size})
                n_obj += 1
        with_manifest = [h for h, ks in segs.items() if self._manifest_key(h) in ks]
        orphans = [k for h, ks in segs.items() if self._manifest_key(h) not in ks for k in ks]
        found = 0
        batch = 1024
        entries: list[tuple[bytes, int, int, Sequence[bytes]]] = []
        parts = [with_manifest[b : b + batch] for b in range(0, len(with_manifest), batch)]
        # Read the next batch of manifests (in a thread, on disk) while parsing this one.
        nxt = asyncio.ensure_future(t.get_many([self._manifest_key(h) for h in parts[0]])) if parts else None
        for i, part in enumerate(parts):
            assert nxt is not None
            blobs = await nxt
            nxt = asyncio.ensure_future(t.get_many([self._manifest_key(h) for h in parts[i + 1]])) if i + 1 < len(parts) else None
            for seg_hex, blob in zip(part, blobs, strict=True):
                m = self._parse_manifest(tier, seg_hex, blob)
                have = segs[seg_hex]
                if m is None or any(have.get(lay.key) != lay.object_size for lay in m.layers):
                    if m is not None:
                        log.warning("tier %s: segment %s lacks layer objects; dropped", t.name, seg_hex)
                    orphans += [k for k in have if k != self._manifest_key(seg_hex)]
                    continue
                self.policy.record(tier, self._seg_group(seg_hex), have, depth=_depth(m))
                entries += _index_entries(m)
                found += 1
        self.index.insert_many(entries)
        if orphans:
            await t.delete_many(orphans)
        log.info("tier %s: found %d segments and %d objects; removed %d uncommitted objects", t.name, found, n_obj, len(orphans))

    def _parse_manifest(self, tier: int, seg_hex: str, blob: Blob | None) -> Manifest | None:
        if blob is None:
            return None
        try:
            m = Manifest.from_bytes(host_view(blob))
            if m.segment_id.hex() != seg_hex:
                raise FormatError(f"manifest names segment {m.segment_id.hex()}, stored as {seg_hex}")
            if any(lay.key != self._layer_key(seg_hex, lay.layer_index) for lay in m.layers):
                raise FormatError("manifest names layer objects outside its segment")
            return m
        except FormatError as e:
            self._verification_failed(tier, self._seg_group(seg_hex), self._manifest_key(seg_hex), f"manifest: {e}")
            return None

    def _verification_failed(self, tier: int, group: str, key: str, why: str) -> None:
        t = self.tiers[tier]
        self.metrics.tiers[t.name].verification_failures += 1
        log.warning("tier %s: %s failed verification (%s); quarantined, treated as a miss", t.name, key, why)
        sizes = self.policy.forget(tier, group)
        self._spawn(self._quarantine(tier, key, [k for k in sizes if k != key]))
        self._after_group_left(group)

    async def _quarantine(self, tier: int, key: str, others: list[str]) -> None:
        t = self.tiers[tier]
        await t.quarantine(key)
        if others:
            await t.delete_many(others)

    def _index_manifest(self, m: Manifest) -> None:
        self.index.insert_many(_index_entries(m))

    # ------------------------------------------------------------------ prefix level: put

    async def put(
        self,
        pool: PagedKVPool,
        token_ids: Sequence[Sequence[int]],
        block_tables: Sequence[Sequence[int]],
        seq_lens: Sequence[int] | None = None,
        *,
        salt: bytes | str | None = None,
    ) -> PutResult:
        """Store the full pages of these sequences that the store does not hold yet.

        ``token_ids[s]`` are the tokens whose KV sits in ``block_tables[s]``'s pages;
        ``seq_lens[s]`` (default ``len(token_ids[s])``) of them are valid. Only full
        pages are stored (only they can be matched). Raises PagingError for malformed
        input; a tier failing is a skipped write, never an exception.
        """
        spec = pool.spec
        P = spec.page_size
        if len(token_ids) != len(block_tables):
            raise PagingError(f"{len(token_ids)} token lists but {len(block_tables)} block tables")
        lens = [len(t) for t in token_ids] if seq_lens is None else list(seq_lens)
        if len(lens) != len(token_ids):
            raise PagingError(f"{len(token_ids)} sequences but {len(lens)} seq_lens")
        for s, (seq_toks, n) in enumerate(zip(token_ids, lens, strict=True)):
            if not 0 <= n <= len(seq_toks):
                raise PagingError(f"sequence {s}: seq_len {n} outside [0, {len(seq_toks)} tokens]")
            if len(block_tables[s]) < n // P:
                raise PagingError(f"sequence {s}: {n // P} full pages need a block table of at least that length, got {len(block_tables[s])}")
            bad = [p for p in block_tables[s][: n // P] if not 0 <= int(p) < pool.num_blocks]
            if bad:
                raise PagingError(f"sequence {s}: page id {bad[0]} is outside the pool's [0, {pool.num_blocks})")
        salt_b = self._salt(salt)
        toks: list[np.ndarray] = [keymod.token_array(t[: (n // P) * P]) for t, n in zip(token_ids, lens, strict=True)]
        hashes = [keymod.page_hashes(spec, t, salt=salt_b) for t in toks]  # type: ignore[arg-type]
        await self._discover(spec, hashes, claim=True)
        # Wait for concurrent puts of the same pages, so a page is written once.
        while True:
            waits = {self._inflight[h] for hs in hashes for h in hs if h in self._inflight}
            if not waits:
                break
            await asyncio.gather(*(asyncio.shield(w) for w in waits), return_exceptions=True)
        firsts = []
        already = 0
        for hs in hashes:
            present = self.index.contains_many(hs)
            missing = np.flatnonzero(~present)
            firsts.append(int(missing[0]) if missing.size else len(hs))
            already += int(present.sum())
        referenced = sum(len(hs) for hs in hashes)
        # Claim the pages this put writes (first claim wins inside the batch too).
        claimed: dict[bytes, tuple[int, int]] = {}  # hash -> (seq, position) of its first use
        loop = asyncio.get_running_loop()
        mine: dict[bytes, asyncio.Future[None]] = {}
        for s, hs in enumerate(hashes):
            for i in range(firsts[s], len(hs)):
                if hashes[s][i] not in claimed:
                    claimed[hashes[s][i]] = (s, i)
                    fut = loop.create_future()
                    mine[hashes[s][i]] = fut
                    self._inflight[hashes[s][i]] = fut
        bytes_per_tier = {t.name: 0 for t in self.tiers}
        written = 0
        nseg = 0
        try:
            for group in self._split(spec, hashes, firsts):
                n_w, per_tier = await self._put_segment(pool, group, toks, hashes, firsts, claimed, block_tables)
                written += n_w
                nseg += 1 if n_w else 0
                for k, v in per_tier.items():  # written, or queued for write-through
                    bytes_per_tier[k] += v
        finally:
            for h, fut in mine.items():
                self._inflight.pop(h, None)
                fut.set_result(None)
        return PutResult(referenced, written, already, nseg, bytes_per_tier)

    def _split(self, spec: KVSpec, hashes: list[list[bytes]], firsts: list[int]) -> list[list[int]]:
        """Sequences with pages to write, grouped into segments: sequences that share
        a page to write stay together; groups are packed up to max_segment_bytes."""
        todo = [s for s in range(len(hashes)) if firsts[s] < len(hashes[s])]
        parent = {s: s for s in todo}

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        owner: dict[bytes, int] = {}
        for s in todo:
            for h in hashes[s][firsts[s] :]:
                if h in owner:
                    parent[find(s)] = find(owner[h])
                else:
                    owner[h] = s
        comps: dict[int, list[int]] = {}
        for s in todo:
            comps.setdefault(find(s), []).append(s)
        page_cost = 2 * spec.page_bytes * spec.num_layers
        out: list[list[int]] = []
        cur: list[int] = []
        cur_pages: set[bytes] = set()
        for comp in comps.values():
            pages = {h for s in comp for h in hashes[s][firsts[s] :]}
            if cur and len(cur_pages | pages) * page_cost > self.config.max_segment_bytes:
                out.append(cur)
                cur, cur_pages = [], set()
            cur += comp
            cur_pages |= pages
        if cur:
            out.append(cur)
        return out

    async def _put_segment(
        self,
        pool: PagedKVPool,
        seqs: list[int],
        toks: list[np.ndarray],
        hashes: list[list[bytes]],
        firsts: list[int],
        claimed: dict[bytes, tuple[int, int]],
        block_tables: Sequence[Sequence[int]],
    ) -> tuple[int, dict[str, int]]:
        spec = pool.spec
        P = spec.page_size
        # A page is taken from the pool page of its hash's first use, so equal content
        # is one page even when the engine did not share it.
        vtables = []
        for s in seqs:
            row = []
            for i in range(firsts[s], len(hashes[s])):
                cs, ci = claimed[hashes[s][i]]
                row.append(int(block_tables[cs][ci]))
            vtables.append(row)
        distinct, compacted, inverse = compact(vtables)
        n = int(distinct.numel())
        seq_ptr = torch.tensor(np.cumsum([0] + [len(r) for r in vtables]), dtype=torch.long)
        plans = [
            plan_layer(li, inverse, seq_ptr, num_pages=n, page_size=P, heads=spec.num_kv_heads, dim=spec.head_dim,
                       dtype=spec.dtype, quantization=self.quantization)
            for li in range(spec.num_layers)
        ]
        seg_id = _segment_id([hashes[s][-1] for s in seqs], [firsts[s] for s in seqs])
        seg_hex = seg_id.hex()
        sizes = [p.nbytes for p in plans]
        keys = [self._layer_key(seg_hex, li) for li in range(spec.num_layers)]
        # The manifest without its checksums: its size is known now, its checksums
        # once the layers are built.
        m0 = Manifest(
            fingerprint=spec.fingerprint(),
            segment_id=seg_id,
            quantization=self.quantization,
            page_size=P,
            num_pages=n,
            page_bytes=plans[0].page_bytes,
            scale_bytes=plans[0].scale_bytes,
            sequences=tuple(
                ManifestSeq(tuple(toks[s].tolist()), firsts[s], int(toks[s].size), tuple(hashes[s][firsts[s] :]), tuple(compacted[j]))
                for j, s in enumerate(seqs)
            ),
            layers=tuple(
                ManifestLayer(li, keys[li], p.nbytes, 0, p.key_pool_offset, p.value_pool_offset, p.key_scales_offset,
                              p.value_scales_offset, (0,) * n, (0,) * n)
                for li, p in enumerate(plans)
            ),
        )
        mkey = self._manifest_key(seg_hex)
        size_of = {**dict(zip(keys, sizes, strict=True)), mkey: m0.encoded_size()}
        # Each object is built in its final place: space reserved in the top tier (the
        # cpu arena: pages go from the pool straight into the tier), else a resident
        # buffer borrowed until every tier write is done. Objects are built lazily, the
        # next while the last is being written.
        top = self.policy.place(sum(size_of.values()))
        reserved = self._reserve(top, sizes)
        buf: bytearray | None = None
        if reserved is None:
            buf = self.buffers.acquire(sum(sizes))
            views, pos = [], 0
            for size in sizes:
                views.append(memoryview(buf)[pos : pos + size])
                pos += size
        else:
            views = [r.view for r in reserved]
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            if buf is not None:
                self.buffers.release(buf)
            for r in reserved or []:
                if not r.committed:
                    r.tier.unreserve(r)

        idx = distinct.to(pool.device)
        built: dict[int, ManifestLayer] = {}
        done: list[Manifest] = []

        def build_layer(li: int) -> list[Buffer]:
            plan, out = plans[li], views[li]
            plan.write_fixed(out)
            obj_sum, kc, vc = _fill_pages(pool, li, idx, plan, out)
            built[li] = dataclasses.replace(m0.layers[li], object_checksum=obj_sum, key_page_checksums=kc, value_page_checksums=vc)
            return [out]

        def build_manifest() -> list[Buffer]:
            done.append(dataclasses.replace(m0, layers=tuple(built[li] for li in range(spec.num_layers))))
            return [done[0].to_bytes()]

        items: dict[str, Sequence[Buffer] | _Lazy] = {k: _Lazy(functools.partial(build_layer, li)) for li, k in enumerate(keys)}
        items[mkey] = _Lazy(build_manifest)
        by_key = None if reserved is None else dict(zip(keys, reserved, strict=True))

        def commit() -> None:
            self._index_manifest(done[0])
            self._cache_manifest(done[0])

        try:
            where = await self._put_group(self._seg_group(seg_hex), items, size_of, depth=_depth(m0), commit=commit, release=release, reserved=by_key)
        except BaseException:
            release()
            raise
        total = sum(size_of.values())
        return (n if where else 0), {self.tiers[i].name: total for i in where}

    def _reserve(self, top: int | None, sizes: list[int]) -> list[Reservation] | None:
        if top is None:
            return None
        t = self.tiers[top]
        out: list[Reservation] = []
        for size in sizes:
            r = t.reserve(size)
            if r is None:
                for done in out:
                    t.unreserve(done)
                return None
            out.append(r)
        return out

    def _cache_manifest(self, m: Manifest) -> None:
        self._manifests[m.segment_id] = m
        self._manifests.move_to_end(m.segment_id)
        while len(self._manifests) > _MANIFEST_CACHE:
            self._manifests.popitem(last=False)

    # ------------------------------------------------------------------ prefix level: read

    async def lookup(self, spec: KVSpec, token_ids: Sequence[Sequence[int]], *, salt: bytes | str | None = None) -> list[int]:
        """Per sequence, the leading tokens (whole pages) ``retrieve`` can deliver now."""
        salt_b = self._salt(salt)
        hashes = [keymod.page_hashes(spec, t, salt=salt_b) for t in token_ids]
        await self._discover(spec, hashes, claim=False)
        return [self.index.longest_prefix(hs).num_pages * spec.page_size for hs in hashes]

    async def retrieve(self, pool: PagedKVPool, token_ids: Sequence[Sequence[int]], *, salt: bytes | str | None = None) -> RetrieveResult:
        """Re-page the longest stored prefix of each sequence into ``pool``."""
        stream = self._retrieve(pool, token_ids, salt)
        try:
            async for item in stream:
                if isinstance(item, RetrieveResult):
                    return item
        finally:
            await stream.aclose()  # runs the generator's cleanup (unpin) now, not at GC
        raise AssertionError("retrieve ended without a result")  # pragma: no cover

    async def retrieve_layers(self, pool: PagedKVPool, token_ids: Sequence[Sequence[int]], *, salt: bytes | str | None = None) -> AsyncIterator[RetrievedLayer]:
        """``retrieve``, one layer at a time: each item says that layer is in the pool.
        Closing the iteration early gives every allocated page back to ``pool``."""
        stream = self._retrieve(pool, token_ids, salt)
        try:
            async for item in stream:
                if isinstance(item, RetrievedLayer):
                    yield item
        finally:
            await stream.aclose()

    async def _retrieve(self, pool: PagedKVPool, token_ids: Sequence[Sequence[int]], salt: bytes | str | None) -> AsyncGenerator[RetrievedLayer | RetrieveResult, None]:
        spec = pool.spec
        P = spec.page_size
        salt_b = self._salt(salt)
        toks = [keymod.token_array(t) for t in token_ids]
        hashes = [keymod.page_hashes(spec, t, salt=salt_b) for t in toks]  # type: ignore[arg-type]
        await self._discover(spec, hashes, claim=False)
        matches = [self.index.longest_prefix(hs) for hs in hashes]
        # Plan: per sequence the (segment, segment page) of each matched position.
        plans: dict[bytes, _Planned | None] = {}
        for mt in matches:
            for seg in dict.fromkeys(mt.segment_ids):
                if seg not in plans:
                    plans[seg] = None
        groups = [self._seg_group(s.hex()) for s in plans]
        self.policy.pin(groups)
        try:
            for seg in plans:
                m = await self._manifest(seg, spec)
                plans[seg] = None if m is None else _Planned(m)
            refs: list[list[tuple[bytes, int]]] = []
            for s, mt in enumerate(matches):
                row: list[tuple[bytes, int]] = []
                for seg, q, pos in zip(mt.segment_ids, mt.seqs.tolist(), mt.pages.tolist(), strict=True):
                    pl = plans[seg]
                    if pl is None:
                        break
                    ms = pl.manifest.sequences[q]
                    j = pos - ms.first_page
                    if not 0 <= j < len(ms.block_table) or ms.token_ids[pos * P : (pos + 1) * P] != tuple(toks[s][pos * P : (pos + 1) * P].tolist()):
                        self._verification_failed_all(seg, "token ids differ from the request's")
                        plans[seg] = None
                        break
                    row.append((seg, ms.block_table[j]))
                refs.append(row)
            # Drop references into segments that failed after a row was built.
            refs = [_cut(row, plans) for row in refs]
            distinct: dict[tuple[bytes, int], int] = {}
            local = [[distinct.setdefault(r, len(distinct)) for r in row] for row in refs]
            for (seg, page), d in distinct.items():
                pl = plans[seg]
                assert pl is not None
                pl.dest[page] = d
            for seg, pl in plans.items():
                if pl is not None:
                    pl.pages = sorted(pl.dest)
                    pl.tiers = self.policy.group_holders(self._seg_group(seg.hex()))
            n = len(distinct)
            new_ids = allocate_shared(pool, local, n)
            self.policy.touch(self._seg_group(s.hex()) for s in plans if plans[s] is not None)
            bad: set[int] = set()
            read_bytes = 0
            ahead: asyncio.Future[Any] | None = None
            jobs: list[_Job] = []
            k = 0
            whole_reads: dict[bytes, set[int]] = {}
            try:
                dst = torch.tensor(new_ids, dtype=torch.long, device=pool.device)
                jobs = [self._layer_job(li, seg, pl) for li in range(spec.num_layers) for seg, pl in plans.items() if pl is not None and pl.pages]
                # Read one job ahead: the next layer's bytes arrive (a disk read runs in
                # a thread) while this one is verified and copied.
                ahead = asyncio.ensure_future(self._prefetch(jobs[0])) if jobs else None
                k = 0
                for li in range(spec.num_layers):
                    while k < len(jobs) and jobs[k].li == li:
                        job = jobs[k]
                        assert ahead is not None
                        first = await ahead
                        k += 1
                        ahead = asyncio.ensure_future(self._prefetch(jobs[k])) if k < len(jobs) else None
                        try:
                            nb, whole_tier = await self._load_layer(pool, job, dst, bad, first)
                        finally:
                            for b in job.borrowed:
                                self.buffers.release(b)
                        read_bytes += nb
                        if whole_tier is not None:
                            whole_reads.setdefault(job.seg, set()).add(whole_tier)
                        else:
                            whole_reads[job.seg] = {-1}
                    yield RetrievedLayer(li, *self._delivered(local, new_ids, bad, P))
            except BaseException:
                if ahead is not None:
                    ahead.cancel()
                    await asyncio.gather(ahead, return_exceptions=True)
                    if k < len(jobs):
                        for b in jobs[k].borrowed:
                            self.buffers.release(b)
                release_shared(pool, new_ids, local)
                raise
            # Truncate each sequence at its first bad page and give back what it loses.
            lost = []
            for t in local:
                cut = _first_bad(t, bad)
                keep = set(t[:cut])
                lost += [new_ids[d] for d in set(t[cut:]) - keep]
                del t[cut:]
            if lost:
                pool.free(lost)
            tables = [[new_ids[d] for d in t] for t in local]
            for seg, pl in plans.items():
                for tier, key, why in pl.failed if pl is not None else []:
                    self._verification_failed(tier, self._seg_group(seg.hex()), key, why)
            delivered = len({d for t in local for d in t})
            for seg, tiers in whole_reads.items():
                pl = plans[seg]
                if pl is not None and len(tiers) == 1 and (ti := next(iter(tiers))) > 0:
                    self._promote(seg, ti)
            yield RetrieveResult(tables, [len(t) * P for t in tables], read_bytes, delivered * 2 * spec.num_layers * spec.page_bytes)
        finally:
            self.policy.unpin(groups)

    def _delivered(self, local: list[list[int]], new_ids: list[int], bad: set[int], P: int) -> tuple[list[list[int]], list[int]]:
        tables = [[new_ids[d] for d in t[: _first_bad(t, bad)]] for t in local]
        return tables, [len(t) * P for t in tables]

    def _verification_failed_all(self, seg: bytes, why: str) -> None:
        group = self._seg_group(seg.hex())
        for i in self.policy.group_holders(group):
            self._verification_failed(i, group, self._manifest_key(seg.hex()), why)
        self.index.remove_segment(seg)
        self._manifests.pop(seg, None)

    async def _manifest(self, seg: bytes, spec: KVSpec) -> Manifest | None:
        """The segment's manifest, verified against ``spec``; None (and the segment
        dropped) when no tier has a good one."""
        m = self._manifests.get(seg)
        if m is None:
            got = await self._read_manifest(seg.hex())
            m = None if got is None else got[0]
        if m is None:
            self.index.remove_segment(seg)
            return None
        why = _mismatch(m, spec)
        if why:
            self._verification_failed_all(seg, why)
            return None
        self._cache_manifest(m)
        return m

    def _layer_job(self, li: int, seg: bytes, pl: _Planned) -> _Job:
        m = pl.manifest
        lay_pos = next(i for i, lay in enumerate(m.layers) if lay.layer_index == li)
        return _Job(li, seg, pl, lay_pos, self._seg_group(seg.hex()), _runs(pl.pages), len(pl.pages) == m.num_pages)

    async def _read(self, job: _Job, i: int) -> tuple[list[Blob] | None, bool]:
        """One tier's bytes of the job's pages (or the whole object when it will be
        promoted). A tier that copies reads into a borrowed resident buffer."""
        t = self.tiers[i]
        m = job.pl.manifest
        key = m.layers[job.lay_pos].key
        whole = job.whole_ok and bool(self.policy.promote_targets(i, job.group)) and not t.on_device
        with self.metrics.timed(t.name, "get_ranges"):
            if whole:
                blob = await t.get(key)
                return (None if blob is None else [blob]), True
            ranges = [r for a, b in job.runs for role in ("key", "value") for r in _run_range(m, job.lay_pos, role, a, b)]
            into = None
            if not t.trusted:
                into = self.buffers.acquire(sum(ln for _, ln in ranges))
                job.borrowed.append(into)
            return await t.get_ranges(key, ranges, into), False

    async def _prefetch(self, job: _Job) -> tuple[int, list[Blob] | None, bool] | None:
        tiers = [i for i in job.pl.tiers if (i, job.group) not in job.pl.failed_groups]
        if not tiers:
            return None
        parts, whole = await self._read(job, tiers[0])
        return tiers[0], parts, whole

    async def _load_layer(
        self, pool: PagedKVPool, job: _Job, dst: torch.Tensor, bad: set[int], first: tuple[int, list[Blob] | None, bool] | None,
    ) -> tuple[int, int | None]:
        """Verify and copy a job's pages into the pool from the fastest tier with good
        bytes (``first``: that tier's bytes, read ahead). A tier whose bytes fail is
        noted (dropped when the retrieve ends, so the other layers still read) and the
        next tier is tried; pages no tier has good stay in ``bad``. Returns (bytes
        read, the tier index when the object was read whole, else None)."""
        pl, li = job.pl, job.li
        m = pl.manifest
        key = m.layers[job.lay_pos].key
        nread = 0
        rows = dst[[pl.dest[p] for p in pl.pages]]
        failed: list[int] | None = None  # of the last tier whose bytes are in the pool
        for i in pl.tiers:
            t = self.tiers[i]
            if (i, job.group) in pl.failed_groups:
                continue
            if first is not None and first[0] == i:
                _, parts, whole = first
            else:
                parts, whole = await self._read(job, i)
            first = None
            if parts is None:
                self._missing(i, key)
                continue
            got = sum(blob_nbytes(p) for p in parts)
            nread += got
            self._hit(i, got)
            result = self._verify_scatter(pool, li, m, job.lay_pos, job.runs, parts, whole, rows, not t.trusted)
            if result is None or result:
                what = "object size" if result is None else f"{len(result)} page checksum(s)"
                pl.failed.append((i, key, f"layer {li}: {what} differ"))
                pl.failed_groups.add((i, job.group))
                if result is not None:
                    failed = result
                continue
            return nread, (i if whole else None)
        # No tier had every page good: the pool holds the last tier's bytes (or none);
        # its failed pages, or all, are misses.
        if failed is None:
            bad.update(pl.dest[p] for p in pl.pages)
        else:
            bad.update(pl.dest[pl.pages[j]] for j in failed)
        return nread, None

    def _verify_scatter(
        self, pool: PagedKVPool, li: int, m: Manifest, lay_pos: int, runs: list[tuple[int, int]], parts: list[Blob],
        whole: bool, rows: torch.Tensor, check: bool,
    ) -> list[int] | None:
        """Copy the needed pages of one layer object into the pool rows ``rows`` (in
        needed-page order), verifying each page's checksum first when ``check``: chunk
        by chunk, so the copy reads what the hash just brought into cache. Returns the
        positions whose checksum differs ([] when all are good), or None when a whole
        object has the wrong size (nothing copied)."""
        lay = m.layers[lay_pos]
        pb, sb = m.page_bytes, m.scale_bytes
        if whole:
            blob = parts[0]
            if blob_nbytes(blob) != lay.object_size:
                return None
            if check:
                # The page checks below cover the pages; the rest of the object (what a
                # promotion copies besides pages) must match the object checksum.
                bv = host_view(blob)
                fixed = [bv[o : o + n] for o, n in m.fixed_ranges(lay_pos)]
                if object_checksum(fixed, lay.key_page_checksums, lay.value_page_checksums) != lay.object_checksum:
                    return None
            parts = [blob[off : off + ln] for a, b in runs for role in ("key", "value") for off, ln in _run_range(m, lay_pos, role, a, b)]
        spec = pool.spec
        kv = pool.layers[li]
        step = max(1, _CHUNK_BYTES // pb)
        failed: list[int] = []
        it = iter(parts)
        pos = 0
        for a, b in runs:
            n = b - a
            for role_i, sums in ((0, lay.key_page_checksums), (1, lay.value_page_checksums)):
                pool_part = next(it)
                scale_part = next(it) if sb else None
                pv = host_view(pool_part) if check else None
                sv = host_view(scale_part) if check and scale_part is not None else None
                data = _u8(pool_part)
                scales = _u8(scale_part) if scale_part is not None else None
                for c0 in range(0, n, step):
                    c1 = min(n, c0 + step)
                    if pv is not None:
                        for j in range(c0, c1):
                            h = xxhash.xxh3_64()
                            h.update(pv[j * pb : (j + 1) * pb])
                            if sv is not None:
                                h.update(sv[j * sb : (j + 1) * sb])
                            if h.intdigest() != sums[a + j]:
                                failed.append(pos + j)
                    pages = _pages_of(data[c0 * pb : c1 * pb], None if scales is None else scales[c0 * sb : c1 * sb], spec, c1 - c0, pool.device)
                    kv[role_i].index_copy_(0, rows[pos + c0 : pos + c1], pages)
            pos += n
        return sorted(set(failed))

    def _promote(self, seg: bytes, hit_tier: int) -> None:
        group = self._seg_group(seg.hex())
        targets = self.policy.promote_targets(hit_tier, group)
        if targets:
            self._spawn(self._promote_to(group, hit_tier, targets))

    async def _promote_to(self, group: str, src: int, targets: list[int]) -> None:
        sizes = self.policy.group_keys(src, group)
        items = await self._read_group(src, sizes)
        if items is None:
            return
        for i in targets:
            await self._write_group(i, group, items, sizes, self.policy.depth(group))

    # ------------------------------------------------------------------ stats

    def _gauges(self) -> dict[str, dict[str, float]]:
        out = {}
        for i, t in enumerate(self.tiers):
            cap = self.policy.tiers[i].capacity_bytes
            out[t.name] = {"objects": self.policy.num_objects(i), "bytes": self.policy.used_bytes(i), "capacity_bytes": cap}
        return out  # type: ignore[return-value]

    def stats(self) -> dict[str, Any]:
        """Per tier: objects, bytes, capacity, hits, misses, bytes read and written,
        evictions, verification failures, skipped writes, operation count and time;
        and the index size."""
        counters = self.metrics.snapshot()
        gauges = self._gauges()
        tiers = {}
        for t in self.tiers:
            tiers[t.name] = {**gauges[t.name], **counters[t.name], "available": t.available}
        return {"tiers": tiers, "index_pages": len(self.index), "segments": len(self.index.segments()), "pending_write_bytes": self._pending_bytes}


# ---------------------------------------------------------------------- helpers


def _first_bad(table: list[int], bad: set[int]) -> int:
    """Where a sequence stops: its first page that no tier had good, else its end."""
    return next((i for i, d in enumerate(table) if d in bad), len(table))


def _index_entries(m: Manifest) -> list[tuple[bytes, int, int, Sequence[bytes]]]:
    return [(m.segment_id, s, seq.first_page, seq.page_hashes) for s, seq in enumerate(m.sequences) if seq.page_hashes]


def _depth(m: Manifest) -> int:
    return max((s.first_page + len(s.block_table) for s in m.sequences), default=0)


def _segment_id(last_hashes: list[bytes], firsts: list[int]) -> bytes:
    """One sequence: the hash of its last stored page. Several: a hash over theirs."""
    if len(last_hashes) == 1 and firsts[0] == 0:
        return last_hashes[0]
    h = xxhash.xxh3_128()
    for lh, f in zip(last_hashes, firsts, strict=True):
        h.update(lh)
        h.update(f.to_bytes(8, "little"))
    return h.digest()


_CHUNK_BYTES = 1 << 22  # gather (or verify) this much, then hash (or copy) it while it is warm in cache


def _fill_pages(pool: PagedKVPool, li: int, idx: torch.Tensor, plan: LayerPlan, out: memoryview) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """Gather layer ``li``'s pages ``idx`` from ``pool`` into the slots of ``out`` (the
    object, descriptors already written); return the object checksum and per-page
    checksums per role (xxh3-64 over a page's bytes, then its scales)."""
    n = int(idx.numel())
    pb, sb = plan.page_bytes, plan.scale_bytes
    sums: dict[str, list[int]] = {"key": [], "value": []}
    fixed: list[bytes | bytearray | memoryview] = []
    kv = pool.layers[li]
    pos = 0
    for part in plan.parts:
        if not isinstance(part, Slot):
            fixed.append(part)
            pos += len(part)
            continue
        role_i = 0 if part.role == "key" else 1
        if part.what == "scales":
            pos += part.nbytes  # written, and hashed with its pages, below
            continue
        if plan.quantization:
            pages = kv[role_i].index_select(0, idx).cpu()
            q, sc = quantize_int8(pages)
            qb, scb = host_view(q), host_view(sc)
            out[pos : pos + part.nbytes] = qb
            soff = plan.key_scales_offset if part.role == "key" else plan.value_scales_offset
            out[soff : soff + n * sb] = scb
            for j in range(n):
                h = xxhash.xxh3_64()
                h.update(qb[j * pb : (j + 1) * pb])
                h.update(scb[j * sb : (j + 1) * sb])
                sums[part.role].append(h.intdigest())
            pos += part.nbytes
            continue
        # Move pages as the widest integer that divides a page: torch's uint8 gather
        # runs at half the speed of int64, and unaligned int64 stores are fine on CPUs.
        word = next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8) if pb % w.itemsize == 0)
        per = pb // word.itemsize
        src = kv[role_i].reshape(kv.shape[1], -1).view(word)  # [num_blocks, page words]
        dst = torch.frombuffer(out, dtype=word, count=n * per, offset=pos).view(n, per) if n else None
        step = max(1, _CHUNK_BYTES // pb)
        digest = xxhash.xxh3_64_intdigest
        for a in range(0, n, step):
            b = min(n, a + step)
            assert dst is not None
            if src.device.type == "cpu":
                torch.index_select(src, 0, idx[a:b], out=dst[a:b])
            else:
                dst[a:b].copy_(src.index_select(0, idx[a:b]))
            base = pos + a * pb
            sums[part.role] += [digest(out[base + j * pb : base + (j + 1) * pb]) for j in range(b - a)]
        pos += part.nbytes
    return object_checksum(fixed, sums["key"], sums["value"]), tuple(sums["key"]), tuple(sums["value"])


def _runs(pages: list[int]) -> list[tuple[int, int]]:
    """Sorted page ids as half-open runs of consecutive ids."""
    runs: list[tuple[int, int]] = []
    for p in pages:
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs


def _run_range(m: Manifest, lay_pos: int, role: str, a: int, b: int) -> list[tuple[int, int]]:
    first = m.page_range(lay_pos, role, a)
    return [(off, ln * (b - a)) for off, ln in first]


def _u8(b: Blob) -> torch.Tensor:
    if isinstance(b, torch.Tensor):
        return b
    mv = host_view(b)
    return torch.frombuffer(mv, dtype=torch.uint8) if len(mv) else torch.empty(0, dtype=torch.uint8)


def _pages_of(data: torch.Tensor, scales: torch.Tensor | None, spec: KVSpec, n: int, device: torch.device) -> torch.Tensor:
    """``n`` stored pages (uint8 bytes, plus int8 scales) as ``[n, P, H, D]`` of the
    spec's dtype on ``device``."""
    shape = (n, spec.page_size, spec.num_kv_heads, spec.head_dim)
    data = data.to(device, non_blocking=True)
    if data.storage_offset() % 16:
        # A device slice at an odd offset (the descriptor is 133 bytes) cannot be
        # reinterpreted in place: one device-side copy aligns it.
        data = data.clone()
    if scales is None:
        return data.view(spec.dtype).view(shape)
    sc = scales.to(device).clone().view(spec.dtype).view(n, spec.page_size, 1)
    q = data.view(torch.int8).view(n, spec.page_size, -1)
    return (q.float() * sc.float()).to(spec.dtype).view(shape)


def _cut(row: list[tuple[bytes, int]], plans: Mapping[bytes, _Planned | None]) -> list[tuple[bytes, int]]:
    for i, (seg, _) in enumerate(row):
        if plans[seg] is None:
            return row[:i]
    return row


def _mismatch(m: Manifest, spec: KVSpec) -> str:
    if m.fingerprint != spec.fingerprint():
        return "fingerprint differs from the pool's spec"
    if m.page_size != spec.page_size:
        return f"page_size {m.page_size}, the pool has {spec.page_size}"
    elem = 1 if m.quantization else torch.empty(0, dtype=spec.dtype).element_size()
    if m.page_bytes != spec.page_size * spec.num_kv_heads * spec.head_dim * elem:
        return f"page_bytes {m.page_bytes} do not match the spec"
    if sorted(lay.layer_index for lay in m.layers) != list(range(spec.num_layers)):
        return "the manifest does not hold every layer of the spec"
    return ""


async def open_store(config: str | os.PathLike[str] | Mapping[str, Any] | StoreConfig | None = None) -> TieredStore:
    """Open a store from a YAML path, a dict, a StoreConfig, or None (the embedded
    default: CPU memory and ./.hurray-cache on disk). Persistent tiers are scanned and
    the index rebuilt; an unreachable Redis is a warning, not a failure."""
    store = TieredStore(load_config(config))
    return await store.open()
