"""A hurray_store TieredStore on an event loop of its own thread, for engines' threads:
the port's (``engine.port``) way to the store's loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from concurrent.futures import CancelledError, Future
from functools import partial
from typing import Any, TypeVar

from hurray_store.store import TieredStore, open_store

T = TypeVar("T")


class StoreThread:
    """A store on an event loop of its own thread: engines call from theirs; every
    store call runs on this loop but the ledger's reads and pins, and the reads of
    ``read_objects_into_now``, which run on the caller's thread."""

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
