"""The Redis tier's writes acknowledged by replicas (``wait_replicas``): each pipeline
ends with a WAIT on the connection that wrote it, one pipeline per master of a cluster,
each master with a client of its own. Part of the Redis tier (``tiers/redis.py``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis

from hurray_store.tiers.base import GroupObject
from hurray_store.tiers.helpers import one_buffer

if TYPE_CHECKING:
    from hurray_store.tiers.redis import RedisTier

log = logging.getLogger(__name__)


class AckedWrites:
    """Acknowledged writes of tier ``t`` (its client, keys, TTL, config and guarded
    calls); ``kwargs``: what a cluster master's own client connects with."""

    def __init__(self, t: RedisTier, kwargs: dict[str, Any]) -> None:
        self.t, self._kwargs = t, kwargs
        # WAIT in a cluster goes to the master holding the keys, on the connection that
        # wrote them: a plain client per master (host:port), made when first needed.
        self.masters: dict[str, aioredis.Redis] = {}

    async def put(self, objects: Sequence[GroupObject]) -> bool:
        """SET ``objects`` and WAIT for ``wait_replicas`` acknowledgements: one pipeline
        per master, on one connection (WAIT counts the writes of its own connection)."""
        if not objects:
            return True
        by_master: dict[str, list[GroupObject]] = {}
        for o in objects:
            by_master.setdefault(self._master_of(o.key), []).append(o)
        n, ms = self.t.cfg.wait_replicas, int(self.t.cfg.wait_timeout_s * 1000)

        async def one(master: str, objs: list[GroupObject]) -> bool:
            client = self.masters.get(master, self.t.client)

            async def run() -> list[Any]:
                pipe = client.pipeline(transaction=False)
                for o in objs:
                    pipe.set(self.t.k(o.key), one_buffer(o.buffers()), ex=self.t.ttl_s)
                pipe.execute_command("WAIT", n, ms)
                return await pipe.execute()

            nbytes = sum(o.nbytes for o in objs)
            got = await self.t.guard("SET+WAIT", run, None, nbytes, self.t.cfg.wait_timeout_s)
            if got is None:
                if self.t.is_cluster:  # a master may have moved: ask the cluster again
                    await self.refresh_slots()
                return False
            if int(got[-1]) < n:
                log.warning(
                    "redis tier %s: %d of %d replicas acknowledged a write within %.1f s; "
                    "the write is skipped",
                    self.t.name,
                    int(got[-1]),
                    n,
                    self.t.cfg.wait_timeout_s,
                )
                return False
            return all(bool(g) for g in got[:-1])

        oks = await asyncio.gather(*(one(m, objs) for m, objs in by_master.items()))
        return all(oks)

    def _master_of(self, key: str) -> str:
        """The master holding ``key`` ("" for a single Redis), with a client of its own."""
        if not self.t.is_cluster:
            return ""
        node = self.t.client.get_node_from_key(self.t.k(key))
        if node is None:
            return ""
        if node.name not in self.masters:
            self.masters[node.name] = aioredis.Redis(host=node.host, port=node.port, **self._kwargs)
        return str(node.name)

    async def refresh_slots(self) -> None:
        try:
            await self.t.client.nodes_manager.initialize()
        except Exception as e:  # the cluster is still electing: the next write asks again
            log.debug("redis tier %s: refreshing the slot map: %s", self.t.name, e)
