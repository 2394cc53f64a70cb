"""The port's loads of whole objects in order (``OrderedLoads``): read (ahead, on a
helper thread, where a tier reads on the calling thread; else on the store's loop, into
a staging buffer), checked by the engine, then copied into its memory, up to the first
that is not held or not right (docs/engine.md, "What it owns")."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from hurray_store.engine.bound import WaitBound
from hurray_store.store import TieredStore
from hurray_store.tiers import Range

log = logging.getLogger(__name__)

NOT_HERE = "not read on the calling thread"  # an object ``ReadAhead`` leaves to the loop
# check(j, object bytes) -> why object j is not right ("" when it is)
Check = Callable[[int, memoryview], str]
# take(j, object as a uint8 tensor): copy object j into the engine's memory
Take = Callable[[int, torch.Tensor], None]


class ReadAhead:
    """Reads of whole objects of one size on a thread of its own, each into one of a
    few reused buffers, while the caller takes the ones before it, in order."""

    def __init__(self, object_bytes: int, buffers: int = 3) -> None:
        self.object_bytes = object_bytes
        self.pool = ThreadPoolExecutor(1, "hurray-read-ahead")
        self.buffers = [torch.empty(object_bytes, dtype=torch.uint8) for _ in range(buffers)]

    def run(
        self,
        n: int,
        read: Callable[[int, memoryview], str | None],
        take: Callable[[int, torch.Tensor], None],
        wait_s: float | None = None,
    ) -> tuple[int, str | None]:
        """``read(j, into)`` of objects ``0 .. n - 1`` in order on the helper thread
        (None: read and right, else why not), ``take(j, buffer)`` of each right one on
        the caller's, in order, up to the first that is not: how many were taken, and
        why the next one was not (None: all were). An object not read in ``wait_s``
        raises ``Late`` (its read goes on: this ReadAhead is not used again)."""
        free: queue.SimpleQueue[int] = queue.SimpleQueue()
        ready: queue.SimpleQueue[tuple[int, int, str | None] | BaseException] = queue.SimpleQueue()
        for i in range(len(self.buffers)):
            free.put(i)
        stop = threading.Event()
        views = [memoryview(b.numpy()) for b in self.buffers]  # type: ignore[arg-type]

        def reader() -> None:
            try:
                for j in range(n):
                    i = free.get()
                    if stop.is_set():
                        return
                    why = read(j, views[i])
                    ready.put((j, i, why))
                    if why is not None:
                        return
            except BaseException as e:  # handed to the caller
                ready.put(e)

        done = self.pool.submit(reader)
        taken, why = 0, None
        late = False
        try:
            while taken < n:
                try:
                    got = ready.get(timeout=wait_s)
                except queue.Empty:
                    late = True
                    raise Late(done, taken) from None
                if isinstance(got, BaseException):
                    raise got
                j, i, why = got
                if why is not None:
                    break
                take(j, self.buffers[i])
                free.put(i)
                taken += 1
        finally:
            stop.set()
            free.put(0)  # wakes a reader waiting for a buffer; it sees stop
            if not late:
                done.result()
        return taken, why

    def close(self, wait: bool = True) -> None:
        self.pool.shutdown(wait=wait)


class Late(Exception):  # noqa: N818 - not an error: a read past the engine's bound
    """A read-ahead went past the engine's bound after ``taken`` objects; ``done``
    ends when its read does."""

    def __init__(self, done: Future[None], taken: int) -> None:
        super().__init__("read past the engine's bound")
        self.done, self.taken = done, taken


class OrderedLoads:
    """``EnginePort.load`` for one port: its read-ahead thread and staging buffer."""

    def __init__(self, bound: WaitBound) -> None:
        self.store, self.bound = bound.st.store, bound
        self._ahead: ReadAhead | None = None
        self._staging: torch.Tensor | None = None  # objects read on the loop (uint8)
        self._lock = threading.Lock()  # one load at a time uses the buffers

    def run(self, names: Sequence[str], size: int, check: Check, take: Take) -> tuple[int, str]:
        """Objects ``names`` (each ``size`` bytes), in order, read whole, ``check``ed,
        then ``take``n, up to the first not held or not right: how many were taken,
        and why the next was not ("" when all were, or it was not held)."""
        with self._lock:
            return self._run(names, size, check, take)

    def _run(self, names: Sequence[str], size: int, check: Check, take: Take) -> tuple[int, str]:
        n, whole = len(names), [(0, size)]
        if self._ahead is None or self._ahead.object_bytes != size:
            if self._ahead is not None:
                self._ahead.close()
            self._ahead = ReadAhead(size)

        def read(j: int, into: memoryview) -> str | None:
            if not self.store.read_objects_into_now([(names[j], whole, [into])])[0]:
                return NOT_HERE
            return check(j, into) or None

        wait = None if self.bound.wait_s is None else self.bound.limit(size)
        try:
            at, why = self._ahead.run(n, read, take, wait)
        except Late as e:  # its buffers stay the late reader's: a new ReadAhead next time
            self.bound.went_late(e.done)
            self._ahead.close(wait=False)
            self._ahead = None
            return e.taken, ""
        if why != NOT_HERE:
            return at, why or ""
        # the rest on the store's loop, all at once, then checked and taken in order
        objs = self._objects(n - at, size)
        mvs = [memoryview(objs[i].numpy()) for i in range(n - at)]  # type: ignore[arg-type]
        items = [(name, whole, [mv]) for name, mv in zip(names[at:], mvs, strict=True)]
        got = self.bound.run(read_all(self.store, items, len(items)), None, nbytes=n * size)
        if got is None:  # late, or another call is: the staging buffer stays its reader's
            self._staging = None
            return at, ""
        for i, ok in enumerate(got):
            if not ok:
                return at + i, ""
            if why := check(at + i, mvs[i]):
                return at + i, why
            take(at + i, objs[i])
        return n, ""

    def _objects(self, n: int, size: int) -> torch.Tensor:
        buf = self._staging
        if buf is None or buf.shape[0] < n or buf.shape[1] != size:
            buf = self._staging = torch.empty((max(n, 8), size), dtype=torch.uint8)
        return buf

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.close()


async def read_all(
    store: TieredStore,
    items: Sequence[tuple[str, Sequence[Range], Sequence[memoryview]]],
    in_flight: int,
) -> list[bool]:
    """On the store's loop: each ``(name, ranges, buffers)`` read, ``in_flight`` at a
    time; per item, read or not (a read that failed is a miss, logged)."""
    at_once = asyncio.Semaphore(in_flight)

    async def one(name: str, ranges: Sequence[Range], into: Sequence[memoryview]) -> bool:
        async with at_once:
            try:
                return await store.read_object_into(name, ranges, into)
            except Exception as e:  # noqa: BLE001 - a read that failed is a miss
                log.warning("engine port: read of %s failed: %r", name, e)
                return False

    return list(await asyncio.gather(*(one(*it) for it in items)))
