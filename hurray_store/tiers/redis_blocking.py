"""A single Redis through redis-py's blocking client, from worker threads and engines'
threads: large SETs sent without joining their parts (``set_vectored``), ranged reads
received straight into the caller's buffers (``getrange_into``) and reads from the
calling thread with no trip to the event loop (``read_into_now``, ``redis_now.py``).
Part of the Redis tier (``tiers/redis.py``), which uses it on a single Redis only."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry

from hurray_store.tiers.base import NowRead
from hurray_store.tiers.helpers import check_into, shared_run
from hurray_store.tiers.outage import Outage
from hurray_store.tiers.redis_now import BulkReplies, NowGets, getrange, now_pieces
from hurray_store.tiers.types import Blob, Buffer, Range, RangeIn

# SETs, and ranged reads into buffers, of this size or more go out from worker threads;
# a read on the calling thread this large shares its objects with helper threads.
SPLIT_BYTES = 1 << 20
THREADS = 4


class BlockingRedis:
    """The blocking client of the Redis tier ``name`` (its keys under ``prefix``, SETs
    with ``ttl_s``), with a pool of read threads and one of ``write_threads`` writers
    (its own, so a smaller one leaves cores to the engine's thread and never holds reads
    up). Its sockets time out per send and receive (``timeout_s``)."""

    def __init__(
        self,
        name: str,
        url: str,
        common: dict[str, Any],
        *,
        timeout_s: float,
        max_connections: int,
        write_threads: int,
        prefix: str,
        ttl_s: int | None,
        outage: Outage,
    ) -> None:
        self.name, self.prefix, self.ttl_s, self.outage = name, prefix, ttl_s, outage
        self.client = redis.Redis.from_url(
            url, **{**common, "socket_timeout": timeout_s, "retry": Retry(NoBackoff(), 0)}
        )
        self.reads = ThreadPoolExecutor(
            min(THREADS, max_connections), thread_name_prefix="redis-io"
        )
        self.writers = ThreadPoolExecutor(write_threads, thread_name_prefix=f"redis-io-{name}-w")

    def k(self, key: str) -> str:
        return self.prefix + key

    def disconnect(self) -> None:
        self.client.connection_pool.disconnect()

    def close(self) -> None:
        for pool in (self.reads, self.writers):
            pool.shutdown(wait=True)
        self.client.close()

    def getrange_into(
        self, key: str, ranges: Sequence[Range], into: Sequence[memoryview]
    ) -> list[Blob] | None:
        """GETRANGE of each range, pipelined on one connection, each reply's bytes read
        straight from the socket into its buffer (None: the key is absent or shorter
        than a range).

        redis-py hands every reply over as a new ``bytes``, after the asyncio transport,
        its stream buffer and hiredis have each held a copy, and the caller then copies
        it once more. Here redis-py's blocking connection (its pool, AUTH and TLS) sends
        the commands, and each reply's ``$<length>`` header is parsed here and its bytes
        land in place with ``recv_into``, from a worker thread."""
        check_into(key, ranges, into)
        k = self.k(key).encode()
        cmds = b"".join(getrange(k, off, ln) for off, ln in ranges)
        pool = self.client.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command([cmds], check_health=False)
            replies = BulkReplies(conn._sock)
            whole = [replies.read_into(b) for b in into]
            if replies.left:
                raise RedisConnectionError("bytes past the replies on the connection")
        except BaseException:
            conn.disconnect()  # mid-reply: never reuse this connection
            raise
        finally:
            pool.release(conn)
        return list(into) if all(whole) else None

    def read_into_now(self, reads: Sequence[NowRead], each: RangeIn | None = None) -> list[bool]:
        """Each read's ranges, on the calling thread and up to 3 of the tier's worker
        threads (one connection each), received straight into their buffers: per read
        one transaction (``NowGets``), so its ranges all come from one version of the
        object (the store's loop reads with pipelined GETRANGEs). A single Redis only;
        an outage, an object of another size or a missing one is a False, which the
        loop's read then decides."""
        ok = [False] * len(reads)
        if not self.outage.available:
            return ok
        todo = [(j, p) for j, r in enumerate(reads) if (p := now_pieces(r)) is not None]
        if not todo:
            return ok
        gets = NowGets(self, reads, todo, ok, each)
        nbytes = sum(len(b) for _, p in todo for _, _, b in p)
        helpers = min(THREADS - 1, len(todo) - 1) if nbytes >= SPLIT_BYTES else 0
        shared_run(gets.run, self.reads, helpers)
        return ok

    def set_vectored(self, key: str, parts: Iterable[Buffer], n: int) -> bool:
        """SET ``key`` to the concatenation of ``parts`` (``n`` bytes) without joining
        them.

        redis-py takes one value per argument, and its asyncio connection joins a whole
        command before it writes it (Python 3.11's transports), so a large value would be
        copied twice on the event loop's thread. Here the command is RESP's array of
        bulk strings, with the value's length in its header; redis-py's blocking
        connection (its pool, AUTH, TLS and reply parsing) sends the header, each buffer
        as it is and the tail, one ``sendall`` each, from a worker thread. (docs/benchmarks.md,
        the Redis rows). ``parts`` may be made as
        they are taken (a self-checked object's); if that fails mid-value, the connection is
        dropped and Redis discards the half-sent command."""
        k = self.k(key).encode()
        extra = [b"EX", str(self.ttl_s).encode()] if self.ttl_s else []
        head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (3 + len(extra), len(k), k, n)
        tail = b"\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in extra)
        pool = self.client.connection_pool
        conn = pool.get_connection()
        try:
            # redis-py sends each item of the command with its own sendall, in order.
            conn.send_packed_command(itertools.chain([head], parts, [tail]), check_health=False)
            reply = conn.read_response()
        except BaseException:
            conn.disconnect()  # mid-command: never reuse this connection
            raise
        finally:
            pool.release(conn)
        return reply in (b"OK", "OK", True)
