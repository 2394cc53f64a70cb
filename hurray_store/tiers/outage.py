"""A tier behind a network service (Redis, S3, a cache server): its outage rules
(``Outage``) and the guarded call every request of such a tier goes through
(``ServiceTier.guard``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from hurray_store.throttle import Every
from hurray_store.tiers.base import Tier
from hurray_store.tiers.helpers import transfer_timeout_s

log = logging.getLogger(__name__)
T = TypeVar("T")


class Outage:
    """The outage rules of a tier behind a network service: the first failure logs one
    warning and starts a backoff (doubling from ``initial_s`` to ``max_s``). Once the
    tier is open (``watch``), the outage is over only when a background probe of the
    service answers: every call until then returns at once (a miss, a skipped write)
    without touching the network, so no caller (an engine's step) ever waits on a
    service that timed out once. Before ``watch`` the first call after the backoff
    probes, as a tool that never opened the tier expects."""

    def __init__(self, tier: str, initial_s: float, max_s: float) -> None:
        self.tier = tier
        self.initial_s = initial_s
        self.max_s = max_s
        self.down_since: float | None = None
        self.retry_at = 0.0
        self.backoff = initial_s
        self.count = 0
        self.probes = 0  # background probes made
        self.upkeep_warn = Every(60.0)  # the tier's upkeep failing: once a minute at most
        self._probe: Callable[[], Awaitable[object]] | None = None
        self._probe_timeout_s = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._prober: asyncio.Task[None] | None = None

    @property
    def available(self) -> bool:
        return self.down_since is None

    @property
    def ready(self) -> bool:
        if self._probe is not None:
            return self.down_since is None
        return self.down_since is None or time.monotonic() >= self.retry_at

    def watch(self, probe: Callable[[], Awaitable[object]], timeout_s: float) -> None:
        """From now on (on the running loop) an outage ends when ``probe()`` returns
        within ``timeout_s`` (anything it raises is the outage going on)."""
        self._probe, self._probe_timeout_s = probe, timeout_s
        self._loop = asyncio.get_running_loop()
        if self.down_since is not None:
            self._start_probing()

    def stop(self) -> None:
        """No more probes (the tier is closing)."""
        self._probe = None
        if self._prober is not None:
            self._prober.cancel()
            self._prober = None

    def down(self, what: str, e: BaseException) -> None:
        """A call failed as the service does when it is down (any thread)."""
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
            if self._probe is not None and self._loop is not None:
                # a closed loop: nothing left to probe for
                with contextlib.suppress(RuntimeError):
                    self._loop.call_soon_threadsafe(self._start_probing)
        else:
            self.backoff = min(self.backoff * 2, self.max_s)
        self.retry_at = now + self.backoff

    def _start_probing(self) -> None:
        if self._probe is not None and (self._prober is None or self._prober.done()):
            self._prober = asyncio.ensure_future(self._probing())

    async def _probing(self) -> None:
        while self.down_since is not None and self._probe is not None:
            await asyncio.sleep(max(0.0, self.retry_at - time.monotonic()))
            self.probes += 1
            try:
                async with asyncio.timeout(self._probe_timeout_s):
                    await self._probe()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the outage goes on
                self.down("probe", e)
                continue
            self.up()

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

    async def background(
        self, what: str, call: Callable[[], Awaitable[T]], default: T, limit_s: float
    ) -> T:
        """Run one call of the tier's own upkeep (a change-log poll), at most ``_calls``
        at once, timed out after ``limit_s``: what fails or runs past it is logged
        (once a minute at most) and is ``default``. It never marks the tier down, nor
        runs while it is: upkeep that is slow on a busy machine is no outage, and only
        the requests an engine waits for decide one."""
        if not self.outage.available:
            return default
        try:
            async with self._calls, asyncio.timeout(limit_s):
                return await call()
        except Exception as e:  # noqa: BLE001 - upkeep retried at its next turn
            if self.outage.upkeep_warn.due():
                log.info("tier %s: %s did not finish (%r); retried later", self.name, what, e)
            return default

    async def _failed(self, what: str, e: Exception) -> None:
        """A guarded call raised ``e``: an outage by default. A subclass tells its
        service's refusals and misses apart, and re-raises what is a bug."""
        self.outage.down(what, e)
