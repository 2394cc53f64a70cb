"""The one async tier interface.

A tier moves opaque bytes under string keys. A miss is ``None``; a write the tier could
not make (service down, disk full) returns ``False`` after logging why; exceptions are
for broken contracts. Batch methods default to gathering the primitives; a tier
overrides them only to go faster (Redis pipelines them).

The primitives and their contracts:

- ``get`` / ``get_ranges``: the bytes, or None when absent or short.
- ``put``: one object, atomically (old, none or the whole new one is visible).
- ``put_group``: several objects that enter the tier together; the last is written
  after all the others (the group's commit record). On failure none of them remains.
- ``delete`` / ``contains`` / ``scan`` / ``quarantine`` / ``sizes``.

What a tier offers beyond that core is a capability, one protocol each, that the store
asks with ``tier.offers(Protocol)``: ``ReadsNow`` (reads on the caller's thread),
``Reserves`` (objects built in the tier's memory), ``SharedMedium`` (a medium other
processes open too, and its change feed), ``HelpsWrites`` (a waiting thread may run
the tier's queued writes), ``SharedTier`` (a server other stores write to).

Host tiers return ``memoryview``/``bytes``; a device tier returns ``torch.Tensor``
(uint8) views, so a retrieve copies device to device.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, cast, runtime_checkable

from hurray_store.tiers.helpers import blob_nbytes
from hurray_store.tiers.types import Blob, Buffer, Range, RangeIn, ReadInto


@dataclass(frozen=True, slots=True)
class Unhashed:
    """An ``each`` of a ``read_into_now`` that takes no sum: ``arrived(j, i)`` once
    range ``i`` of read ``j`` is in, with nothing hashed for it (its caller checks the
    bytes its own way). Called as a ``RangeIn``, its sum is ignored."""

    arrived: Callable[[int, int], None]

    def __call__(self, j: int, i: int, s: int = 0) -> None:
        self.arrived(j, i)


def wants_sums(each: RangeIn | None) -> bool:
    """Whether a ``read_into_now``'s ``each`` takes the sums of its ranges."""
    return each is not None and not isinstance(each, Unhashed)


@dataclass(eq=False, slots=True)
class NowRead:
    """One object's part of a ``Tier.read_into_now``: range ``i`` of ``key`` into
    ``buffers[i]``, from an object of ``size`` bytes."""

    key: str
    ranges: Sequence[Range]
    buffers: Sequence[memoryview]
    size: int


@dataclass(eq=False, slots=True)
class Reservation:
    """Space a tier set aside for an object the store builds in place."""

    tier: Reserves
    token: Any
    view: memoryview
    committed: bool = False


class GroupObject(ABC):
    """One object of a group as the cascade hands it to a tier: its key and size, and
    its bytes, built on first use (a segment's layer is gathered out of the engine's
    pool only when the tier is ready to write it). ``reservation``: the bytes already
    lie in space reserved in a tier, which that tier publishes without a copy."""

    __slots__ = ("key", "nbytes", "reservation")

    def __init__(self, key: str, nbytes: int, reservation: Reservation | None = None) -> None:
        self.key = key
        self.nbytes = nbytes
        self.reservation = reservation

    @abstractmethod
    def buffers(self) -> Sequence[Buffer]:
        """The object's bytes (their concatenation); the same every call."""


