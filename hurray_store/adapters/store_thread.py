"""A hurray_store TieredStore on an event loop of its own thread, for engines' threads
(LMCache's, vLLM's)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable, Sequence
from concurrent.futures import CancelledError, Future
from functools import partial
from typing import Any, TypeVar

from hurray_store.store import Pin, TieredStore, open_store

T = TypeVar("T")


class StoreThread:
    """A store on an event loop of its own thread: LMCache calls from its threads;
    every store call runs on this loop but the ledger's reads and pins, and the reads
    of ``read_objects_into_now``, which run on the caller's thread."""

    def __init__(self, config: Any, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self.store: TieredStore = self.call(open_store(config))

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

    def pin_prefix(self, keys: Iterable[str]) -> list[Pin]:
        """Pin the longest run of ``keys`` from the first that a get will find; the
        pins, to give back to ``store.unpin``. From the ledger, on the calling thread
        (their lock keeps any victim from being chosen between the check and the pin).
        A shared tier (a cache server) is asked about what the ledger lacks, on the
        store's loop, and what it holds is pinned in the ledger too. ``keys`` may be
        lazy: with no shared tier, none is taken past the first miss."""
        if self.store.shared:
            return self.call(pin_held_prefix(self.store, list(keys)))
        return self.store.pin_held_objects(keys)

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


async def held_prefix(store: TieredStore, keys: Iterable[str]) -> int:
    """On the store's loop: how many of ``keys``, from the first, a get will find. What
    other processes sharing a tier did is read first; then the ledger. A shared tier (a
    cache server) is asked, all at once, about the keys from the first the ledger lacks.
    ``keys`` is taken one at a time: with no shared tier, none past the first miss."""
    await store.sync()
    n, it = 0, iter(keys)
    for k in it:
        if not store.has_object(k):
            if store.shared:
                rest = await asyncio.gather(*(store.contains_object(x) for x in (k, *it)))
                n += rest.index(False) if False in rest else len(rest)
            break
        n += 1
    return n


async def pin_held_prefix(store: TieredStore, keys: Iterable[str]) -> list[Pin]:
    """``held_prefix``'s objects, pinned; the pins. With no shared tier, the ledger's
    check and the pins are one step under their lock, and ``keys`` is taken one at a
    time, none past the first miss."""
    if not store.shared:
        await store.sync()
        return store.pin_held_objects(keys)
    names = list(keys)
    return store.pin_objects(names[: await held_prefix(store, names)])
