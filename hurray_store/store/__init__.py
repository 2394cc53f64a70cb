"""TieredStore: the tiers, the ledger and the index wired from one config.

Two levels. The object level (``put_object``, ``get_object``, ...: ``objects.py``) moves
keyed objects through the tiers; the LMCache adapters build on it. The prefix level
stores batches of paged sequences as segments and hands them back re-paged::

    put(pool, token_ids, block_tables)      full pages the store lacks -> segments
      per segment: layer objects (all tiers), then the manifest: the commit point
    lookup(spec, token_ids)                 index only: tokens retrieve can deliver
    retrieve(pool, token_ids)               index -> manifests (verified) -> page byte
                                            ranges (verified) -> pages of ``pool``

The parts, each in its own module, imports pointing down::

    TieredStore ─ SegmentWriter (writer) ─┐
                ─ SegmentReader (reader) ─┼─ plan (pure), page_io
                ─ ObjectStore (objects) ──┤
                                          SegmentCatalog (catalog: index, manifests)
                                          TierCascade (cascade: tiers, policy, ledger)

Everything runs on one event loop; the index and the ledger is only touched between
awaits, so concurrent puts and retrieves on one store are safe. Nothing a tier does
(down, full, corrupt) raises into ``put``/``retrieve``: it is a miss or a skipped write,
counted and logged.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import Any, cast

from hurray_store.buffers import BufferPool
from hurray_store.config import StoreConfig, load_config
from hurray_store.metrics import StoreMetrics
from hurray_store.paging import PagedKVPool
from hurray_store.spec import KVSpec
from hurray_store.store.cascade import TierCascade
from hurray_store.store.catalog import SegmentCatalog
from hurray_store.store.discovery import Discovery
from hurray_store.store.groups import GroupLevel
from hurray_store.store.ledger import Group, KeyRef, Ledger, TierInfo
from hurray_store.store.object_level import ObjectLevel, Pin
from hurray_store.store.objects import ObjectStore
from hurray_store.store.policy import Policy
from hurray_store.store.reader import SegmentReader
from hurray_store.store.results import PutResult, RetrievedLayer, RetrieveResult
from hurray_store.store.writer import SegmentWriter
from hurray_store.tiers import (
    HelpsWrites,
    SharedMedium,
    SharedTier,
    Tier,
    open_tier,
)

# A prefix-level call's salt: one for every sequence (None: the config's), or a list of
# one per sequence.
Salt = bytes | str | None | list[bytes | str | None]

log = logging.getLogger(__name__)

__all__ = [
    "Group",
    "KeyRef",
    "Pin",
    "PutResult",
    "RetrieveResult",
    "RetrievedLayer",
    "TieredStore",
    "open_store",
]


class TieredStore(ObjectLevel):
    def __init__(
        self,
        config: StoreConfig,
        *,
        tiers: Sequence[Tier] | None = None,
        namespaces: Sequence[str] = (),
    ) -> None:
        """``tiers``: tiers already built, one per ``config.tiers`` entry and in its
        order (default: built from the config). ``namespaces``: more namespaces kept
        beside ``config.namespace`` (a cache server's tenants), each with its own index
        in ``catalogs`` and object level in ``object_levels``, found again at restart."""
        self.config = config
        self.namespace = config.namespace
        if tiers is None:
            tiers = [open_tier(t, config.namespace) for t in config.tiers]
        elif len(tiers) != len(config.tiers):
            raise ValueError(f"{len(tiers)} tiers for {len(config.tiers)} config entries")
        self.ledger = Ledger(
            [
                TierInfo(
                    t.name,
                    getattr(c, "capacity_bytes", None),
                    t.caps.persistent,
                    t.caps.trusted,
                    t.offers(SharedTier),
                    t.charge,
                )
                for t, c in zip(tiers, config.tiers, strict=True)
            ]
        )
        self.ledger.serving([_serving(t) for t in tiers])
        # ``unpin`` of one pin, as cheap as a call gets: engines let a lookup's pins go
        # one call per chunk (any thread).
        self.unpin_one: Callable[[Pin], None] = self.ledger.unpin_one
        self.policy = Policy(
            self.ledger,
            write_mode=config.policy.write_mode,
            promote_on_hit=config.policy.promote_on_hit,
        )
        self.metrics = StoreMetrics([t.name for t in tiers], self._gauges)
        self.quantization = None if config.quantization == "none" else config.quantization
        self.buffers = BufferPool()
        self.cascade = TierCascade(
            tiers, self.policy, self.metrics, max_pending_bytes=config.policy.max_pending_bytes
        )
        spaces = list(dict.fromkeys([config.namespace, *namespaces]))
        self.catalogs = {ns: SegmentCatalog(ns, self.cascade) for ns in spaces}
        self.object_levels = {ns: ObjectStore(ns, self.cascade) for ns in spaces}
        self.catalog = self.catalogs[config.namespace]
        self.objects = self.object_levels[config.namespace]
        self.writer = SegmentWriter(
            self.cascade,
            self.catalog,
            self.buffers,
            quantization=self.quantization,
            max_segment_bytes=config.max_segment_bytes,
        )
        # The group level, for a server keeping several namespaces (``store/groups.py``).
        self.groups = GroupLevel(self.cascade, self.catalogs)
        self.reader = SegmentReader(self.cascade, self.catalog, self.buffers, self.quantization)
        # for ``others_changed`` and ``help_writes``, from any thread
        self._media = [cast(SharedMedium, t) for t in tiers if t.offers(SharedMedium)]
        self._helpers = [cast(HelpsWrites, t) for t in tiers if t.offers(HelpsWrites)]
        self.discovery = Discovery(
            self.tiers, self.catalogs, self.object_levels, self.cascade.reads
        )
        self._opened = False

    @property
    def tiers(self) -> list[Tier]:
        return self.cascade.tiers

    @property
    def networked(self) -> bool:
        """True when a tier is behind a network service (it can be down or hang)."""
        return any(t.caps.networked for t in self.tiers)

    @property
    def shared(self) -> bool:
        """True when a tier is shared with other processes (a cache server): the ledger
        then does not know everything the store can read."""
        return self.cascade.shared

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> TieredStore:
        self.cascade.reads.loop = asyncio.get_running_loop()
        for t in self.tiers:
            await t.open()
        for i in range(len(self.tiers)):
            if self.policy.scan_at_open(i):
                await self.discovery.rebuild(i)
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
        self.cascade.reads.drain_reads_now()
        await self.cascade.flush()

    def help_writes(self) -> bool:
        """From a thread that would otherwise wait for its puts (never the store's
        loop): run one batch of writes queued for a tier's writer threads here. False
        when none was queued."""
        return any(t.help_write() for t in self._helpers)

    def others_changed(self) -> bool:
        """Whether another process sharing a tier's medium may have committed or
        removed something ``sync`` has not read yet: from any thread, with no effect
        (one ``fstat`` per such tier). What reads the ledger from another thread (the
        LMCache plugin's lookups) asks it first, and has the loop ``sync`` on a yes."""
        return any(t.has_changes() for t in self._media)

    async def sync(self) -> None:
        """Read what other processes sharing a tier's medium (a disk folder) committed
        and removed since the last call: their segments join the index, their objects
        the ledger; what they removed leaves the ledger. Every operation calls it first;
        it costs one ``fstat`` per such tier when nothing changed. The reads made off
        the loop (``read_objects_into_now``) are counted first."""
        self.cascade.reads.drain_reads_now()
        await self.discovery.sync()

    # ------------------------------------------------------------------ prefix level

    def _salts(self, salt: Salt, n: int) -> list[bytes]:
        """One salt per sequence: a list gives each of the ``n`` sequences its own (the
        requests of several tenants in one batch); anything else is every sequence's
        salt; None is the config's."""
        if isinstance(salt, list):
            if len(salt) != n:
                raise ValueError(f"{len(salt)} salts for {n} sequences: give one per sequence")
            return [self._salts(s, 1)[0] for s in salt]
        s = self.config.salt if salt is None else salt
        one = s.encode() if isinstance(s, str) else bytes(s)
        return [one] * n

    async def put(
        self,
        pool: PagedKVPool,
        token_ids: Sequence[Sequence[int]],
        block_tables: Sequence[Sequence[int]],
        seq_lens: Sequence[int] | None = None,
        *,
        salt: Salt = None,
        from_page: Sequence[int] | None = None,
    ) -> PutResult:
        """Store the full pages of these sequences that the store does not hold yet.

        ``token_ids[s]`` are the tokens whose KV sits in ``block_tables[s]``'s pages;
        ``seq_lens[s]`` (default ``len(token_ids[s])``) of them are valid. Only full
        pages are stored (only they can be matched). ``from_page[s]``: the pages before
        it are not in the pool (the caller holds them stored; their table entries are
        never read); if one is not stored, nothing of that sequence is written. Raises
        PagingError for malformed input; a tier failing is a skipped write, never an
        exception.
        """
        await self.sync()
        salts = self._salts(salt, len(token_ids))
        return await self.writer.put(pool, token_ids, block_tables, seq_lens, salts, from_page)

    async def lookup(
        self, spec: KVSpec, token_ids: Sequence[Sequence[int]], *, salt: Salt = None
    ) -> list[int]:
        """Per sequence, the leading tokens (whole pages) ``retrieve`` can deliver now."""
        await self.sync()
        return await self.reader.lookup(spec, token_ids, self._salts(salt, len(token_ids)))

    async def retrieve(
        self,
        pool: PagedKVPool,
        token_ids: Sequence[Sequence[int]],
        *,
        salt: Salt = None,
        skip: Sequence[int] | None = None,
    ) -> RetrieveResult:
        """Re-page the longest stored prefix of each sequence into ``pool`` (``skip``:
        as ``retrieve_layers``)."""
        await self.sync()
        run = self.reader.start(pool, token_ids, self._salts(salt, len(token_ids)), skip)
        stream = run.layers()
        try:
            async for _ in stream:
                pass
        finally:
            await stream.aclose()  # its cleanup (unpin) now, not at GC
        assert run.result is not None
        return run.result

    async def retrieve_layers(
        self,
        pool: PagedKVPool,
        token_ids: Sequence[Sequence[int]],
        *,
        salt: Salt = None,
        skip: Sequence[int] | None = None,
    ) -> AsyncGenerator[RetrievedLayer, None]:
        """``retrieve``, one layer at a time: each item says that layer is in the pool.
        Closing the iteration early gives every allocated page back to ``pool``.
        ``skip[s]``: sequence ``s``'s leading pages the caller holds: matched and
        checked as the others, never read (their table entries name one page of the
        pool, allocated and left unfilled)."""
        await self.sync()
        salts = self._salts(salt, len(token_ids))
        stream = self.reader.start(pool, token_ids, salts, skip).layers()
        try:
            async for layer in stream:
                yield layer
        finally:
            await stream.aclose()

    def watch(self, fn: Callable[[str, str, Any, str], None]) -> Callable[[], None]:
        """Call ``fn(kind, tier_name, group, reason)`` for every group that becomes
        readable in a tier (``stored``) or stops being (``removed``), from the thread
        that made the change, while the ledger is locked (so: note it, nothing more).
        ``group`` is an ``ObjectKey`` (``namespace``, ``name``) of the object level or a
        ``SegmentKey``; ``reason`` one of ``metrics.MOVE_REASONS``, ``write`` (a put),
        ``found`` (a restart scan, another process's write) or ``rewrite``. Returns the
        call that stops it."""
        names = [t.name for t in self.tiers]
        return self.ledger.watch(lambda kind, i, g, why: fn(kind, names[i], g, why))

    # ------------------------------------------------------------------ stats

    def _gauges(self) -> dict[str, dict[str, float]]:
        return self.cascade.gauges()

    def stats(self) -> dict[str, Any]:
        """Per tier: objects, bytes, capacity, hits, misses, bytes read and written,
        evictions, verification failures, skipped writes, operation count and time;
        the index size; and per reason (``metrics.MOVE_REASONS``) and tier, the groups
        and bytes that moved."""
        counters = self.metrics.snapshot()
        gauges = self._gauges()
        tiers = {
            t.name: {**gauges[t.name], **counters[t.name], "available": t.available}
            for t in self.tiers
        }
        index = self.catalog.index
        return {
            "tiers": tiers,
            "index_pages": len(index),
            "segments": len(index.segments()),
            "pending_write_bytes": self.cascade.pending_bytes,
            "moves": self.metrics.moves_snapshot(),
            "not_stored": dict(zip(("groups", "bytes"), self.metrics.not_stored, strict=True)),
        }


async def open_store(
    config: str | os.PathLike[str] | Mapping[str, Any] | StoreConfig | None = None,
) -> TieredStore:
    """Open a store from a YAML path, a dict, a StoreConfig, or None (the embedded
    default: CPU memory and ./.hurray-cache on disk). Persistent tiers are scanned and
    the index rebuilt; an unreachable Redis is a warning, not a failure."""
    store = TieredStore(load_config(config))
    return await store.open()


def _serving(t: Tier) -> Callable[[], bool]:
    """Whether ``t`` serves now: a tier behind a service while it is not in an outage;
    any other tier always (nothing to be down)."""
    if t.caps.networked:
        return lambda: t.available
    return _serves


def _serves() -> bool:
    return True
