"""Writes handed to a tier's writer threads in batches (``WriteJobs``): the writes
asked for in one turn of the event loop go out as a few jobs, and each job's outcomes
come back to the loop a few at a time. One trip to a thread pool and back per object
(``run_in_executor``) cost the loop and the writer a wake-up each and a hand over of
the GIL both ways: for a batch of page-sized objects that was as much time as the
writes themselves on 2 cores (docs/benchmarks.md, SGLang).

A thread that would otherwise only wait for its writes (SGLang's, in a set) may run
queued jobs itself (``help``): on 2 cores that is a second writer, and the pages it
writes are the ones it has just copied, still in its CPU's cache."""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from hurray_store.tiers.types import Buffer

Write = Callable[[str, Iterable[Buffer], int | None], bool]
_Item = tuple[str, Iterable[Buffer], int | None, asyncio.Future[bool]]
_Done = list[tuple[asyncio.Future[bool], bool | BaseException]]
JOB_ITEMS = 8  # writes per job at most: a helper or another thread takes the next
SETTLE_S = 0.001  # a job hands its outcomes back at least this often (a commit waits no more)


class WriteJobs:
    """``put(key, buffers, nbytes)``: ``write(key, buffers, nbytes)`` on one of
    ``threads`` threads of ``pool`` (or a helping caller's), awaited. The writes asked
    for before the loop's next turn are split in order into jobs of at most
    ``JOB_ITEMS``, each written one after the other by whoever takes it."""

    def __init__(self, write: Write, pool: ThreadPoolExecutor, threads: int) -> None:
        self.write, self.pool, self.threads = write, pool, max(1, threads)
        self._waiting: list[_Item] = []
        self._jobs: collections.deque[tuple[asyncio.AbstractEventLoop, list[_Item]]] = (
            collections.deque()
        )
        self._lock = threading.Lock()

    async def put(self, key: str, buffers: Iterable[Buffer], nbytes: int | None = None) -> bool:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()
        if not self._waiting:
            loop.call_soon(self._hand_over, loop)
        self._waiting.append((key, buffers, nbytes, fut))
        return await fut

    def _hand_over(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self._waiting = self._waiting, []
        step = min(JOB_ITEMS, -(-len(batch) // self.threads))
        for at in range(0, len(batch), step):
            job = (loop, batch[at : at + step])
            with self._lock:
                self._jobs.append(job)
            try:
                self.pool.submit(self._run_next)
            except RuntimeError as e:  # the pool is shut down: the tier closed
                with self._lock:
                    taken = job in self._jobs
                    if taken:
                        self._jobs.remove(job)
                if taken:
                    _settle([(fut, e) for *_, fut in job[1]])

    def help(self) -> bool:
        """Run the newest queued job on the calling thread (any thread but the loop's);
        False when none was queued."""
        with self._lock:
            if not self._jobs:
                return False
            loop, part = self._jobs.pop()
        self._run(loop, part)
        return True

    def _run_next(self) -> None:
        with self._lock:
            if not self._jobs:
                return  # a helper took it
            loop, part = self._jobs.popleft()
        self._run(loop, part)

    def _run(self, loop: asyncio.AbstractEventLoop, part: list[_Item]) -> None:
        """Each write of ``part`` in order (one whose caller stopped waiting is
        skipped), the outcomes handed to the loop every ``SETTLE_S`` and at the end."""
        done: _Done = []
        last = time.monotonic()
        for i, (key, buffers, nbytes, fut) in enumerate(part):
            if not fut.cancelled():
                try:
                    done.append((fut, self.write(key, buffers, nbytes)))
                except BaseException as e:  # the caller's to raise
                    done.append((fut, e))
            now = time.monotonic()
            if done and (now - last >= SETTLE_S or i == len(part) - 1):
                try:
                    loop.call_soon_threadsafe(_settle, done)
                except RuntimeError:  # the loop is closed: nobody waits
                    return
                done, last = [], now


def _settle(done: _Done) -> None:
    for fut, out in done:
        if fut.done():
            continue
        if isinstance(out, BaseException):
            fut.set_exception(out)
        else:
            fut.set_result(out)
