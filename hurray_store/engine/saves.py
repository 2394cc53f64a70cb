"""The port's saves: objects an engine handed over, written behind it under one bounded
backlog (``SaveBacklog``), and a batch written from memory the engine lends until the
call returns (``write_lent``)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

from hurray_store.engine.thread import StoreThread
from hurray_store.store.objects import Data

log = logging.getLogger(__name__)
HELP_POLL_S = 0.0005  # how often a lent write that waits looks for a queued write to run


@dataclass(slots=True, eq=False)
class Save:
    """One object to store under ``name``; ``on_done(ok)`` runs once it is stored
    (True), failed or was dropped (False), on the store's thread or the caller's.
    ``write``, where an engine stores more than one object (the vLLM connector's
    segments): the coroutine that stores it, in place of a put of ``data``."""

    name: str
    data: Data | None
    nbytes: int
    on_done: Callable[[bool], None] | None = None
    write: Callable[[], Awaitable[bool]] | None = None


class SaveBacklog:
    """Saves waiting for the store, at most ``max_bytes`` of them (written or waiting):
    a save that does not fit drops the oldest that wait (never one being written), and
    is dropped itself if it still does not fit (at once if it is larger than the
    bound). At most ``in_flight`` are written at once, each a worker on the store's
    loop that takes the next when it is done. Never blocks the engine, never grows
    past its bound; each drop is counted."""

    def __init__(self, st: StoreThread, max_bytes: int, in_flight: int) -> None:
        if max_bytes < 1 or in_flight < 1:
            raise ValueError("a save backlog needs room for one byte and one writer")
        self.st, self.store = st, st.store
        self.max_bytes, self.in_flight = int(max_bytes), int(in_flight)
        # Saves not being written yet, oldest first, each with its number; a writer
        # takes one only once the loop has admitted it (``_admit``), so what an engine
        # handed the loop before a save (a touch of an object) takes effect first.
        self._waiting: deque[tuple[int, Save]] = deque()
        self._numbered = 0  # saves numbered so far
        self._admitted = 0  # the saves numbered up to this may be taken
        self._pending: dict[str, Save] = {}  # by name: waiting or being written
        self._bytes = self._workers = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self.counts = {"saved": 0, "failed": 0, "dropped": 0}
        self.closed = False  # the store is closed: a save fails at once

    def pending(self, name: str) -> bool:
        """A save of ``name`` waits or is being written."""
        return name in self._pending

    @property
    def nbytes(self) -> int:
        return self._bytes

    @property
    def waiting(self) -> int:
        """Saves handed over and not being written yet."""
        return len(self._waiting)

    def reserve(self, nbytes: int) -> bool:
        """Room for a save of ``nbytes`` before the engine copies it out (``add`` it
        with ``reserved``), made by dropping the oldest waiting saves; False (counted)
        when there is none. ``unreserve`` gives back room never used."""
        dropped: list[Save] = []
        with self._lock:
            if nbytes <= self.max_bytes:
                dropped = self._make_room(nbytes)
            fits = self._bytes + nbytes <= self.max_bytes  # saves being written stay
            if fits:
                self._bytes += nbytes
            else:
                self.counts["dropped"] += 1
        self._dropped(dropped)
        return fits

    def unreserve(self, nbytes: int) -> None:
        with self._lock:
            self._bytes -= nbytes
            if not self._pending:
                self._idle.notify_all()

    def _make_room(self, nbytes: int) -> list[Save]:
        """Under the lock: the oldest waiting saves dropped until ``nbytes`` more fit."""
        dropped = []
        while self._bytes + nbytes > self.max_bytes and self._waiting:
            dropped.append(old := self._waiting.popleft()[1])
            self._forget(old)
            self.counts["dropped"] += 1
        return dropped

    def _dropped(self, dropped: list[Save]) -> None:
        for s in dropped:
            _done(s, False)
        if dropped:
            log.warning(
                "engine port: %d saves dropped: the save backlog (%d bytes) is full",
                len(dropped),
                self.max_bytes,
            )

    def add(self, saves: Iterable[Save], reserved: bool = False) -> None:
        """Hand ``saves`` over (``reserved``: their room was taken by ``reserve``)."""
        if self.closed:
            for s in saves:
                with self._lock:
                    self.counts["failed"] += 1
                    if reserved:
                        self._bytes -= s.nbytes
                _done(s, False)
            return
        dropped: list[Save] = []
        with self._lock:
            for s in saves:
                if s.name in self._pending:
                    if reserved:
                        self._bytes -= s.nbytes
                    continue  # the one waiting stores the same object
                if not reserved:
                    if s.nbytes > self.max_bytes:  # could never fit: dropped alone
                        dropped.append(s)
                        self.counts["dropped"] += 1
                        continue
                    self._bytes += s.nbytes
                self._numbered += 1
                self._waiting.append((self._numbered, s))
                self._pending[s.name] = s
                if not reserved:
                    dropped += self._make_room(0)
            upto = self._numbered
        self._dropped(dropped)
        try:
            self.st.loop.call_soon_threadsafe(self._admit, upto)
        except RuntimeError:  # the store is closed: these are never written
            self._fail_waiting()

    def _forget(self, s: Save) -> None:
        """Under the lock: ``s`` is no longer pending."""
        self._bytes -= s.nbytes
        if self._pending.get(s.name) is s:
            del self._pending[s.name]
        if not self._pending:
            self._idle.notify_all()

    def _admit(self, upto: int) -> None:
        """On the loop, in turn with what else it was handed: the saves numbered up to
        ``upto`` may be written; writers started for them, up to ``in_flight``."""
        with self._lock:
            self._admitted = max(self._admitted, upto)
            # the waiting saves' numbers run on by one from the oldest (saves leave
            # only from the front): those admitted are the first ``ready``
            ready = self._admitted - self._waiting[0][0] + 1 if self._waiting else 0
            start = max(0, min(self.in_flight - self._workers, ready, len(self._waiting)))
            self._workers += start
        for _ in range(start):
            self.st.loop.create_task(self._worker())

    async def _worker(self) -> None:
        while True:
            with self._lock:
                if not self._waiting or self._waiting[0][0] > self._admitted:
                    self._workers -= 1  # the rest start when the loop admits them
                    return
                s = self._waiting.popleft()[1]
            ok = False
            try:
                if s.write is not None:
                    ok = await s.write()
                else:
                    assert s.data is not None
                    ok = await self.store.put_object(s.name, s.data, self_checked=True)
            except Exception as e:  # noqa: BLE001 - a failed save is a future miss
                log.warning("engine port: save of %s failed: %r", s.name, e)
            finally:
                with self._lock:
                    self._forget(s)
                    self.counts["saved" if ok else "failed"] += 1
                _done(s, ok)

    def _fail_waiting(self) -> None:
        with self._lock:
            left = [s for _, s in self._waiting]
            self._waiting.clear()
            for s in left:
                self._forget(s)
                self.counts["failed"] += 1
        for s in left:
            _done(s, False)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no save waits or is being written; False: ``timeout`` passed."""
        with self._lock:
            return self._idle.wait_for(lambda: not self._pending, timeout)


