"""One client connection of the cache server: the protocol state machine.

It reads its connection's messages in order. A TENSOR_PUT's data frames are received
straight into a ``Landing``; every other request runs as a task of its own and writes
its answer under the connection's send lock, so a connection carries many requests at
once (stream ids tell them apart). A session reaches the server only through
``SessionHost``: the store, the segment desk, the put budget, metrics and the drain flag.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import traceback
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from hurray_store import transport as tp
from hurray_store.config import ServerConfig
from hurray_store.errors import FormatError, ProtocolError
from hurray_store.server.access import served
from hurray_store.server.backing import ServedStore
from hurray_store.server.metrics import ServerMetrics
from hurray_store.server.requests import Requests
from hurray_store.server.segments import PER_OBJECT_BYTES, Landing, PutBudget, SegmentDesk
from hurray_store.tiers import transfer_timeout_s
from hurray_store.transport import Err, Msg

log = logging.getLogger(__name__)
_HELLO_LIMIT = 64 << 10
_MAX_PEERS = 4096  # peer addresses whose failed hellos are counted
_MAX_HELD_BACK = 256  # failed hellos answered late at once
# Messages a client may send; the rest flow server -> client only.
_CLIENT_SENDS = {
    Msg.TENSOR_REQUEST,
    Msg.TENSOR_DATA,
    Msg.TENSOR_DATA_END,
    Msg.TENSOR_PUT,
    Msg.ERROR,
    Msg.PING,
    Msg.PONG,
    Msg.X_LOOKUP,
    Msg.X_COMMIT,
    Msg.X_STATS,
    Msg.X_CONTAINS,
    Msg.X_DELETE,
    Msg.X_RANGES,
}


def let_go(e: BaseException) -> None:
    """Clear the finished frames of an exception caught for good, and of the ones it
    chains to: a frame left in a traceback would keep a request's buffers (a message
    half received, a landing's view) alive for as long as the exception object lives,
    and an exception caught by asyncio can live on in a reference cycle until a
    garbage collection that may not come soon."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        traceback.clear_frames(x.__traceback__)
        todo += [x.__context__, x.__cause__]


class SessionHost(Protocol):
    cfg: ServerConfig
    hello_failures: HelloFailures
    store: ServedStore
    desk: SegmentDesk
    budget: PutBudget
    metrics: ServerMetrics
    sessions: set[Session]
    unauthenticated: dict[Session, None]  # before their CLIENT_HELLO, oldest first
    served: set[Session]  # past their CLIENT_HELLO
    draining: bool


