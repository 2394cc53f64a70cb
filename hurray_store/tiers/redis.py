"""The ``redis`` tier: Redis or Redis Cluster through redis-py's asyncio clients (this
module and its parts, ``tiers/redis_*.py``, are the only ones that import ``redis``).

One object is one value written by one SET (atomic: a reader sees all of it or none).
Range reads are GETRANGE, pipelined; keys carry the segment id inside ``{...}``, Redis
Cluster's hash tag, so one segment's objects share a slot and its pipelines one node.
On a single Redis, a large SET (``BlockingRedis.set_vectored``) and a large ranged read into the
caller's buffers (``BlockingRedis.getrange_into``) go through redis-py's blocking connection from
worker threads, with no copy of the value on the event loop's thread. An engine's own
thread reads with no trip to the loop at all (``read_into_now``): per object one
transaction (its size, then its ranges in pieces of at most 2 MiB), on that thread and
up to 3 workers, each on a connection of its own, the bytes received straight into its
buffers.

Outages: every call is guarded. A connection error or timeout turns the call into a
miss (reads) or a skipped write (``False``), logs one warning for the whole outage, and
starts a backoff (``backoff_initial_s`` doubling to ``backoff_max_s``) during which calls
return at once without touching the network. The first call after the backoff probes
the server; success logs the recovery. redis-py's own retries are off, so a down server
costs one timeout, not several.

Budget: with ``capacity_bytes`` the store's policy evicts (LRU, whole groups) as for any
tier; set it below Redis' ``maxmemory`` with ``maxmemory-policy noeviction`` and no
segment is ever split. With ``null`` Redis evicts key by key (``allkeys-lru``): an object
Redis evicted is a miss on read, and its segment then leaves the ledger and the index.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from hurray_store.batches import batches
from hurray_store.config import RedisTierConfig
from hurray_store.errors import ConfigError
from hurray_store.tiers.base import Capabilities, GroupObject, NowRead, ReadsNow
from hurray_store.tiers.helpers import host_view, one_buffer
from hurray_store.tiers.outage import Outage, ServiceTier
from hurray_store.tiers.redis_acked import AckedWrites
from hurray_store.tiers.redis_blocking import SPLIT_BYTES, THREADS, BlockingRedis
from hurray_store.tiers.redis_now import OUTAGE
from hurray_store.tiers.self_checked import SelfCheckedObject
from hurray_store.tiers.types import Blob, Buffer, Range, RangeIn, ReadInto

log = logging.getLogger(__name__)
_PIPE_BYTES = 64 << 20  # values per pipeline round trip, at most (bounds client memory)


def _cluster_nodes(url: str) -> tuple[list[ClusterNode], dict[str, Any]]:
    """``redis+cluster://[user:pass@]h:p,h:p[/?...]`` -> startup nodes and auth."""
    u = urlsplit(url)
    netloc = u.netloc
    auth: dict[str, Any] = {}
    if "@" in netloc:
        cred, netloc = netloc.rsplit("@", 1)
        user, _, pw = cred.partition(":")
        if user:
            auth["username"] = user
        if pw:
            auth["password"] = pw
    nodes = []
    for hp in netloc.split(","):
        host, _, port = hp.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"url: cluster node {hp!r} is not host:port")
        nodes.append(ClusterNode(host.strip("[]"), int(port)))
    if u.scheme == "rediss+cluster":
        auth["ssl"] = True
    return nodes, auth


