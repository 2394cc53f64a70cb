"""The engine port (``EnginePort``): the one way every engine adapter reaches the store.
It owns the store's thread, the read routes, other processes' changes, a lookup's pins,
the bounded save backlog, the help a waiting thread gives the writers, and the feed of
what was stored and removed (docs/engine.md). Names are the engine's object names."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence, Sized
from dataclasses import dataclass, field
from typing import Any

from hurray_store.engine.bound import WaitBound
from hurray_store.engine.events import EVENTS_KEPT, EventFeed, StoreEvent
from hurray_store.engine.leases import Leases
from hurray_store.engine.portable import load_layers, tokens_held
from hurray_store.engine.reads import Check, OrderedLoads, Take, read_all
from hurray_store.engine.saves import Save, SaveBacklog, write_lent
from hurray_store.engine.thread import StoreThread
from hurray_store.keys import ObjectKey, object_stored
from hurray_store.metrics import EngineCollector, serve_metrics
from hurray_store.paging import PagedKVPool
from hurray_store.spec import KVSpec
from hurray_store.store import Pin, PutResult, RetrievedLayer, TieredStore
from hurray_store.store.ledger import KeyRef
from hurray_store.store.objects import Data
from hurray_store.tiers import Range, RangeIn

log = logging.getLogger(__name__)
TIMEOUT_S = 60.0  # the longest a call waits for the store's loop
SAVE_BACKLOG_BYTES = 1 << 30  # saves handed over and not yet written, at most
SAVES_IN_FLIGHT = 64  # saves written at once
READS_IN_FLIGHT = 2  # ranged reads at once on the loop (each many ranges of one object)

__all__ = ["EnginePort", "Held", "Save", "StoreEvent"]


@dataclass(slots=True)
class Held:
    """A lookup's answer: ``n`` leading objects are held; with ``pin``, ``pins`` keep
    them (one per object, in order) until given to ``EnginePort.release``."""

    n: int
    pins: Sequence[Pin] = field(default_factory=list)

    def __len__(self) -> int:
        return self.n


class EnginePort:
    """A store opened from ``config`` on a thread of its own, behind the port's calls.

    ``save_backlog_bytes``/``saves_in_flight`` bound ``save``; ``events_kept`` the
    events waiting for ``take_events``; ``timeout_s`` a call's wait for the loop."""

    def __init__(
        self,
        config: Any = None,
        *,
        name: str = "hurray-engine",
        save_backlog_bytes: int = SAVE_BACKLOG_BYTES,
        saves_in_flight: int = SAVES_IN_FLIGHT,
        events_kept: int = EVENTS_KEPT,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        self.thread = StoreThread(config, name)
        # The store's public face, for what is not yet on the port (the vLLM connector's
        # segments): adapters use the port's calls for everything else.
        self.store: TieredStore = self.thread.store
        self.timeout = timeout_s
        self._events = EventFeed(self.store.namespace, events_kept)
        self._unwatch = self.store.watch(self._events.note)
        self._saves = SaveBacklog(self.thread, save_backlog_bytes, saves_in_flight)
        # A store with a tier that can hang: an engine's lookups and loads wait at most
        # ``engine.wait_s`` (``engine/bound.py``).
        eng = self.store.config.engine
        self.bound = WaitBound(self.thread, eng.wait_s if self.store.networked else None, timeout_s)
        self._loads = OrderedLoads(self.bound)
        self.leases = Leases(self.store.unpin, eng.lease_s)
        self.page_sizes = eng.page_sizes  # other page sizes a prefix load reads
        self.release_one = self.store.unpin_one  # one pin, any thread, no lock
        self._stored = len(object_stored(self.store.namespace, ""))  # a ref's key: this + name
        self.counts = {
            "lookups": 0,
            "objects_asked": 0,
            "objects_held": 0,
            "tokens_asked": 0,
            "tokens_found": 0,
            "loaded": 0,
            "rejected": 0,
        }
        # The counts as Prometheus counters in the store's registry, and served over
        # HTTP where the config asks (engine.metrics_port).
        self.store.metrics.registry.register(
            EngineCollector(name, lambda: {**self.counts, **self.bound.counts})
        )
        self.metrics_port = (
            None
            if eng.metrics_port is None
            else serve_metrics(self.store.metrics.registry, eng.metrics_host, eng.metrics_port)
        )
        self._closed = False
        self.relay: Any = None  # the KV-event publisher, once ``publish_events`` starts it

    def call(self, coro: Any) -> Any:
        """Run a coroutine of the store's public face on its loop and wait for it;
        RuntimeError at once once the port is closed (its loop is gone)."""
        if self._closed:
            coro.close()
            raise RuntimeError("engine port: closed")
        return self.thread.call(coro, self.timeout)

    def _open(self) -> None:
        """RuntimeError at once when the port is closed (its loop is gone: a call
        that needs it would wait for nothing)."""
        if self._closed:
            raise RuntimeError("engine port: closed")

    # ------------------------------------------------------------------ lookups

    def sync_others(self) -> None:
        """Before the ledger is read on this thread: what other processes sharing a
        medium (a disk folder) committed or removed, read on the store's loop. Asking
        costs one ``fstat`` a disk tier; the trip is made only when there is news."""
        if self.store.others_changed():
            self.call(self.store.sync())

    def lookup(
        self,
        keys: Iterable[str] | Iterable[KeyRef],
        *,
        pin: bool = False,
        lease: bool = False,
        asked: int | None = None,
    ) -> Held:
        """How many of ``keys`` (object names, or ``ref``'s handles), from the first, a
        load will find; with ``pin``, pinned until ``release``; with ``lease``, pinned
        until ``load`` takes them or ``engine.lease_s`` passes. ``asked``: how many keys
        a lazy ``keys`` holds (for the metrics; a list counts itself). Without a shared tier
        the ledger answers on this thread and ``keys`` is taken lazily, none past the
        first miss; a shared tier (a cache server) is asked on the store's loop about
        those the ledger lacks, all at once."""
        if lease:
            names = list(self._names(keys))
            got = self.lookup(names, pin=True)
            self.leases.add(names[: got.n], got.pins)
            return Held(got.n)
        self._asked(keys, asked)
        self.sync_others()
        if self.store.shared:
            self._open()
            held = _held_shared(self.store, self._names(keys), pin)
            return self._counted(self.bound.run(held, Held(0), on_late=self.release))
        return self._counted(self._held_here(keys, pin))

    async def lookup_async(
        self, keys: Iterable[str] | Iterable[KeyRef], *, pin: bool = False, asked: int | None = None
    ) -> Held:
        """``lookup`` from an engine's event loop, which it never blocks."""
        self._open()
        self._asked(keys, asked)
        if self.store.shared or self.store.others_changed():
            held = _held_shared(self.store, self._names(keys), pin)
            return self._counted(await self.bound.run_async(held, Held(0), on_late=self.release))
        return self._counted(self._held_here(keys, pin))

    def _asked(self, keys: Iterable[Any], asked: int | None) -> None:
        if asked is None and isinstance(keys, Sized):
            asked = len(keys)
        self.counts["objects_asked"] += asked or 0

    def _held_here(self, keys: Iterable[str] | Iterable[KeyRef], pin: bool) -> Held:
        if pin:
            pins = self.store.pin_held(keys)
            return Held(len(pins), pins)
        held, n = self.store.held, 0
        for k in self._names(keys):
            if not held(k):
                break
            n += 1
        return Held(n)

    def _names(self, keys: Iterable[str] | Iterable[KeyRef]) -> Iterator[str]:
        """Object names of ``keys``, lazily (a handle's key is the stored one)."""
        at = self._stored
        for k in keys:
            yield k.key[at:] if isinstance(k, KeyRef) else k

    def _counted(self, held: Held) -> Held:
        self.counts["lookups"] += 1
        self.counts["objects_held"] += held.n
        return held

    # The prefix level, for an engine whose pages are stored as segments of a token
    # prefix (the vLLM connector): on the store's loop, from a save's ``write`` or a
    # load submitted to ``thread``.

    async def put_pages(
        self,
        pool: PagedKVPool,
        token_ids: Sequence[Sequence[int]],
        tables: Sequence[Sequence[int]],
        salts: Sequence[bytes | str | None],
        from_page: Sequence[int] | None = None,
    ) -> PutResult:
        """Store the pages of ``pool`` (``TieredStore.put``), then commit them: visible
        to every instance's lookup when this returns."""
        r = await self.store.put(pool, token_ids, tables, salt=list(salts), from_page=from_page)
        await self.store.flush()
        return r

    def load_pages(
        self,
        pool: PagedKVPool,
        token_ids: Sequence[Sequence[int]],
        salts: Sequence[bytes | str | None],
        skip: Sequence[int] | None = None,
    ) -> AsyncIterator[RetrievedLayer]:
        """The longest stored prefix of each sequence, re-paged into ``pool`` a layer at
        a time (``TieredStore.retrieve_layers``; every page checked before it is in),
        from pages of the pool's own heads and page size, else from other head ranges
        and page sizes (``engine/portable.py``). ``skip[s]``: sequence ``s``'s leading
        pages the engine holds (its own prefix cache, a window's freed blocks): not read."""
        return load_layers(self.store, pool, token_ids, list(salts), self.page_sizes, skip)

    def lookup_tokens(
        self, specs: Sequence[KVSpec], token_ids: Sequence[int], salt: bytes | str | None
    ) -> int:
        """For an engine whose pages are stored as segments of a token prefix (the vLLM
        connector): how many leading tokens of ``token_ids`` (whole pages) a load can
        deliver under every one of ``specs`` (one per rank: each reads the heads it
        holds, from whatever head ranges and page sizes are stored), under ``salt``. On
        the store's loop, the ranks asked at once."""
        self._open()
        held = tokens_held(self.store, specs, list(token_ids), salt, self.page_sizes)
        n = int(self.bound.run(held, 0))
        self.counts["tokens_asked"] += len(token_ids)
        self.counts["tokens_found"] += n
        return n

    def held_each(self, names: Sequence[str]) -> list[bool]:
        """Whether a load will find each of ``names`` (not only the leading ones)."""
        self.sync_others()
        out = [self.store.held(n) for n in names]
        if self.store.shared and not all(out):
            asks = [n for n, h in zip(names, out, strict=True) if not h]
            self._open()
            found = iter(self.bound.run(_contains_all(self.store, asks), [False] * len(asks)))
            out = [h or next(found) for h in out]
        return out

    def ref(self, name: str) -> KeyRef:
        """A handle on ``name`` that ``lookup`` pins by with no key looked up while
        the copy it last found stays (an engine that pins the same objects again and
        again keeps one per object)."""
        return self.store.ref(name)

    def release(self, held: Held | Sequence[Pin]) -> None:
        """Let go of a lookup's pins (any thread)."""
        self.store.unpin(held.pins if isinstance(held, Held) else held)

    # ------------------------------------------------------------------ loads

    def size(self, name: str) -> int | None:
        """``name``'s size in bytes (the ledger's, else a shared tier's); None: absent."""
        n = self.store.held_size(name)
        if n is None and self.store.shared:
            self._open()
            n = self.bound.run(self.store.object_size(name), None)
        return n

    def read(
        self,
        items: Sequence[tuple[str, Sequence[Range], Sequence[memoryview]]],
        each: RangeIn | None = None,
        in_flight: int = READS_IN_FLIGHT,
    ) -> list[bool]:
        """Read each ``(name, ranges, buffers)``: where the fastest tier holding it reads
        on this thread, here, ``each(j, i, sum)`` called as range ``i`` of item ``j`` is
        in (its checksum taken while in the CPU's cache); the others on the store's
        loop, ``in_flight`` at a time, with no ``each``. Per item, read or not (a miss).
        The caller checks what was read before it trusts it; what fails, it ``reject``s.
        On a store with a tier that can hang, the loop's reads are bounded by
        ``engine.wait_s``: they land in buffers of the port's own first (a late read
        never writes into the caller's), copied over when they are in."""
        got = self.store.read_objects_into_now(items, each)
        later = [j for j, ok in enumerate(got) if not ok]
        if later:
            rest = [items[j] for j in later]
            if self.bound.wait_s is None:
                more = self.call(read_all(self.store, rest, in_flight))
            else:
                more = self._read_bounded(rest, in_flight)
            for j, ok in zip(later, more, strict=True):
                got[j] = ok
        return got

    def _read_bounded(
        self, items: Sequence[tuple[str, Sequence[Range], Sequence[memoryview]]], in_flight: int
    ) -> list[bool]:
        """``read``'s loop part within the engine's bound, through staging buffers."""
        self._open()
        staged = [
            (name, ranges, [memoryview(bytearray(b.nbytes)) for b in bufs])
            for name, ranges, bufs in items
        ]
        nbytes = sum(b.nbytes for _, _, bufs in items for b in bufs)
        got = self.bound.run(read_all(self.store, staged, in_flight), None, nbytes=nbytes)
        if got is None:  # late: misses; the staging stays the late read's
            return [False] * len(items)
        for ok, (_, _, dst), (_, _, src) in zip(got, items, staged, strict=True):
            if ok:
                for d, s in zip(dst, src, strict=True):
                    d.cast("B")[:] = s
        return got

    def load(self, names: Sequence[str], size: int, check: Check, take: Take) -> int:
        """Read objects ``names`` (each ``size`` bytes) whole and in order, ``check(j,
        bytes)`` each (why it is not object ``j``; "" when it is), then ``take(j,
        tensor)`` it into the engine's memory: nothing reaches the engine unchecked.
        Stops at the first not held or not right (that one is ``reject``ed); how many
        were taken. ``engine/reads.py`` says which thread reads what."""
        self._open()
        try:
            n, why = self._loads.run(names, size, check, take)
        finally:
            self.leases.end(names)
        self.counts["loaded"] += n
        if why:
            self.reject(names[n], why)
        return n

    def reject(self, name: str, why: str) -> None:
        """Object ``name`` was read and failed its check: a miss, and it leaves the
        store (a ``removed`` event, reason ``rejected``)."""
        self.counts["rejected"] += 1
        log.warning("engine port: %s failed its check (%s); deleted, a miss", name, why)
        self.call(self.store.delete_object(name, "rejected"))

    def delete(self, name: str) -> bool:
        """Delete ``name`` everywhere; whether a load would have found it."""
        return bool(self.call(_delete(self.store, name)))

    # ------------------------------------------------------------------ saves

    def save(self, saves: Iterable[Save], reserved: bool = False) -> None:
        """Store each object behind the engine; returns at once. The object's bytes
        must stay as they are until its ``on_done`` runs. Bounded by the backlog
        (``SaveBacklog``): over it, the oldest waiting saves are dropped (``on_done``
        False), counted, never waited for. ``reserved``: their room was taken by
        ``reserve`` before the engine copied them out."""
        self.leases.expire()  # before the saves need room
        self._saves.add(saves, reserved)

    def reserve(self, nbytes: int) -> bool:
        """Room in the save backlog for ``nbytes`` the engine is about to copy out,
        made by dropping the oldest waiting saves; False (a drop, counted) when there
        is none: the engine then copies nothing. ``unreserve`` gives back room not used."""
        return self._saves.reserve(nbytes)

    def unreserve(self, nbytes: int) -> None:
        self._saves.unreserve(nbytes)

    def saves_pending(self) -> tuple[int, int]:
        """``(bytes, saves)``: the backlog's bytes (waiting, being written, reserved)
        and the saves waiting (not counting those being written)."""
        return self._saves.nbytes, self._saves.waiting

    def wait_saves(self, timeout: float | None = None) -> bool:
        """Wait until no save waits or is being written; False when ``timeout`` passed."""
        return self._saves.wait(timeout)

    def saving(self, name: str) -> bool:
        """A ``save`` of ``name`` waits or is being written."""
        return self._saves.pending(name)

    def save_lent(self, steps: Iterable[list[tuple[str, Data]]]) -> list[bool]:
        """Store objects whose bytes the engine lends only until this returns (its
        host pages): a step's writes start while the caller makes the next, and this
        thread helps the tiers' writers while it waits; it returns once every object
        is written through every tier. Per object, stored or not."""
        self._open()
        self.leases.expire()  # before the saves need room
        return write_lent(self.thread, steps, self.timeout)

    def touch(self, names: Sequence[str]) -> None:
        """Count these objects as used now, for eviction (no bytes move; any thread)."""
        self.thread.loop.call_soon_threadsafe(self.store.touch, list(names))

    def refresh(self, ref: KeyRef) -> None:
        """Point ``ref`` at the copy a load finds now (after a save of its object)."""
        self.store.refresh(ref)

    # ------------------------------------------------------------------ the rest

    def publish_events(
        self, hashes_of: Callable[[str], Sequence[bytes | int]], *, model: str, block_size: int
    ) -> bool:
        """Publish this namespace's objects as KV events for routers (docs/events.md)
        when the config's ``events.endpoint`` asks for it; ``hashes_of(name)``: an
        object's blocks by the engine's own keys (empty: not published). False: not
        configured."""
        cfg = self.store.config.events
        if not cfg.endpoint or self.relay is not None:
            return self.relay is not None
        from hurray_store.events import Blocks, EventRelay, default_topic  # zmq, on demand

        topic, ns = default_topic(cfg, model), self.store.namespace

        def blocks(group: Any) -> Sequence[Blocks]:
            if group.__class__ is not ObjectKey or group.namespace != ns:
                return ()
            hashes = tuple(hashes_of(group.name))
            return (Blocks(topic, hashes, block_size),) if hashes else ()

        self.relay = EventRelay(self.store, cfg, blocks)
        log.info("KV events: publishing on %s, topic %s", self.relay.publisher.endpoint, topic)
        return True

    def take_events(self) -> list[StoreEvent]:
        """Every object (and segment) stored in a tier or removed from one since the
        last call, oldest first, with the tier and the reason."""
        return self._events.take()

    def flush(self, timeout: float | None = None) -> None:
        """Wait for every save handed over, then for write-through below the top tier."""
        if not self._saves.wait(self.timeout if timeout is None else timeout):
            raise TimeoutError("engine port: saves still pending")
        self.call(self.store.flush())

    def stats(self) -> dict[str, Any]:
        """The store's stats, and the port's: lookups, loads, saves (saved, failed,
        dropped, pending bytes) and events dropped."""
        return {
            **self.store.stats(),
            "port": {
                **self.counts,
                **self.bound.counts,
                "leases": len(self.leases),
                "leases_expired": self.leases.expired,
                **{f"saves_{k}": v for k, v in self._saves.counts.items()},
                "saves_pending_bytes": self._saves.nbytes,
                "events_dropped": self._events.dropped,
                **(self.relay.stats() if self.relay is not None else {}),
            },
        }

    def close(self) -> None:
        """Write what is pending, then close the store and its thread."""
        if self._closed:
            return
        self._closed = True
        try:
            self._saves.wait(self.timeout)
        finally:
            self._saves.closed = True
            self._unwatch()
            self.leases.close()
            if self.relay is not None:
                self.relay.close()
            self._loads.close()
            self.thread.close()


async def _held_shared(store: TieredStore, keys: Iterable[str], pin: bool) -> Held:
    """On the store's loop: ``EnginePort.lookup`` with a shared tier (or news from
    other processes to read first). The ledger first; a shared tier is asked about
    the keys from the first the ledger lacks, all at once."""
    await store.sync()
    if pin and not store.shared:
        pins = store.pin_held(keys)
        return Held(len(pins), pins)
    names, n = list(keys), 0
    for k in names:
        if not store.held(k):
            break
        n += 1
    if n < len(names) and store.shared:
        rest = await _contains_all(store, names[n:])
        n += rest.index(False) if False in rest else len(rest)
    return Held(n, store.pin(names[:n])) if pin else Held(n)


async def _contains_all(store: TieredStore, names: Sequence[str]) -> list[bool]:
    return list(await asyncio.gather(*(_found(store, n) for n in names)))


async def _found(store: TieredStore, name: str) -> bool:
    return await store.object_size(name) is not None


async def _delete(store: TieredStore, name: str) -> bool:
    had = await _found(store, name)
    await store.delete_object(name)
    return had