class HelloFailures:
    """Failed CLIENT_HELLOs per peer address: a token bucket each (``rate`` a second,
    bursts of 10x), past which a failure is answered after 1 s; at most
    ``_MAX_HELD_BACK`` answers are held back at once (past that, closed unanswered)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.burst = 10 * rate
        self.peers: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, when
        self.held_back = 0

    def failed(self, peer: str) -> float | None:
        """A failure from ``peer``: how long to wait before answering it (0: at once;
        None: do not answer)."""
        now = time.monotonic()
        tokens, then = self.peers.pop(peer, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate) - 1
        self.peers[peer] = (tokens, now)
        while len(self.peers) > _MAX_PEERS:
            self.peers.popitem(last=False)
        if tokens >= 0:
            return 0.0
        if self.held_back >= _MAX_HELD_BACK:
            return None
        self.held_back += 1
        return 1.0

    def waited(self) -> None:
        self.held_back -= 1


@dataclass(eq=False, slots=True)
class PutInFlight:
    key: str
    landing: Landing | None  # None: refused; its frames are read and dropped
    total: int
    pos: int = 0
    deadline: float = 0.0


class Session:
    """One client connection."""

    def __init__(self, server: SessionHost, sock: socket.socket, peer: str) -> None:
        self.server = server
        self.cfg = server.cfg
        self.sock = sock
        self.peer = peer
        self.since = time.monotonic()  # when it was accepted
        self.ch: tp.Channel | None = None
        self.task: asyncio.Task[None] | None = None
        self.puts: dict[int, PutInFlight] = {}
        self.handlers: set[asyncio.Task[None]] = set()
        self.ext = False
        self.frame = 1 << 20
        self.client_max = 1 << 20
        self.reading = False  # inside a message (its header has arrived)
        self.last_sid = 0  # stream of the last header read: where a connection-level ERROR goes
        self.heard = False  # its first header arrived
        self.peer_host = peer.rsplit(":", 1)[0]

        # The requests that run as tasks of their own, each by its handler (composed:
        # they see this connection as a ``context.RequestContext``).
        r = Requests(self)
        self.requests: dict[Msg, Callable[[int, memoryview], Awaitable[None]]] = {
            Msg.TENSOR_REQUEST: r.on_tensor_request,
            Msg.X_RANGES: r.on_x_ranges,
            Msg.X_CONTAINS: r.on_x_contains,
            Msg.X_DELETE: r.on_x_delete,
            Msg.X_LOOKUP: r.on_x_lookup,
            Msg.X_COMMIT: r.on_x_commit,
            Msg.X_STATS: r.on_x_stats,
        }

    @property
    def busy(self) -> bool:
        return bool(self.handlers or self.puts or self.reading)

    def close(self) -> None:
        if self.ch is not None:
            self.ch.close()
        else:
            self.sock.close()
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()  # its read would wait on the closed socket forever

    async def run(self) -> None:
        m = self.server.metrics
        m.connections.inc()
        try:
            # Small until the client says hello: connections that never do hold little.
            self.ch = tp.Channel(self.sock, buffer_size=4096)
            if await self._hello():
                self.server.unauthenticated.pop(self, None)
                self.server.served.add(self)
                self.ch.grow(256 << 10)
                await self._loop()
        except ProtocolError as e:
            let_go(e)
            await self._fatal(self.last_sid, e.code, str(e))
        except TimeoutError as e:  # before OSError, its base class
            let_go(e)
            await self._fatal(
                self.last_sid, Err.TIMEOUT, "a message took longer than request_timeout_s"
            )
        except (tp.ConnectionClosed, OSError, asyncio.CancelledError) as e:
            let_go(e)
        finally:
            for t in list(self.handlers):
                t.cancel()
            await asyncio.gather(*self.handlers, return_exceptions=True)
            for p in self.puts.values():
                if p.landing is not None:
                    p.landing.release()
            self.puts.clear()
            self.server.desk.end_claims_of(self)
            self.close()
            self.server.unauthenticated.pop(self, None)
            self.server.served.discard(self)
            self.server.sessions.discard(self)
            m.connections.dec()

    async def _fatal(self, stream: int, code: int, message: str) -> None:
        """ERROR, then the connection closes (best effort: the peer may be gone)."""
        log.info("client %s: %s; closing its connection", self.peer, message)
        self.server.metrics.errors.labels(f"0x{code:02x}").inc()
        if self.ch is None or self.ch.closed:
            return
        try:
            async with asyncio.timeout(1.0), self.ch.send_lock:
                await self.ch.send_error(stream, code, message)
        except (OSError, TimeoutError, tp.ConnectionClosed):
            pass
        self.close()

    async def error(self, stream: int, code: int, message: str) -> None:
        """ERROR on one stream; the connection stays."""
        assert self.ch is not None
        self.server.metrics.errors.labels(f"0x{code:02x}").inc()
        async with self.ch.send_lock, asyncio.timeout(self.cfg.request_timeout_s):
            await self.ch.send_error(stream, code, message)

    async def _hello(self) -> bool:
        ch = self.ch
        assert ch is not None
        async with asyncio.timeout(self.cfg.hello_timeout_s):
            kind, sid, n = await ch.read_header()
            self.heard = True
            self.last_sid = sid
            if kind != Msg.CLIENT_HELLO:
                raise ProtocolError(
                    Err.INVALID_MESSAGE,
                    f"message 0x{kind:x} before CLIENT_HELLO: a connection starts with "
                    "CLIENT_HELLO",
                )
            if n > _HELLO_LIMIT:
                raise ProtocolError(
                    Err.MESSAGE_TOO_LARGE, f"CLIENT_HELLO of {n} bytes; at most {_HELLO_LIMIT}"
                )
            hello = tp.Hello.decode(await ch.read(n))
        if hello.version < tp.PROTOCOL_VERSION:
            await self._fatal(
                sid,
                Err.PROTOCOL_VERSION_MISMATCH,
                f"protocol version {hello.version}; this server speaks {tp.PROTOCOL_VERSION}",
            )
            return False
        tenant = self.server.store.tenants.match((hello.ext or {}).get("token", ""))
        if tenant is None:
            delay = self.server.hello_failures.failed(self.peer_host)
            if delay is None:  # too many answers already held back: closed unanswered
                self.close()
                return False
            if delay:
                # Out of the queue of connections yet to say hello while it waits: its
                # hello came, and the wait must not push out anyone else's.
                self.server.unauthenticated.pop(self, None)
                try:
                    await asyncio.sleep(delay)
                finally:
                    self.server.hello_failures.waited()
            await self._fatal(sid, Err.AUTH_FAILED, "missing or wrong token")
            return False
        self.tenant = tenant
        if self.server.draining:
            await self._fatal(sid, Err.SHUTTING_DOWN, "the server is shutting down")
            return False
        if len(self.server.served) >= self.cfg.max_connections:
            await self._fatal(
                sid, Err.BUSY, f"the server serves at most {self.cfg.max_connections} connections"
            )
            return False
        self.ext = hello.ext is not None and tp.EXTENSION in hello.ext.get("extensions", "").split(
            ","
        )
        self.client_max = max(4096, hello.max_message_size)
        self.frame = min(self.client_max, tp.MAX_FRAME)
        ext = None
        if hello.ext is not None:
            ext = {
                "extensions": tp.EXTENSION,
                "server": "hurray_store",
                "namespace": tenant.namespace,
                "max_object_bytes": str(self.cfg.max_object_bytes),
            }
        reply = tp.Hello(max_message_size=self.cfg.max_message_bytes, ext=ext)
        async with ch.send_lock:
            await ch.send(Msg.SERVER_HELLO, sid, reply.encode())
        return True

    async def _loop(self) -> None:
        ch = self.ch
        assert ch is not None
        while True:
            self.reading = False
            if self.server.draining and not self.handlers and not self.puts:
                return
            while len(self.handlers) >= self.cfg.max_requests_per_connection:
                # Its next message waits for one of its requests to be answered.
                await asyncio.wait(set(self.handlers), return_when=asyncio.FIRST_COMPLETED)
            # Between a put's frames the client may not idle past the put's deadline
            # (its bytes are held); between requests it may idle as long as it likes.
            idle = (
                max(0.0, min(p.deadline for p in self.puts.values()) - time.monotonic())
                if self.puts
                else None
            )
            async with asyncio.timeout(idle):
                kind, sid, n = await ch.read_header()
            self.reading = True
            self.last_sid = sid
            if n > self.cfg.max_message_bytes:
                raise ProtocolError(
                    Err.MESSAGE_TOO_LARGE,
                    f"a {n}-byte payload; this server takes at most {self.cfg.max_message_bytes}",
                )
            if kind not in tp.KNOWN:
                raise ProtocolError(Err.INVALID_MESSAGE, f"unknown message type 0x{kind:x}")
            if kind not in _CLIENT_SENDS or (kind in tp.EXTENSIONS and not self.ext):
                raise ProtocolError(
                    Err.INVALID_MESSAGE, f"message {Msg(kind).name} is not one a client sends here"
                )
            async with asyncio.timeout(self.cfg.request_timeout_s):
                if kind == Msg.TENSOR_DATA:
                    await self._data(sid, n)
                    continue
                payload = memoryview(await ch.read(n))
            if kind == Msg.TENSOR_PUT:
                await self._put_begin(sid, payload)
            elif kind == Msg.TENSOR_DATA_END:
                self._put_end(sid, n)
            elif kind == Msg.PING:
                # A client that does not read its PONG loses its connection (TIMEOUT).
                async with ch.send_lock, asyncio.timeout(self.cfg.request_timeout_s):
                    await ch.send(Msg.PONG, sid, payload)
            elif kind in (Msg.PONG, Msg.ERROR):
                pass  # a client's ERROR ends its own stream; nothing is in flight for it here
            else:
                self._spawn(Msg(kind), sid, payload)

    # ------------------------------------------------------------------ puts

    async def _put_begin(self, sid: int, payload: memoryview) -> None:
        if sid in self.puts:
            raise ProtocolError(Err.INVALID_MESSAGE, f"a second TENSOR_PUT on stream {sid}")
        key, n = tp.decode_put(
            payload
        )  # a bad descriptor is fatal: its frames cannot be told from what follows
        self.server.metrics.requests.labels("TENSOR_PUT").inc()
        put = PutInFlight(
            key,
            None,
            n,
            deadline=time.monotonic() + transfer_timeout_s(self.cfg.request_timeout_s, n),
        )
        self.puts[sid] = put
        if n > self.cfg.max_object_bytes:
            await self.error(
                sid,
                Err.MESSAGE_TOO_LARGE,
                f"an object of {n} bytes; this server takes at most {self.cfg.max_object_bytes}",
            )
            return
        # An object costs its key and what the server keeps per object now (many empty
        # puts are not free), and its bytes as they arrive (a put that announces much and
        # sends little holds little).
        cost = len(key.encode()) + PER_OBJECT_BYTES
        got = await self.server.budget.take(cost, self.cfg.request_timeout_s / 2)
        # The frames' deadline runs from now: the wait for room is not the client's delay.
        put.deadline = time.monotonic() + transfer_timeout_s(self.cfg.request_timeout_s, n)
        if not got:
            await self.error(
                sid,
                Err.BUSY,
                f"no room for {cost} more bytes of puts in flight within "
                f"{self.cfg.request_timeout_s} s",
            )
            return
        if not await self._stage_room(sid, cost):
            self.server.budget.give(cost)
            return
        put.landing = Landing(self.server.store, self.server.budget, n, cost, self.tenant)

    async def _data(self, sid: int, n: int) -> None:
        ch = self.ch
        assert ch is not None
        put = self.puts.get(sid)
        if put is None:
            raise ProtocolError(
                Err.INVALID_MESSAGE, f"TENSOR_DATA on stream {sid}, which has no TENSOR_PUT"
            )
        if n < tp.DATA_OFFSET.size:
            raise ProtocolError(Err.INVALID_MESSAGE, "TENSOR_DATA shorter than its offset field")
        (off,) = tp.DATA_OFFSET.unpack(await ch.read(tp.DATA_OFFSET.size))
        k = n - tp.DATA_OFFSET.size
        if off != put.pos or put.pos + k > put.total:
            raise ProtocolError(
                Err.INVALID_MESSAGE,
                f"TENSOR_DATA at offset {off} (+{k}) where {put.pos} of {put.total} was expected",
            )
        if time.monotonic() > put.deadline:
            raise TimeoutError
        landing = put.landing
        if landing is not None and not await self._stage_room(sid, k):
            put.landing = None  # over the tenant's quota: refused, its frames dropped
            landing.release()
            landing = None
        if landing is not None and not await self.server.budget.take(
            k, self.cfg.request_timeout_s / 2
        ):
            # No room for these bytes: the put is refused; its other frames are dropped.
            put.landing = None
            landing.release()
            landing = None
            await self.error(
                sid, Err.BUSY, f"no room for {k} more bytes of puts in flight; the put is dropped"
            )
        if landing is None:
            await ch.skip(k)
        else:
            # Given back with the rest once the store no longer needs it; counted in the
            # tenant's staging until then.
            landing.grow(k)
            await ch.read_into(landing.view[off : off + k])
            self.server.metrics.bytes_in.inc(k)
        put.pos += k

    async def _stage_room(self, sid: int, n: int) -> bool:
        """Room under the tenant's quota for ``n`` more bytes of its puts in flight
        (made by deleting its own least recently used groups); else ERROR NOT_STORED on
        the put's stream, and False."""
        why = await self.server.store.tenants.stage_room(self.tenant, n)
        if why:
            await self.error(sid, Err.NOT_STORED, why)
        return not why

    def _put_end(self, sid: int, n: int) -> None:
        put = self.puts.pop(sid, None)
        if put is None or n:
            raise ProtocolError(
                Err.INVALID_MESSAGE,
                f"TENSOR_DATA_END on stream {sid} without a TENSOR_PUT, or with a payload",
            )
        if put.pos != put.total:
            if put.landing is not None:
                put.landing.release()
            raise ProtocolError(
                Err.INVALID_MESSAGE, f"TENSOR_DATA_END after {put.pos} of {put.total} bytes"
            )
        if put.landing is not None:
            self._track(self._put_store(sid, put.key, put.landing), "TENSOR_PUT", sid)

    async def _put_store(self, sid: int, key: str, landing: Landing) -> None:
        store = self.server.store
        k = served(self.tenant, "write", key, store.namespaces)
        seg = k.segment
        if seg is not None and seg.is_manifest:
            landing.release()
            await self.error(
                sid, Err.REJECTED, "a segment's manifest commits it: send it with X_COMMIT"
            )
            return
        if seg is not None:
            self.server.desk.stage(seg.segment, k.stored, landing)
            ok = True
        else:
            try:
                ok = await store.put_key(
                    k, [landing.view], self.tenant, landing.release, landing.res
                )
            except FormatError as e:
                await self.error(sid, Err.NOT_STORED, str(e))
                return
        assert self.ch is not None
        if ok:
            async with self.ch.send_lock:
                await self.ch.send(Msg.TENSOR_PUT_ACK, sid)
        else:
            await self.error(sid, Err.NOT_STORED, "no tier of the server took the object")

    # ------------------------------------------------------------------ requests

    def _spawn(self, kind: Msg, sid: int, payload: memoryview) -> None:
        self.server.metrics.requests.labels(kind.name).inc()
        handler = self.requests[kind]
        self._track(handler(sid, payload), kind.name, sid)

    def _track(self, coro: Any, name: str, sid: int) -> None:
        async def timed() -> None:
            t0 = time.perf_counter()
            try:
                await coro
            except ProtocolError as e:
                let_go(e)
                if e.fatal:
                    await self._fatal(sid, e.code, str(e))
                else:
                    await self.error(sid, e.code, str(e))
            except TimeoutError as e:  # an answer stuck half-sent: the stream is unusable
                let_go(e)
                log.info(
                    "client %s: an answer took longer than request_timeout_s to send; closing",
                    self.peer,
                )
                self.close()
            except (tp.ConnectionClosed, OSError) as e:
                let_go(e)
                self.close()
            except asyncio.CancelledError as e:
                let_go(e)
                raise
            except Exception as e:  # a bug of ours: this request fails, the server goes on
                log.exception("client %s: %s failed", self.peer, name)
                let_go(e)
                with contextlib.suppress(Exception):
                    await self.error(
                        sid, Err.INTERNAL, f"{name} failed on the server: {e.__class__.__name__}"
                    )
            finally:
                self.server.metrics.latency.labels(name).observe(time.perf_counter() - t0)

        task = asyncio.ensure_future(timed())
        self.handlers.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self.handlers.discard(t)
            coro.close()  # cancelled before it started: closed, not left "never awaited"

        task.add_done_callback(done)
