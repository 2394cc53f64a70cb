"""The Redis tier's reads from an engine's own thread (``BlockingRedis.read_into_now``), with
no trip to the event loop: per object one transaction (MULTI, STRLEN, GETRANGE of each
piece, EXEC) written in RESP on a blocking connection of redis-py's pool and its bulk
replies received straight into the caller's buffers, each piece hashed as it comes in.
Part of the Redis tier (``tiers/redis.py``), in a module of its own."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from redis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    RedisClusterException,
    RedisError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from hurray_store.format import checksum, running_checksum
from hurray_store.tiers.base import NowRead, wants_sums
from hurray_store.tiers.helpers import check_into
from hurray_store.tiers.types import RangeIn

if TYPE_CHECKING:
    from hurray_store.tiers.redis_blocking import BlockingRedis

log = logging.getLogger("hurray_store.tiers.redis")
# What says the server is not serving (the rest is a refused command).
OUTAGE = (
    RedisConnectionError,
    RedisTimeoutError,
    BusyLoadingError,
    ClusterDownError,
    RedisClusterException,
    OSError,
    TimeoutError,
)


# A read off the loop asks for its ranges in pieces of at most this size: a single Redis
# serves large values faster as several GETRANGEs of a few MiB than as one GET.
_NOW_PIECE = 2 << 20
# A received piece is hashed at once, up to this many bytes a receive: bytes hashed
# while they are still in the CPU's cache cost a fraction of hashing a whole value
# after it is in (tools/bench_lmcache.py's Redis rows measure the difference).
_HASH_STEP = 256 << 10


def now_pieces(r: NowRead) -> list[tuple[int, int, memoryview]] | None:
    """``(range index, offset, buffer)`` of each piece ``r`` is read in; None: a range
    passes the object's end. ValueError: a buffer of another size than its range."""
    check_into(r.key, r.ranges, r.buffers)
    if any(off < 0 or off + ln > r.size for off, ln in r.ranges):
        return None
    return [
        (i, off + at, buf[at : at + _NOW_PIECE])
        for i, ((off, ln), buf) in enumerate(zip(r.ranges, r.buffers, strict=True))
        for at in range(0, ln, _NOW_PIECE)
    ]