class RedisTier(ServiceTier):
    config_cls = RedisTierConfig
    caps = Capabilities(persistent=True, networked=True)

    def __init__(self, cfg: RedisTierConfig, namespace: str | None = None) -> None:
        super().__init__(cfg, namespace)
        self.prefix = cfg.key_prefix
        self.ttl_s = cfg.ttl_s
        scheme = urlsplit(cfg.url).scheme
        if scheme not in ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster"):
            raise ConfigError(
                f"url: expected redis://, rediss://, unix:// or redis+cluster://, got {cfg.url!r}"
            )
        self.is_cluster = cfg.cluster or scheme.endswith("+cluster")
        common: dict[str, Any] = {
            # Whole operations are timed by guard (longer for more bytes): a fixed
            # socket timeout would fail a 100 MB SET that is merely slow.
            "socket_timeout": None,
            "socket_connect_timeout": cfg.timeout_s,
            "retry": AsyncRetry(NoBackoff(), 0),  # the asyncio clients' own kind
            "max_connections": cfg.max_connections,
            "socket_read_size": 1 << 20,
        }
        if scheme.startswith("rediss"):
            common["ssl_ca_certs"] = cfg.tls_ca_file or None
            if cfg.tls_cert_file:
                common["ssl_certfile"] = cfg.tls_cert_file
                common["ssl_keyfile"] = cfg.tls_key_file
        self.client: Any
        master_kwargs: dict[str, Any] = {}  # a cluster master's own client's (WAIT)
        if self.is_cluster:
            if scheme.endswith("+cluster"):
                nodes, auth = _cluster_nodes(cfg.url)
                self.client = RedisCluster(startup_nodes=nodes, **auth, **common)
            else:
                u = urlsplit(cfg.url)
                auth = {"username": u.username, "password": u.password, "ssl": u.scheme == "rediss"}
                self.client = RedisCluster.from_url(cfg.url, **common)
            master_kwargs = {**{k: v for k, v in auth.items() if v}, **common}
        else:
            self.client = aioredis.Redis.from_url(cfg.url, **common)
        self.outage = Outage(self.name, cfg.backoff_initial_s, cfg.backoff_max_s)
        self._acked = AckedWrites(self, master_kwargs)  # with wait_replicas
        # Large SETs and ranged reads to a single Redis go out from threads, through
        # redis-py's blocking client (``redis_blocking.py``).
        self.write_threads = min(cfg.write_threads or THREADS, cfg.max_connections)
        self._blocking: BlockingRedis | None = None
        if not self.is_cluster:
            self._blocking = BlockingRedis(
                self.name,
                cfg.url,
                common,
                timeout_s=cfg.timeout_s,
                max_connections=cfg.max_connections,
                write_threads=self.write_threads,
                prefix=self.prefix,
                ttl_s=self.ttl_s,
                outage=self.outage,
            )
        # redis-py's asyncio pools raise when exhausted instead of waiting: queue here.
        self._calls = asyncio.Semaphore(cfg.max_connections)

    def k(self, key: str) -> str:
        return self.prefix + key

    # ------------------------------------------------------------------ outage guard

    async def _failed(self, what: str, e: Exception) -> None:
        if isinstance(e, OUTAGE):
            self.outage.down(what, e)
            await self._drop_connections()
        elif isinstance(e, RedisError):  # a refused command, not an outage
            log.warning("redis tier %s: %s failed: %s", self.name, what, e)
        else:
            raise e

    async def _drop_connections(self) -> None:
        """Close every pooled connection: after an outage they point at a dead server,
        and the first call on each would fail again after the server is back."""
        try:
            if self._blocking is not None:
                self._blocking.disconnect()
            if self.is_cluster:
                for node in self.client.get_nodes():
                    await node.disconnect()
            else:
                await self.client.connection_pool.disconnect()
        except Exception as e:  # best effort; the next probe reconnects anyway
            log.debug("redis tier %s: dropping connections: %s", self.name, e)

    # ------------------------------------------------------------------ interface

    async def open(self) -> None:
        await self.guard("open", self._ping, False)
        self.outage.watch(self._ping, self.cfg.timeout_s)

    async def _ping(self) -> bool:
        """PING answered (a cluster's slots read first): the outage's probe."""
        if self.is_cluster:
            await self.client.initialize()
        if not await self.client.ping():
            raise ConnectionError("PING not answered")
        return True

    async def close(self) -> None:
        self.outage.stop()
        for c in [self.client, *self._acked.masters.values()]:
            try:
                await c.aclose()
            except Exception as e:  # closing a dead connection must not fail a shutdown
                log.debug("redis tier %s: close: %s", self.name, e)
        if self._blocking is not None:
            self._blocking.close()

    async def get(self, key: str) -> Blob | None:
        return await self.guard("GET", lambda: self.client.get(self.k(key)), None)

    async def get_ranges(
        self, key: str, ranges: Sequence[Range], into: ReadInto = None
    ) -> list[Blob] | None:
        nbytes = sum(ln for _, ln in ranges)
        b = self._blocking
        if b is not None and isinstance(into, list | tuple) and nbytes >= SPLIT_BYTES:
            loop = asyncio.get_running_loop()
            bufs = [host_view(x) for x in into]

            async def straight() -> list[Blob] | None:
                return await loop.run_in_executor(b.reads, b.getrange_into, key, ranges, bufs)

            return await self.guard("GETRANGE", straight, None, nbytes)
        return (await self.get_ranges_many([(key, ranges)]))[0]

    def offers(self, capability: type) -> bool:
        # A SET replaces a value whole and a GET returns one version of it: any thread
        # may read (read_into_now), on a single Redis; a cluster reads on the loop.
        return super().offers(capability) and not (capability is ReadsNow and self.is_cluster)

    def read_into_now(self, reads: Sequence[NowRead], each: RangeIn | None = None) -> list[bool]:
        """``BlockingRedis.read_into_now``, on a single Redis."""
        if self._blocking is None:
            return [False] * len(reads)
        return self._blocking.read_into_now(reads, each)

    async def get_ranges_many(
        self, items: Sequence[tuple[str, Sequence[Range]]]
    ) -> list[list[Blob] | None]:
        flat = [(self.k(key), off, ln) for key, ranges in items for off, ln in ranges]
        replies: list[Any] = []
        for part in batches(flat, lambda x: x[2], _PIPE_BYTES, self.cfg.pipeline_batch):

            async def run(part: list[tuple[str, int, int]] = part) -> list[Any]:
                pipe = self.client.pipeline(transaction=False)
                for kk, off, ln in part:
                    pipe.getrange(kk, off, off + ln - 1)
                return await pipe.execute()

            got = await self.guard("GETRANGE", run, None, sum(x[2] for x in part))
            if got is None:
                return [None] * len(items)
            replies += got
        out: list[list[Blob] | None] = []
        pos = 0
        for _key, ranges in items:
            parts = replies[pos : pos + len(ranges)]
            pos += len(ranges)
            ok = all(len(p) == ln for p, (_off, ln) in zip(parts, ranges, strict=True))
            out.append(parts if ok else None)
        return out

    async def put(self, key: str, buffers: Sequence[Buffer]) -> bool:
        parts = [host_view(b) for b in buffers]
        nbytes = sum(p.nbytes for p in parts)
        if self._off_loop(nbytes):
            return await self._set_off_loop(key, parts, nbytes)
        value = one_buffer(buffers)
        ok = await self.guard(
            "SET",
            lambda: self.client.set(self.k(key), value, ex=self.ttl_s),
            None,
            nbytes,
        )
        return bool(ok)

    async def _put_last(self, obj: GroupObject) -> bool:
        """``put`` of a group's last object. A self-checked one sent from a worker thread is
        hashed there, each part just before it is sent (``written()``), while its bytes
        are in the CPU's cache for the kernel's copy, and its record goes last."""
        if isinstance(obj, SelfCheckedObject) and self._off_loop(obj.nbytes):
            return await self._set_off_loop(obj.key, obj.written(), obj.nbytes)
        return await self.put(obj.key, obj.buffers())

    def _off_loop(self, nbytes: int) -> bool:
        return self._blocking is not None and nbytes >= SPLIT_BYTES

    async def _set_off_loop(self, key: str, parts: Iterable[Buffer], nbytes: int) -> bool:
        loop = asyncio.get_running_loop()
        b = self._blocking
        assert b is not None

        async def vectored() -> bool:
            return await loop.run_in_executor(b.writers, b.set_vectored, key, parts, nbytes)

        return bool(await self.guard("SET", vectored, None, nbytes))

    async def put_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        values = [(self.k(key), one_buffer(bufs)) for key, bufs in items]
        out: list[bool] = []
        for part in batches(
            values, lambda x: memoryview(x[1]).nbytes, _PIPE_BYTES, self.cfg.pipeline_batch
        ):

            async def run(part: list[tuple[str, Buffer]] = part) -> list[Any]:
                pipe = self.client.pipeline(transaction=False)
                for kk, v in part:
                    pipe.set(kk, v, ex=self.ttl_s)
                return await pipe.execute()

            got = await self.guard("SET", run, None, sum(memoryview(v).nbytes for _, v in part))
            out += [bool(g) for g in got] if got is not None else [False] * len(part)
        return out

    async def put_group(self, objects: Sequence[GroupObject]) -> bool:
        """The group in pipelines (MULTI-free), bounded in bytes: one when it fits. A
        single Redis runs a connection's commands in order, so the last object lands
        after the others; a cluster may spread the keys over several masters, so there
        the last one goes after the others' pipelines have answered. With
        ``wait_replicas``, each pipeline ends with a WAIT, and the group counts as
        written only once enough replicas hold all of it."""
        ok = False
        try:
            if self.cfg.wait_replicas:
                acked = self._acked.put
                ok = await acked(objects[:-1]) and await acked(objects[-1:])
            elif self.is_cluster or len(objects) == 1:
                oks = await self.put_many([(o.key, o.buffers()) for o in objects[:-1]])
                ok = all(oks) and await self._put_last(objects[-1])
            else:
                ok = all(await self.put_many([(o.key, o.buffers()) for o in objects]))
            return ok
        finally:
            if not ok:
                await self.delete_many([o.key for o in objects])

    async def delete_many(self, keys: Sequence[str]) -> None:
        if keys:
            await self.guard("DEL", lambda: self.client.delete(*[self.k(k) for k in keys]), 0)

    async def delete(self, key: str) -> None:
        await self.guard("DEL", lambda: self.client.delete(self.k(key)), 0)

    async def contains(self, key: str) -> bool:
        return bool(await self.guard("EXISTS", lambda: self.client.exists(self.k(key)), 0))

    async def sizes(self, keys: Sequence[str]) -> list[int | None]:
        """EXISTS and STRLEN of each key, in one pipeline (no value crosses the wire)."""

        async def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.k(key))
                pipe.strlen(self.k(key))
            return await pipe.execute()

        got = await self.guard("STRLEN", run, None) if keys else []
        if got is None:
            return [None] * len(keys)
        return [int(n) if e else None for e, n in zip(got[::2], got[1::2], strict=True)]

    async def scan(self) -> AsyncIterator[tuple[str, int]]:
        """SCAN over the key prefix (every master of a cluster), 1000 keys at a time with
        their STRLENs pipelined, each batch yielded before the next is asked for. An
        outage ends the scan where it is."""
        keys = self.client.scan_iter(match=_glob_escape(self.prefix) + "*", count=1000)
        done = False

        async def batch() -> list[tuple[str, int]]:
            nonlocal done
            part: list[Any] = []
            async for k in keys:
                part.append(k)
                if len(part) == 1000:
                    break
            else:
                done = True
            if not part:
                return []
            pipe = self.client.pipeline(transaction=False)
            for kk in part:
                pipe.strlen(kk)
            sizes = await pipe.execute()
            out = []
            for kk, n in zip(part, sizes, strict=True):
                name = kk.decode() if isinstance(kk, bytes) else kk
                if n:
                    out.append((name[len(self.prefix) :], int(n)))
            return out

        while not done:
            got = await self.guard("SCAN", batch, None)
            if got is None:
                return
            for item in got:
                yield item


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)