class StoredObject(GroupObject):
    """An object whose bytes exist already."""

    __slots__ = ("data",)

    def __init__(
        self, key: str, data: Sequence[Buffer], reservation: Reservation | None = None
    ) -> None:
        super().__init__(key, sum(memoryview(b).nbytes for b in data), reservation)
        self.data = data

    def buffers(self) -> Sequence[Buffer]:
        return self.data


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a tier's medium is (all off by default, which is always safe); what it can
    do beyond the core methods is its capability protocols."""

    # Its objects outlive the process: the store scans it at open (restart).
    persistent: bool = False
    # Its blobs are device tensors (a gpu tier).
    on_device: bool = False
    # In-process memory that only this process writes: pages read from it are not
    # re-verified (as the engine's own pool is not); everything else is, per page.
    trusted: bool = False
    # Behind a network service (``tiers/outage.py``): it can be down or hang. While it
    # is down (``available``) no lookup counts what it holds, and an engine never
    # waits on it longer than ``engine.wait_s``.
    networked: bool = False


class Tier(ABC):
    """Base of every tier. Subclasses set ``config_cls`` (its ``kind`` is the tier's)
    and ``caps``, and take their config dataclass and the store's namespace as
    constructor arguments."""

    config_cls: ClassVar[Any]  # the config entry it opens from; its ``kind`` is the tier's
    kind: ClassVar[str]
    # What it offers; an instance may narrow it (a single Redis reads off the loop, a
    # cluster does not).
    caps: Capabilities = Capabilities()

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if "config_cls" in cls.__dict__:
            cls.kind = cls.config_cls.kind

    def __init__(self, cfg: Any, namespace: str | None = None) -> None:
        self.cfg = cfg
        self.name: str = cfg.name or self.kind
        # The namespace of the store using the tier; a shared tier checks it against
        # its server's.
        self.namespace = namespace
        # Set by a tier whose medium filled up before its budget did (a disk): the store
        # then lowers the budget to what the tier holds, and evicts to make room.
        self.out_of_space = False

    def charge(self, nbytes: int) -> int:
        """What the tier's budget is charged for an object of ``nbytes``: its bytes, and
        what the medium spends per object besides (a memory tier's bookkeeping): tiny
        objects are not free (docs/store.md, "What an object costs")."""
        return nbytes

    @property
    def available(self) -> bool:
        """False while the backing service is known to be down."""
        return True

    @property
    def ready(self) -> bool:
        """True when a call now would reach the service: it is up, or its backoff has
        expired and the next call is the probe."""
        return True

    def offers(self, capability: type) -> bool:
        """Whether this tier offers ``capability`` (one of the protocols below); a tier
        whose instances differ narrows it (a Redis Cluster reads only on the loop)."""
        return isinstance(self, capability)

    async def open(self) -> None:  # noqa: B027 - a default, not an abstract step
        """Connect or create; an unreachable service is logged, never raised."""

    async def close(self) -> None:  # noqa: B027
        """Release connections and files."""

    @abstractmethod
    async def get(self, key: str) -> Blob | None: ...

    @abstractmethod
    async def get_ranges(
        self, key: str, ranges: Sequence[Range], into: ReadInto = None
    ) -> list[Blob] | None:
        """The bytes of each ``(offset, length)`` range; ``None`` when the object is
        missing or shorter than a range asks. A tier that copies may read into ``into``:
        one buffer of at least the ranges' total size (the results are then views of
        it), or a list of writable memoryviews, one per range (the results are then
        those very views)."""

    @abstractmethod
    async def put(self, key: str, buffers: Sequence[Buffer]) -> bool:
        """Store the concatenation of ``buffers`` under ``key``, atomically: a reader
        sees the old object, no object, or the whole new one."""

    @abstractmethod
    async def delete(self, key: str) -> None: ...

    @abstractmethod
    async def contains(self, key: str) -> bool: ...

    async def scan(self) -> AsyncIterator[tuple[str, int]]:
        """Every key this tier holds and its size; persistent tiers only."""
        return
        yield  # pragma: no cover

    async def quarantine(self, key: str) -> None:
        """Take a corrupt object out of service (default: delete it)."""
        await self.delete(key)

    async def sizes(self, keys: Sequence[str]) -> list[int | None]:
        """The size of each key, None where absent."""
        out: list[int | None] = []
        for k in keys:
            b = await self.get(k)
            out.append(None if b is None else blob_nbytes(b))
        return out

    # ------------------------------------------------------------------ batches

    async def get_many(self, keys: Sequence[str]) -> list[Blob | None]:
        return list(await asyncio.gather(*(self.get(k) for k in keys)))

    async def get_ranges_many(
        self, items: Sequence[tuple[str, Sequence[Range]]]
    ) -> list[list[Blob] | None]:
        return list(await asyncio.gather(*(self.get_ranges(k, r) for k, r in items)))

    async def put_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        return list(await asyncio.gather(*(self.put(k, b) for k, b in items)))

    async def delete_many(self, keys: Sequence[str]) -> None:
        await asyncio.gather(*(self.delete(k) for k in keys))

    async def put_group(self, objects: Sequence[GroupObject]) -> bool:
        """Store ``objects`` as one group: all but the last concurrently, each built
        just before its write starts (so the next is built while the last is being
        written: a disk write runs in a worker thread), then the last. False, or an
        exception, leaves none of them in the tier."""
        ok = False
        if len(objects) == 1:  # one object: its own commit point, no tasks to run
            try:
                ok = bool(await self._put_object(objects[0], self._buffers_of(objects[0])))
                return ok
            finally:
                if not ok:
                    await self.delete_many([objects[0].key])
        try:
            for batch in (objects[:-1], objects[-1:]):
                tasks: list[asyncio.Future[bool]] = []
                try:
                    for obj in batch:
                        bufs = self._buffers_of(obj)  # built now, beside the previous write
                        tasks.append(asyncio.ensure_future(self._put_object(obj, bufs)))
                        await asyncio.sleep(0)  # let the write start
                finally:
                    oks = await asyncio.gather(*tasks, return_exceptions=True)
                for o in oks:
                    if isinstance(o, BaseException):
                        raise o
                if not all(oks):
                    return False
                more = batch is not objects[-1:] and len(objects) > 1
                medium = cast(SharedMedium, self) if self.offers(SharedMedium) else None
                if more and medium is not None and not await medium.confirm(objects[:-1]):
                    return False
            ok = True
            return True
        finally:
            if not ok:
                await self.delete_many([o.key for o in objects])

    def _buffers_of(self, obj: GroupObject) -> Iterable[Buffer]:
        """What ``put`` gets of ``obj``: its buffers (a tier that writes from a worker
        thread may take a ``SelfCheckedObject``'s ``written()`` instead)."""
        return obj.buffers()

    async def _put_object(self, obj: GroupObject, bufs: Iterable[Buffer]) -> bool:
        res = obj.reservation
        if res is not None and res.tier is self and not res.committed:
            return await cast(Reserves, self).put_reserved(obj.key, res)
        return await self.put(obj.key, bufs if isinstance(bufs, Sequence) else list(bufs))


@runtime_checkable
class SharedTier(Protocol):
    """A tier other processes write to (a cache server), asked per request for what
    they added."""

    async def lookup_prefix(
        self, seqs: Sequence[tuple[int, Sequence[bytes]]], *, claim: bool
    ) -> list[bytes] | None:
        """Per sequence ``(pages the asker has, page hashes)``, the manifests of the
        segments holding the pages after those; with ``claim``, the pages nobody holds
        are reserved for the asker's put. None: not answered."""


@runtime_checkable
class ReadsNow(Protocol):
    """Reads from any thread, with no event loop and no pin: a tier whose reads are
    blocking calls that see one whole version of an object, never one changed in place
    (a disk tier, a single Redis)."""

    def read_into_now(self, reads: Sequence[NowRead], each: RangeIn | None = None) -> list[bool]:
        """Each read's ranges into its buffers from the calling thread; ``each(j, i,
        sum)`` runs as soon as range ``i`` of read ``j`` is in, on the thread that read
        it, with ``sum`` the ``checksum`` of its bytes, hashed while they were in the
        CPU's cache. Per read, False: not read here (absent, of another size, or shorter
        than a range); ``get_ranges`` on the store's loop decides."""
        ...


@runtime_checkable
class Reserves(Protocol):
    """Objects built in the tier's own memory (the cpu arena): the writer gathers pages
    straight into their place."""

    def reserve(self, nbytes: int) -> Reservation | None:
        """Writable space for an object the caller builds in place (None: no room)."""
        ...

    async def put_reserved(self, key: str, res: Reservation) -> bool:
        """Publish a reserved buffer under ``key``, as ``put`` would its bytes."""
        ...

    def unreserve(self, res: Reservation) -> None:
        """Give back space never published."""
        ...


@runtime_checkable
class SharedMedium(Protocol):
    """A medium several processes open at once (a disk folder, an S3 prefix): each tells
    the others what it added and removed, and cleans up only what no live writer may
    still be committing."""

    def log_changes(self, added: Sequence[str] = (), removed: Sequence[str] = ()) -> None:
        """Tell the others: after a group is written (its last key), a key removed."""
        ...

    def changes(self) -> list[tuple[bool, str]]:
        """What the others logged since the last call: ``(added, key)``."""
        ...

    def has_changes(self) -> bool:
        """Whether ``changes`` may have something to say, without reading it: from any
        thread, with no effect (a false yes costs one ``changes``)."""
        ...

    async def removable_orphans(self, keys: Sequence[str]) -> list[str]:
        """Of the uncommitted keys a restart scan found, those no live writer may still
        be committing."""
        ...

    async def confirm(self, objects: Sequence[GroupObject]) -> bool:
        """Before a group's last object (its commit point) is written: the others are
        there, whole (another store's cleanup may have taken them)."""
        ...


@runtime_checkable
class HelpsWrites(Protocol):
    """A tier whose writes queue for threads of its own (the disk tier): a thread that
    would otherwise wait for them may run them."""

    def help_write(self) -> bool:
        """Run one batch of queued writes on the calling thread (never the loop's);
        False: none queued."""
        ...


def tell_others(tier: Tier, added: Sequence[str] = (), removed: Sequence[str] = ()) -> None:
    """``log_changes`` on a medium other processes share; nothing on any other tier."""
    if tier.offers(SharedMedium):
        cast(SharedMedium, tier).log_changes(added, removed)
