"""A tier behind a network service (Redis, S3, a cache server): its outage rules
(``Outage``) and the guarded call every request of such a tier goes through
(``ServiceTier.guard``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from hurray_store.tiers.base import Tier
from hurray_store.tiers.helpers import transfer_timeout_s

log = logging.getLogger(__name__)
T = TypeVar("T")


class Outage:
    """The outage rules of a tier behind a network service: the first failure logs one
    warning and starts a backoff (doubling from ``initial_s`` to ``max_s``) during
    which calls return at once without touching the network; the first call after it
    probes the service; a success logs the recovery."""

    def __init__(self, tier: str, initial_s: float, max_s: float) -> None:
        self.tier = tier
        self.initial_s = initial_s
        self.max_s = max_s
        self.down_since: float | None = None
        self.retry_at = 0.0
        self.backoff = initial_s
        self.count = 0

    @property
    def available(self) -> bool:
        return self.down_since is None

    @property
    def ready(self) -> bool:
        return self.down_since is None or time.monotonic() >= self.retry_at

    def down(self, what: str, e: BaseException) -> None:
        now = time.monotonic()
        if self.down_since is None:
            self.down_since = now
            self.count += 1
            log.warning(
                "tier %s: unreachable (%s during %s: %s); reads miss and writes are skipped "
                "until it answers again",
                self.tier,
                e.__class__.__name__,
                what,
                e,
            )
        else:
            self.backoff = min(self.backoff * 2, self.max_s)
        self.retry_at = now + self.backoff

    def up(self) -> None:
        if self.down_since is not None:
            log.warning(
                "tier %s: reachable again after %.1f s",
                self.tier,
                time.monotonic() - self.down_since,
            )
            self.down_since = None
            self.backoff = self.initial_s


class ServiceTier(Tier):
    """A tier behind a network service (Redis, S3, a cache server): its availability is
    its ``Outage``'s, which the subclass creates in its constructor."""

    outage: Outage
    _calls: asyncio.Semaphore  # guarded calls in flight at once, set by the subclass

    @property
    def available(self) -> bool:
        return self.outage.available

    @property
    def ready(self) -> bool:
        return self.outage.ready

    async def guard(
        self,
        what: str,
        call: Callable[[], Awaitable[T]],
        default: T,
        nbytes: int = 0,
        extra_s: float = 0.0,
        *,
        timed: bool = False,
    ) -> T:
        """Run one call under the outage rules, at most ``_calls`` at once, timed out
        after ``timeout_s`` plus one second per 50 MB it moves (plus ``extra_s``), or,
        ``timed``, by the call itself (it learns its size on the way). What it raises
        goes to ``_failed``; the call is then ``default``."""
        if not self.outage.ready:
            return default
        limit = None if timed else transfer_timeout_s(self.cfg.timeout_s, nbytes) + extra_s
        try:
            async with self._calls, asyncio.timeout(limit):
                result = await call()
        except Exception as e:
            await self._failed(what, e)
            return default
        self.outage.up()
        return result

    async def _failed(self, what: str, e: Exception) -> None:
        """A guarded call raised ``e``: an outage by default. A subclass tells its
        service's refusals and misses apart, and re-raises what is a bug."""
        self.outage.down(what, e)
