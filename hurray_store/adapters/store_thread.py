"""A hurray_store TieredStore on an event loop of its own thread, for engines' threads
(LMCache's, vLLM's)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import CancelledError, Future
from functools import partial
from typing import Any, TypeVar

from hurray_store.store import TieredStore, open_store

T = TypeVar("T")


class StoreThread:
    """A store on an event loop of its own thread: LMCache calls from its threads;
    every store call (pins included) runs on this loop."""

    def __init__(self, config: Any, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self.store: TieredStore = self.call(open_store(config))
        # Unpins wait here for the loop, which takes them all at its next turn: an
        # engine lets a lookup's chunks go one call per chunk.
        self._unpins: list[str] = []
        self._unpins_lock = threading.Lock()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the store's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def start_all(self, items: Sequence[tuple[Coroutine[Any, Any, T], Future[T]]]) -> None:
        """Run each coroutine on the store's loop, its outcome set on its future (made
        by the caller, who may have added callbacks), all handed over at once: one
        wake-up of the loop's thread for the lot, not one per coroutine. If the loop is
        closed, every future fails with the RuntimeError, which is raised too."""

        def start() -> None:
            for coro, fut in items:
                if not fut.set_running_or_notify_cancel():
                    coro.close()  # cancelled before it ran
                    continue
                self.loop.create_task(coro).add_done_callback(partial(_settle, fut))

        try:
            self.loop.call_soon_threadsafe(start)
        except RuntimeError as e:
            for coro, fut in items:
                coro.close()
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(e)
            raise

    def call_now(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` (no ``await`` in it) on the store's loop and wait for its result:
        a plain callback, with no task, about 35 us a trip here against 55 for
        ``call``."""
        fut: Future[T] = Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the caller, who raises it
                fut.set_exception(e)

        self.loop.call_soon_threadsafe(run)
        return fut.result()

    def pin_prefix(self, keys: Sequence[str]) -> int:
        """Pin, in one trip to the store's loop, the longest run of ``keys`` from the
        first that a get will find; its length. The books are read and the pins taken
        in one step of the loop, so nothing is evicted in between. A shared tier (a
        cache server) is asked about what the books lack, and what it holds is pinned
        in the books too."""
        if self.store.shared:
            return self.call(held_prefix(self.store, list(keys), pin=True))
        return self.call_now(partial(_pin_prefix, self.store, list(keys)))

    def unpin_soon(self, keys: Sequence[str]) -> None:
        """Unpin ``keys`` without waiting: the loop takes every unpin handed over
        since its last turn at once, before anything submitted after this call (its
        callbacks run in the order they were handed over)."""
        with self._unpins_lock:
            first = not self._unpins
            self._unpins += keys
        if first:
            self.loop.call_soon_threadsafe(self._take_unpins)

    def _take_unpins(self) -> None:
        with self._unpins_lock:
            keys, self._unpins = self._unpins, []
        self.store.unpin_objects(keys)

    def close(self) -> None:
        """Flush and close the store, then stop the loop."""
        try:
            self.call(self.store.close(), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)


def _settle(fut: Future[T], task: asyncio.Task[T]) -> None:
    if task.cancelled():
        fut.set_exception(CancelledError())
    elif (e := task.exception()) is not None:
        fut.set_exception(e)
    else:
        fut.set_result(task.result())


def _books_prefix(store: TieredStore, keys: list[str]) -> int:
    """How many of ``keys``, from the first, the books hold where a get will find them."""
    return next((i for i, k in enumerate(keys) if not store.has_object(k)), len(keys))


def _pin_prefix(store: TieredStore, keys: list[str]) -> int:
    """On the store's loop (the books are the loop's alone): the books, then the pins."""
    n = _books_prefix(store, keys)
    store.pin_objects(keys[:n])
    return n


async def held_prefix(store: TieredStore, keys: list[str], pin: bool) -> int:
    """On the store's loop: how many of ``keys``, from the first, a get will find,
    pinned with ``pin``. What other processes sharing a tier did is heard first; then
    the books, and the pins in the same step when no tier is shared. A shared tier (a
    cache server) is asked, all at once, about the keys from the first the books lack."""
    await store.sync()
    n = _books_prefix(store, keys)
    if store.shared and n < len(keys):
        rest = await asyncio.gather(*(store.contains_object(k) for k in keys[n:]))
        n += rest.index(False) if False in rest else len(rest)
    if pin:
        store.pin_objects(keys[:n])
    return n
