"""The S3 tier's change log (docs/format.md, "An S3 prefix"): this store's entries for
what it committed and removed, written in the background; the other stores' entries,
listed every ``change_poll_s``; and entries older than ``change_log_keep_s`` deleted.
The names are ``tiers/changelog.py``'s. Part of the S3 tier (``tiers/s3.py``)."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import obstore

from hurray_store.tiers.changelog import ChangeFeed, entry_time_ms

if TYPE_CHECKING:
    from hurray_store.tiers.s3 import S3Tier

_LOG_PAGE = 10_000  # change log entries one listing takes at most


class S3ChangeLog:
    """The change log under ``log`` (a key prefix) of tier ``t`` (its client, config
    and guarded calls)."""

    def __init__(self, t: S3Tier, log: str) -> None:
        self.t, self.log = t, log
        self.feed = ChangeFeed(secrets.token_hex(6))
        self._poller: asyncio.Task[None] | None = None
        self._writing: set[asyncio.Task[None]] = set()
        self._cleaned = 0.0  # when the log's old entries were last deleted
        self._limit_s = t.cfg.change_poll_timeout_s  # a poll's own, not a request's

    def start(self) -> None:
        """Poll every ``change_poll_s`` (0: never)."""
        if self.t.cfg.change_poll_s > 0 and self._poller is None:
            self._poller = asyncio.ensure_future(self._poll_forever())

    async def stop(self) -> None:
        """Stop polling, and wait for this store's entries to be written."""
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
            self._poller = None
        await asyncio.gather(*self._writing, return_exceptions=True)

    def write(self, added: Sequence[str] = (), removed: Sequence[str] = ()) -> None:
        """This store's entries for the groups it committed and removed, written in the
        background."""
        names = self.feed.names(added, removed)
        if names:
            task = asyncio.ensure_future(self._write_log(names))
            self._writing.add(task)
            task.add_done_callback(self._writing.discard)

    async def _write_log(self, names: list[str]) -> None:
        for name in names:

            async def run(name: str = name) -> None:
                await obstore.put_async(self.t.store, self.log + name, b"")

            await self.t.guard("PUT (change log)", run, None)

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.t.cfg.change_poll_s)
            await self.poll()

    async def poll(self) -> None:
        """List the change log for what the other stores did since the last listing
        (at most ``_LOG_PAGE`` entries a call; the rest the next time)."""
        n = len(self.log)

        async def run() -> list[str]:
            got: list[str] = []
            stream = obstore.list(
                self.t.store, self.log, offset=self.log + self.feed.offset(), chunk_size=1000
            )
            async for batch in stream:
                got += [m["path"][n:] for m in batch]
                if len(got) >= _LOG_PAGE:
                    break
            return got

        names = await self.t.background("LIST (change log)", run, None, self._limit_s)
        for name in names or ():
            self.feed.add(name)
        self.feed.forget_old()
        now = time.time()
        if now - self._cleaned > self.t.cfg.change_log_keep_s / 10:
            self._cleaned = now
            await self._clean_log(now)

    async def _clean_log(self, now: float) -> None:
        """Delete the log's entries older than ``change_log_keep_s`` (at most
        ``_LOG_PAGE`` a call), oldest first, stopping at the first younger one."""
        edge = (now - self.t.cfg.change_log_keep_s) * 1000
        n = len(self.log)

        async def run() -> list[str]:
            old: list[str] = []
            async for batch in obstore.list(self.t.store, self.log, chunk_size=1000):
                for m in batch:
                    ts = entry_time_ms(m["path"][n:])
                    if ts is not None and ts >= edge:
                        return old
                    old.append(m["path"])
                if len(old) >= _LOG_PAGE:
                    break
            return old

        old = await self.t.background("LIST (change log)", run, None, self._limit_s)
        if old:

            async def delete() -> None:
                await obstore.delete_async(self.t.store, old)

            await self.t.background("DELETE (change log)", delete, None, self._limit_s)
