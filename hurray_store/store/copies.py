"""The cascade's background copies: write-throughs, promotions and flushes of a group,
queued or running. A delete waits for a group's copies to end (they would put it back),
and ``flush`` waits for every task."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from hurray_store.store.ledger import Group


class BackgroundCopies:
    """Per group, how many copies of it are under way and the event set when the last
    one ends; and every background task of the cascade."""

    def __init__(self) -> None:
        self._groups: dict[Group, tuple[int, asyncio.Event]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    def __contains__(self, group: Group) -> bool:
        return group in self._groups

    def started(self, group: Group) -> None:
        n, ev = self._groups.get(group, (0, asyncio.Event()))
        self._groups[group] = (n + 1, ev)

    def ended(self, group: Group) -> None:
        n, ev = self._groups[group]
        if n > 1:
            self._groups[group] = (n - 1, ev)
            return
        del self._groups[group]
        ev.set()

    async def wait(self, group: Group) -> None:
        """Until no copy of ``group`` is under way."""
        under_way = self._groups.get(group)
        if under_way is not None:
            await under_way[1].wait()

    def spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Until every task spawned, and every task those spawned, has ended."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
