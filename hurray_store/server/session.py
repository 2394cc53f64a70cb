"""One client connection of the cache server: the protocol state machine.

It reads its connection's messages in order. A TENSOR_PUT's data frames are received
straight into a ``PutBuffer``; every other request runs as a task of its own and writes
its answer under the connection's send lock, so a connection carries many requests at
once (stream ids tell them apart). A session reaches the server only through
``SessionHost``: the store, the segment staging, the put budget, metrics and the drain flag.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from hurray_store import transport as tp
from hurray_store.config import ServerConfig
from hurray_store.errors import ProtocolError
from hurray_store.server.backing import ServedStore
from hurray_store.server.guards import HelloFailures, let_go
from hurray_store.server.metrics import ServerMetrics
from hurray_store.server.puts import Puts
from hurray_store.server.requests import Requests
from hurray_store.server.segments import PutBudget, SegmentStaging
from hurray_store.transport import Err, Msg

log = logging.getLogger(__name__)
_HELLO_LIMIT = 64 << 10
# Messages a client may send; the rest flow server -> client only.
# Messages answered in the read loop; every other request runs as a task of its own.
_IN_LOOP = {Msg.TENSOR_PUT, Msg.TENSOR_DATA_END, Msg.PING, Msg.PONG, Msg.ERROR}
# Messages this size or more hold room in the message budgets while they are handled
# (smaller ones are bounded by max_requests_per_connection times this, per connection).
SMALL_MESSAGE = 64 << 10
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


class SessionHost(Protocol):
    cfg: ServerConfig
    hello_failures: HelloFailures
    store: ServedStore
    staging: SegmentStaging
    budget: PutBudget
    messages: PutBudget  # the other messages' bytes, all connections
    tenant_messages: dict[str, PutBudget]  # the same, per tenant
    metrics: ServerMetrics
    sessions: set[Session]
    unauthenticated: dict[Session, None]  # before their CLIENT_HELLO, oldest first
    served: set[Session]  # past their CLIENT_HELLO
    draining: bool


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
        self.puts = Puts(self)
        self.handlers: set[asyncio.Task[None]] = set()
        self.ext = False
        self.frame = 1 << 20
        self.client_max = 1 << 20
        self.reading = False  # inside a message (its header has arrived)
        self.last_sid = 0  # stream of the last header read: where a connection-level ERROR goes
        self.got_header = False  # its first header arrived
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
        return bool(self.handlers or self.puts.inflight or self.reading)

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
            self.puts.release_all()
            self.server.staging.end_claims_of(self)
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
            self.got_header = True
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
            if self.server.draining and not self.handlers and not self.puts.inflight:
                return
            while len(self.handlers) >= self.cfg.max_requests_per_connection:
                # Its next message waits for one of its requests to be answered.
                await asyncio.wait(set(self.handlers), return_when=asyncio.FIRST_COMPLETED)
            # Between a put's frames the client may not idle past the put's deadline
            # (its bytes are held); between requests it may idle as long as it likes.
            idle = (
                max(0.0, min(p.deadline for p in self.puts.inflight.values()) - time.monotonic())
                if self.puts.inflight
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
            release = None
            if kind != Msg.TENSOR_DATA and n >= SMALL_MESSAGE:
                # Its bytes held until it is answered: room in the server's and the
                # tenant's message budgets first (else busy, and the payload skipped).
                release = await self._room(n)
                if release is None:
                    async with asyncio.timeout(self.cfg.request_timeout_s):
                        await ch.skip(n)
                    await self.error(sid, Err.BUSY, f"no room for a {n}-byte message now")
                    continue
            try:
                async with asyncio.timeout(self.cfg.request_timeout_s):
                    if kind == Msg.TENSOR_DATA:
                        await self.puts.data(sid, n)
                        continue
                    payload = memoryview(await ch.read(n))
            except BaseException:
                if release is not None:
                    release()
                raise
            if kind not in _IN_LOOP:
                self._spawn(Msg(kind), sid, payload, release)  # gives the room back when done
                continue
            try:
                await self._answer_now(Msg(kind), sid, n, payload)
            finally:
                if release is not None:
                    release()

    async def _answer_now(self, kind: Msg, sid: int, n: int, payload: memoryview) -> None:
        """The messages answered in the read loop itself (not spawned)."""
        ch = self.ch
        assert ch is not None
        if kind == Msg.TENSOR_PUT:
            await self.puts.begin(sid, payload)
        elif kind == Msg.TENSOR_DATA_END:
            self.puts.end(sid, n)
        elif kind == Msg.PING:
            # A client that does not read its PONG loses its connection (TIMEOUT).
            async with ch.send_lock, asyncio.timeout(self.cfg.request_timeout_s):
                await ch.send(Msg.PONG, sid, payload)
        # PONG, ERROR: a client's ERROR ends its own stream; nothing is in flight for it

    async def _room(self, n: int) -> Callable[[], None] | None:
        """``n`` bytes of a message taken from the server's and this tenant's message
        budgets, waiting up to ``request_timeout_s``; what gives them back, or None."""
        srv, wait = self.server, self.cfg.request_timeout_s
        mine = srv.tenant_messages.get(self.tenant.name) if self.tenant is not None else None
        if mine is not None and not await mine.take(n, wait):
            return None
        if not await srv.messages.take(n, wait):
            if mine is not None:
                mine.give(n)
            return None

        def give() -> None:
            srv.messages.give(n)
            if mine is not None:
                mine.give(n)

        return give

    # ------------------------------------------------------------------ requests

    def _spawn(
        self, kind: Msg, sid: int, payload: memoryview, release: Callable[[], None] | None = None
    ) -> None:
        self.server.metrics.requests.labels(kind.name).inc()
        handler = self.requests[kind]
        self.track(handler(sid, payload), kind.name, sid, release)

    def track(
        self, coro: Any, name: str, sid: int, release: Callable[[], None] | None = None
    ) -> None:
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
            if release is not None:  # the request's payload is no longer held
                release()

        task.add_done_callback(done)
