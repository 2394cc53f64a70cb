"""How long an engine waits on the store (``WaitBound``): on a store with a tier behind a
network service, a lookup or a load waits at most ``engine.wait_s`` (a load: plus its
transfer time); past it the call is a miss and goes on, late, on the store's loop, and
until every late call has ended each call is a miss at once. A hung server costs an
engine one bound, not one timeout per step (docs/engine.md, "A tier that hangs")."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from hurray_store.engine.thread import StoreThread
from hurray_store.throttle import Every
from hurray_store.tiers.helpers import transfer_timeout_s

log = logging.getLogger(__name__)
T = TypeVar("T")
WARN_EVERY_S = 10.0


class WaitBound:
    """The engine's wait on the store's loop. ``wait_s`` None: no bound but
    ``timeout`` (a store of cpu and disk tiers, which cannot hang as a network can)."""

    def __init__(self, st: StoreThread, wait_s: float | None, timeout: float) -> None:
        self.st, self.wait_s, self.timeout = st, wait_s, timeout
        self._late: list[Future[Any]] = []
        self.counts = {"calls_late": 0, "missed_while_late": 0}
        self._warn = Every(WARN_EVERY_S)

    @property
    def late(self) -> bool:
        """A call that went past the bound is still running."""
        if self._late:
            self._late = [f for f in self._late if not f.done()]
        return bool(self._late)

    def limit(self, nbytes: int = 0) -> float:
        """The wait for a call that moves ``nbytes``."""
        if self.wait_s is None:
            return self.timeout
        return transfer_timeout_s(self.wait_s, nbytes)

    def run(
        self,
        coro: Coroutine[Any, Any, T],
        default: T,
        *,
        nbytes: int = 0,
        on_late: Callable[[T], None] | None = None,
    ) -> T:
        """``coro`` on the store's loop, waited for at most ``limit(nbytes)``: its result,
        or ``default`` when it went past (it runs on; ``on_late(result)`` once it ends)
        or another call is still late (``coro`` is then not run)."""
        if self.wait_s is None:
            return self.st.call(coro, self.timeout)
        if self.late:
            coro.close()
            self.counts["missed_while_late"] += 1
            return default
        fut = self.st.submit(coro)
        try:
            return fut.result(self.limit(nbytes))
        except FutureTimeout:
            self.went_late(fut, on_late)
            return default

    async def run_async(
        self,
        coro: Coroutine[Any, Any, T],
        default: T,
        *,
        on_late: Callable[[T], None] | None = None,
    ) -> T:
        """``run`` from an engine's own event loop, which it never blocks: ``coro`` on
        the store's loop, awaited at most ``limit()``; ``default`` at once while a call
        is late."""
        if self.late:
            coro.close()
            self.counts["missed_while_late"] += 1
            return default
        fut = self.st.submit(coro)
        done, _ = await asyncio.wait({asyncio.wrap_future(fut)}, timeout=self.limit())
        if not done:
            self.went_late(fut, on_late)
            return default
        return fut.result()

    def went_late(self, fut: Future[T], on_late: Callable[[T], None] | None = None) -> None:
        """``fut``, a call of the engine, went past its bound: every call is a miss at
        once until it ends (``on_late(result)`` then, when it ended well)."""
        self.counts["calls_late"] += 1
        self._late.append(fut)
        if self._warn.due():
            log.warning(
                "engine port: a call to the store took longer than engine.wait_s (%.2f s): "
                "misses until it ends (%d calls late so far)",
                self.wait_s or self.timeout,
                self.counts["calls_late"],
            )
        if on_late is not None:

            def done(f: Future[T]) -> None:
                if not f.cancelled() and f.exception() is None:
                    on_late(f.result())

            fut.add_done_callback(done)