def _resp(*args: bytes) -> bytes:
    """One command in RESP."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def getrange(k: bytes, off: int, ln: int) -> bytes:
    return _resp(b"GETRANGE", k, b"%d" % off, b"%d" % (off + ln - 1))


class NowGets:
    """The reads of one ``read_into_now``, taken one at a time by whichever thread is free
    (the caller and the helpers), each thread on a connection of its own. One read is one
    transaction: MULTI, STRLEN of the key, GETRANGE of each piece, EXEC. Redis runs it
    whole, so every piece comes from one version of the object, and the size says which."""

    def __init__(
        self,
        redis: BlockingRedis,
        reads: Sequence[NowRead],
        todo: list[tuple[int, list[tuple[int, int, memoryview]]]],
        ok: list[bool],
        each: RangeIn | None,
    ) -> None:
        self.redis, self.reads, self.todo, self.ok, self.each = redis, reads, todo, ok, each
        self.sums = wants_sums(each)
        self._next = itertools.count()  # next() on it is atomic under the GIL
        self.stop = False

    def run(self) -> None:
        pool = self.redis.client.connection_pool
        if self.stop or not self.redis.outage.available:
            return
        try:
            conn = pool.get_connection()
        except OUTAGE as e:  # none free, or no server: the loop reads what is left
            log.debug(
                "redis tier %s: no connection for a read off the loop: %s", self.redis.name, e
            )
            return
        try:
            while not self.stop and (k := next(self._next)) < len(self.todo):
                j, pieces = self.todo[k]
                try:
                    self.ok[j] = self._get(conn, j, pieces)
                except OUTAGE:
                    raise
                except RedisError as e:  # refused, or out of step: the loop decides
                    log.debug("redis tier %s: a read off the loop: %s", self.redis.name, e)
                    conn.disconnect()  # replies may be left unread; the next send reconnects
        except OUTAGE as e:
            # As the loop's guarded calls do: the outage starts here, and every pooled
            # connection goes (after a restart they would all fail once more).
            conn.disconnect()
            self.stop = True
            self.redis.outage.down("GETRANGE", e)
            pool.disconnect()
        except BaseException:
            conn.disconnect()  # mid-reply: never reuse this connection
            self.stop = True
            raise
        finally:
            pool.release(conn)

    def _get(self, conn: Any, j: int, pieces: list[tuple[int, int, memoryview]]) -> bool:
        r = self.reads[j]
        k = self.redis.k(r.key).encode()
        cmds = [_resp(b"MULTI"), _resp(b"STRLEN", k)]
        cmds += [getrange(k, off, len(b)) for _, off, b in pieces]
        # One send: the server wakes once for the whole transaction.
        conn.send_packed_command([b"".join([*cmds, _resp(b"EXEC")])], check_health=False)
        replies = BulkReplies(conn._sock)
        for want in (b"+OK", *[b"+QUEUED"] * (len(cmds) - 1)):
            if (got := replies.line()) != want:
                raise RedisError(f"{got[:60]!r} where {want!r} was due")
        head = replies.line()
        if head != b"*%d" % (len(cmds) - 1):
            if head[:1] in (b"-", b"_") or head == b"*-1":
                return False  # aborted: no elements follow
            raise RedisError(f"{head[:60]!r} where EXEC's replies were due")
        # The object's size (an error, not an integer, for a key of another type).
        whole = replies.line() == b":%d" % r.size
        ends = {i: n for n, (i, _, _) in enumerate(pieces)}  # range -> its last piece
        h = None
        for n, (i, _, buf) in enumerate(pieces):
            size = replies.head(errors=True)
            if whole and size == len(buf):
                if self.sums and (n == 0 or pieces[n - 1][0] != i):
                    h = running_checksum()  # the range's first piece
                replies.take(buf, h)
                replies.skip(2)
                if ends[i] == n and self.each is not None:
                    self.each(j, i, h.intdigest() if h is not None else 0)
            else:
                whole = False
                if size >= 0:
                    replies.skip(size + 2)
        if replies.left:
            raise RedisError("bytes past the replies on the connection")
        if whole and self.each is not None:  # empty ranges have no piece
            for i, (_, ln) in enumerate(r.ranges):
                if ln == 0:
                    self.each(j, i, checksum(b"") if self.sums else 0)
        return whole


class BulkReplies:
    """RESP bulk-string replies read off a socket, each straight into a caller's buffer
    (``recv_into``): only the headers and the last few bytes of a short read pass
    through a small buffer of its own."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.buf = bytearray()
        self._scratch: memoryview | None = None

    @property
    def left(self) -> int:
        return len(self.buf)

    def _fill(self) -> None:
        got = self.sock.recv(1 << 16)
        if not got:
            raise RedisConnectionError("the server closed the connection mid-reply")
        self.buf += got

    def line(self) -> bytes:
        while (end := self.buf.find(b"\r\n")) < 0:
            self._fill()
        line = bytes(self.buf[:end])
        del self.buf[: end + 2]
        return line

    def head(self, errors: bool = False) -> int:
        """The next reply's length; -1: a nil reply (no body follows; RESP2's ``$-1`` or
        RESP3's ``_``); -2: an error reply, with ``errors`` (else RedisError)."""
        head = self.line()
        if head == b"_":
            return -1  # RESP3's null
        if head[:1] == b"-":
            if errors:
                return -2
            raise RedisError(head[1:].decode(errors="replace"))
        if head[:1] != b"$" or not head[1:].lstrip(b"-").isdigit():
            raise RedisConnectionError(f"not a bulk string reply: {head[:40]!r}")
        return int(head[1:])

    def take(self, into: memoryview, h: Any = None) -> None:
        """The next ``len(into)`` bytes of the reply into ``into``; ``h`` (a
        ``running_checksum``) takes each piece as it arrives, at most ``_HASH_STEP``
        bytes a receive, while the piece is still in the CPU's cache."""
        n = len(into)
        have = min(len(self.buf), n)
        into[:have] = self.buf[:have]
        del self.buf[:have]
        if h is not None and have:
            h.update(into[:have])
        step = n if h is None else _HASH_STEP
        while have < n:
            got = self.sock.recv_into(into[have : have + step])
            if not got:
                raise RedisConnectionError("the server closed the connection mid-reply")
            if h is not None:
                h.update(into[have : have + got])
            have += got

    def skip(self, n: int) -> None:
        """Read and drop the next ``n`` bytes of the reply."""
        if self._scratch is None:
            self._scratch = memoryview(bytearray(1 << 16))
        while n > 0:
            step = min(n, len(self._scratch))
            self.take(self._scratch[:step])
            n -= step

    def read_into(self, dst: memoryview) -> bool:
        """The next reply into ``dst``; False: it is not ``len(dst)`` bytes long (then
        it is read and dropped)."""
        n = self.head()
        if n < 0:
            return False  # a nil reply: no body
        if n != len(dst):
            self.skip(n + 2)
            return False
        self.take(dst)
        self.skip(2)  # the reply's closing CRLF
        return True