def _done(s: Save, ok: bool) -> None:
    if s.on_done is not None:
        try:
            s.on_done(ok)
        except Exception as e:  # noqa: BLE001 - the engine's callback, logged
            log.warning("engine port: completion of %s raised %r", s.name, e)


def write_lent(
    st: StoreThread, steps: Iterable[list[tuple[str, Data]]], timeout: float
) -> list[bool]:
    """Store each step's ``(name, data)`` objects, whose bytes the engine lends until
    this returns: a step's writes start on the store's loop as soon as it is made, while
    the caller makes the next (``steps`` may be lazy); then this thread, which would
    only wait, runs writes queued for the tiers' writer threads itself
    (``help_writes``); it returns once every write ended and the store flushed (written
    through every tier): the engine may reuse the memory. Per object, stored or not."""
    store = st.store
    futs: list[Future[list[bool]]] = []
    try:
        for step in steps:
            futs.append(st.submit(_put_all(st, step)))
        while left := [f for f in futs if not f.done()]:
            if not store.help_writes():  # none queued yet: look again soon
                wait(left, HELP_POLL_S, return_when=FIRST_COMPLETED)
    finally:
        # Every write that started ends before the engine reuses its memory.
        done = [f.result(timeout) for f in futs]
    st.call(store.flush(), timeout)
    return [ok for d in done for ok in d]


async def _put_all(st: StoreThread, items: list[tuple[str, Data]]) -> list[bool]:
    got = await asyncio.gather(
        *(st.store.put_object(n, data, self_checked=True) for n, data in items),
        return_exceptions=True,
    )
    return [r is True for r in got]
