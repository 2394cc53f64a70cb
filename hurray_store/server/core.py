"""The cache server: one TieredStore shared by many engine processes over the Hurray
network transport (layer L5). ``docs/server.md`` describes the protocol as served.

One task accepts connections; one task per connection reads its messages in order.
A TENSOR_PUT's data frames are received straight into a resident buffer (its bytes
counted against ``max_inflight_put_bytes`` until the store no longer needs them); every
other request runs as a task of its own and writes its answer under the connection's
send lock, so a connection carries many requests at once (stream ids tell them apart).

What a put becomes:

* a segment's layer object (``<ns>/s/{seg}/<layer>`` in the server's namespace) is
  *staged*: held until the segment's manifest arrives in X_COMMIT, which verifies
  every object against the manifest and stores them together, manifest last (the
  commit point, as in-process). Staged objects that see no commit within
  ``staging_timeout_s`` are dropped.
* any other key is stored at once, as an object-level key of the server's store.

Claims make a page stored once across clients: X_LOOKUP with the claim flag reserves the
pages nobody holds for the asking connection; another client's claiming lookup of the
same pages waits (up to ``claim_timeout_s``) for the commit that brings them, then sees
them as held. A claim ends with that commit, its connection, or its timeout.

Bad input: a message that cannot be trusted (garbage, a header over the size limit, a
truncated message, an unknown or unexpected type, anything before CLIENT_HELLO, a wrong
token) gets ERROR and that connection is closed; the others are not touched. A request
that is well formed but cannot be served (unknown key, a non-CPU device) gets ERROR on
its stream and the connection stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from hurray_store import transport as tp
from hurray_store.config import ServerConfig
from hurray_store.errors import FormatError, ProtocolError
from hurray_store.format import Manifest
from hurray_store.keys import HASH_LEN, SegmentKey
from hurray_store.server.backing import ServedKey, ServedStore
from hurray_store.server.http import HealthEndpoint
from hurray_store.store import TieredStore
from hurray_store.tiers import host_view, transfer_timeout_s
from hurray_store.transport import Err, Msg

log = logging.getLogger(__name__)
_HELLO_LIMIT = 64 << 10
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


class _Budget:
    """Bytes of puts in flight (received or staged), at most ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._cv = asyncio.Condition()

    async def take(self, n: int, timeout: float) -> bool:
        async with self._cv:
            try:
                async with asyncio.timeout(timeout):
                    await self._cv.wait_for(lambda: self.used + n <= self.limit)
            except TimeoutError:
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        self.used -= n

        async def wake() -> None:
            async with self._cv:
                self._cv.notify_all()

        asyncio.ensure_future(wake())


class _Landing:
    """Where a put's bytes are received, and the budget they hold: space reserved in
    the store's top tier (the object is then published there without a copy), else a
    resident buffer borrowed from the store's pool."""

    __slots__ = ("server", "nbytes", "res", "buf", "view", "released")

    def __init__(self, server: CacheServer, nbytes: int) -> None:
        self.server = server
        self.nbytes = nbytes
        self.res = server.store.reserve(nbytes)
        self.buf = None if self.res is not None else server.store.buffers.acquire(nbytes)
        self.view = self.res.view if self.res is not None else memoryview(self.buf)[:nbytes]  # type: ignore[arg-type]
        self.released = False

    def release(self) -> None:
        """Once no tier write needs the bytes (space a tier published stays there)."""
        if not self.released:
            self.released = True
            if self.res is not None:
                self.res.tier.unreserve(self.res)
            else:
                assert self.buf is not None
                self.server.store.buffers.release(self.buf)
            self.server.budget.give(self.nbytes)


@dataclass(eq=False, slots=True)
class _Put:
    key: str
    landing: _Landing | None  # None: refused; its frames are read and dropped
    total: int
    pos: int = 0
    deadline: float = 0.0


@dataclass(eq=False, slots=True)
class _Staged:
    objects: dict[str, _Landing] = field(default_factory=dict)
    since: float = field(default_factory=time.monotonic)


@dataclass(eq=False, slots=True)
class _ClaimSet:
    owner: Session
    fut: asyncio.Future[None]
    deadline: float
    left: int


class ServerMetrics:
    def __init__(self, registry: Any) -> None:
        self.connections = Gauge(
            "hurray_store_server_connections", "client connections open now", registry=registry
        )
        self.requests = Counter(
            "hurray_store_server_requests",
            "client requests by message type",
            ["message"],
            registry=registry,
        )
        self.errors = Counter(
            "hurray_store_server_errors",
            "ERROR messages sent, by error code",
            ["code"],
            registry=registry,
        )
        self.bytes_in = Counter(
            "hurray_store_server_received_bytes",
            "object bytes received in TENSOR_PUT data frames",
            registry=registry,
        )
        self.bytes_out = Counter(
            "hurray_store_server_sent_bytes",
            "object bytes sent in TENSOR_DATA frames",
            registry=registry,
        )
        self.latency = Histogram(
            "hurray_store_server_request_seconds",
            "time from a request's last byte in to its answer's last byte out",
            ["message"],
            registry=registry,
            buckets=(1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
        )
        self.inflight = Gauge(
            "hurray_store_server_inflight_put_bytes",
            "bytes of puts being received or staged",
            registry=registry,
        )
        self.staged = Gauge(
            "hurray_store_server_staged_segments",
            "segments whose layer objects await their commit",
            registry=registry,
        )


class CacheServer:
    def __init__(self, store: TieredStore, cfg: ServerConfig) -> None:
        self.store = ServedStore(store)
        self.cfg = cfg
        self.budget = _Budget(cfg.max_inflight_put_bytes)
        self.staged: dict[SegmentKey, _Staged] = {}  # a segment's staged layer objects
        self.claims: dict[bytes, _ClaimSet] = {}
        self.sessions: set[Session] = set()
        self.metrics = ServerMetrics(self.store.registry)
        self.metrics.inflight.set_function(lambda: self.budget.used)
        self.metrics.staged.set_function(lambda: len(self.staged))
        self.draining = False
        self.beat = time.monotonic()
        self.port = 0
        self._listener: socket.socket | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._stopped = asyncio.Event()
        self.http: HealthEndpoint | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(
        self, host: str | None = None, port: int | None = None, metrics_port: int | None = -1
    ) -> int:
        """Listen and serve in the background; returns the bound port. ``metrics_port``
        -1 takes the config's; None serves no HTTP endpoint; 0 picks a free port."""
        host = self.cfg.host if host is None else host
        port = self.cfg.port if port is None else port
        mport = self.cfg.metrics_port if metrics_port == -1 else metrics_port
        if mport is not None:
            self.http = HealthEndpoint(
                self.store.registry, lambda: self.beat, lambda: self.draining
            )
            self.http.start(self.cfg.metrics_host, mport)
            log.info(
                "metrics and health on http://%s:%d/metrics (/healthz, /readyz)",
                self.cfg.metrics_host,
                self.http.port,
            )
        sock = socket.create_server((host, port), backlog=512, reuse_port=False)
        sock.setblocking(False)
        self._listener = sock
        self.port = sock.getsockname()[1]
        self._tasks = [
            asyncio.ensure_future(self._accept()),
            asyncio.ensure_future(self._janitor()),
        ]
        log.info(
            "serving the Hurray transport on %s:%d (tiers: %s)",
            host,
            self.port,
            ", ".join(self.store.tier_names),
        )
        return self.port

    async def serve_forever(self) -> None:
        """Serve until SIGTERM or SIGINT, then shut down gracefully."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopped.set)
        await self._stopped.wait()
        log.info("signal received: draining")
        await self.shutdown()

    def stop(self) -> None:
        self._stopped.set()

    async def shutdown(self) -> None:
        """Stop accepting, let in-flight requests finish (up to shutdown_timeout_s),
        close every connection, flush the store's write-through and close it."""
        self.draining = True
        if self._listener is not None:
            self._listener.close()
        accept, janitor = self._tasks or (None, None)
        if accept is not None:
            accept.cancel()
            await asyncio.gather(accept, return_exceptions=True)
        deadline = time.monotonic() + self.cfg.shutdown_timeout_s
        while any(s.busy for s in self.sessions) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for s in list(self.sessions):
            s.close()
            if s.task is not None:
                s.task.cancel()  # a read waiting on a closed socket would never wake
        while self.sessions and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for st in self.staged.values():
            for landing in st.objects.values():
                landing.release()
        self.staged.clear()
        await self.store.close()
        if janitor is not None:  # the heartbeat ran through the drain: /healthz stayed up
            janitor.cancel()
            await asyncio.gather(janitor, return_exceptions=True)
        if self.http is not None:
            self.http.stop()
        log.info("shut down")

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                conn, addr = await loop.sock_accept(self._listener)
            except OSError as e:
                if self.draining:
                    return
                log.warning("accept failed: %s", e)
                await asyncio.sleep(0.05)
                continue
            s = Session(
                self, conn, f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
            )
            self.sessions.add(s)
            s.task = asyncio.ensure_future(s.run())

    async def _janitor(self) -> None:
        """Twice a second: the liveness heartbeat; drop expired staged objects and claims."""
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            self.beat = now
            for seg, st in list(self.staged.items()):
                if now - st.since > self.cfg.staging_timeout_s:
                    log.warning(
                        "segment %s: %d staged layer objects saw no commit in %.0f s; dropped",
                        seg.hex,
                        len(st.objects),
                        self.cfg.staging_timeout_s,
                    )
                    self._drop_staged(seg)
            for h, c in list(self.claims.items()):
                if c.deadline <= now:
                    self._end_claim(h)

    # ------------------------------------------------------------------ staging and claims

    def _drop_staged(self, seg: SegmentKey) -> None:
        st = self.staged.pop(seg, None)
        for landing in st.objects.values() if st else ():
            landing.release()

    def _end_claim(self, h: bytes) -> None:
        c = self.claims.pop(h, None)
        if c is not None:
            c.left -= 1
            if c.left <= 0 and not c.fut.done():
                c.fut.set_result(None)

    def end_claims_of(self, owner: Session) -> None:
        for h in [h for h, c in self.claims.items() if c.owner is owner]:
            self._end_claim(h)

    async def lookup(
        self,
        session: Session,
        claim: bool,
        wait_s: float,
        seqs: list[tuple[int, list[bytes]]],
        max_bytes: int,
    ) -> tuple[list[int], list[bytes]]:
        """Matched pages and manifests; with ``claim``, first wait (at most ``wait_s``)
        for pages other connections claimed, then claim what is still missing."""
        deadline = time.monotonic() + min(wait_s, self.cfg.request_timeout_s)
        while True:
            matched, manifests = await self.store.find_segments(seqs, max_bytes)
            if not claim:
                return matched, manifests
            now = time.monotonic()
            waits = {
                c.fut
                for (_, hs), m in zip(seqs, matched, strict=True)
                for h in hs[m:]
                if (c := self.claims.get(h)) is not None
                and c.owner is not session
                and c.deadline > now
            }
            if not waits or now >= deadline:
                break
            await asyncio.wait(waits, timeout=max(0.0, deadline - now))
        todo = {
            h
            for (_, hs), m in zip(seqs, matched, strict=True)
            for h in hs[m:]
            if h not in self.claims
        }
        if todo:
            cs = _ClaimSet(
                session,
                asyncio.get_running_loop().create_future(),
                time.monotonic() + self.cfg.claim_timeout_s,
                len(todo),
            )
            for h in todo:
                self.claims[h] = cs
        return matched, manifests

    async def commit(self, manifest_key: str, manifest: memoryview) -> tuple[int, str] | None:
        """Store a segment from its manifest and staged objects; None when stored, else
        (error code, why)."""
        seg = self.store.key(manifest_key).segment
        if seg is None or not seg.is_manifest:
            return (
                Err.REJECTED,
                f"{manifest_key!r} is not a manifest key of this server's namespace "
                f"({self.store.namespace!r})",
            )
        st = self.staged.pop(seg.segment, None)
        landings = st.objects if st else {}
        data = bytes(manifest)

        def release() -> None:
            for landing in landings.values():
                landing.release()

        try:
            m = Manifest.from_bytes(data)  # parsed once: the store checks it, the claims end by it
        except FormatError as e:
            release()
            return Err.REJECTED, str(e)
        try:
            reserved = {k: v.res for k, v in landings.items() if v.res is not None}
            views = {k: v.view for k, v in landings.items()}
            ok = await self.store.commit_segment(
                seg.segment, data, views, release, reserved, parsed=m
            )
        except FormatError as e:
            return Err.REJECTED, str(e)
        finally:
            for h in (h for sq in m.sequences for h in sq.page_hashes):
                self._end_claim(h)
        return None if ok else (Err.NOT_STORED, "no tier of the server took the segment")


class Session:
    """One client connection."""

    def __init__(self, server: CacheServer, sock: socket.socket, peer: str) -> None:
        self.server = server
        self.cfg = server.cfg
        self.sock = sock
        self.peer = peer
        self.ch: tp.Channel | None = None
        self.task: asyncio.Task[None] | None = None
        self.puts: dict[int, _Put] = {}
        self.handlers: set[asyncio.Task[None]] = set()
        self.ext = False
        self.frame = 1 << 20
        self.client_max = 1 << 20
        self.reading = False  # inside a message (its header has arrived)
        self.last_sid = 0  # stream of the last header read: where a connection-level ERROR goes

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
            self.ch = tp.Channel(self.sock)
            if await self._hello():
                await self._loop()
        except ProtocolError as e:
            await self._fatal(self.last_sid, e.code, str(e))
        except TimeoutError:  # before OSError, its base class
            await self._fatal(
                self.last_sid, Err.TIMEOUT, "a message took longer than request_timeout_s"
            )
        except (tp.ConnectionClosed, OSError):
            pass
        except asyncio.CancelledError:
            pass
        finally:
            for t in list(self.handlers):
                t.cancel()
            await asyncio.gather(*self.handlers, return_exceptions=True)
            for p in self.puts.values():
                if p.landing is not None:
                    p.landing.release()
            self.puts.clear()
            self.server.end_claims_of(self)
            self.close()
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

    async def _error(self, stream: int, code: int, message: str) -> None:
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
        if self.cfg.token:
            given = (hello.ext or {}).get("token", "")
            if not hmac.compare_digest(given.encode(), self.cfg.token.encode()):
                await self._fatal(sid, Err.AUTH_FAILED, "missing or wrong token")
                return False
        if self.server.draining:
            await self._fatal(sid, Err.SHUTTING_DOWN, "the server is shutting down")
            return False
        if len(self.server.sessions) > self.cfg.max_connections:
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
                "namespace": self.server.store.namespace,
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
                async with ch.send_lock:
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
        put = _Put(
            key,
            None,
            n,
            deadline=time.monotonic() + transfer_timeout_s(self.cfg.request_timeout_s, n),
        )
        self.puts[sid] = put
        if n > self.cfg.max_object_bytes:
            await self._error(
                sid,
                Err.MESSAGE_TOO_LARGE,
                f"an object of {n} bytes; this server takes at most {self.cfg.max_object_bytes}",
            )
            return
        if not await self.server.budget.take(n, self.cfg.request_timeout_s):
            await self._error(
                sid,
                Err.BUSY,
                f"no room for {n} more bytes of puts in flight within "
                f"{self.cfg.request_timeout_s} s",
            )
            return
        put.landing = _Landing(self.server, n)

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
        if put.landing is None:
            await ch.skip(k)
        else:
            await ch.read_into(put.landing.view[off : off + k])
            self.server.metrics.bytes_in.inc(k)
        put.pos += k

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

    async def _put_store(self, sid: int, key: str, landing: _Landing) -> None:
        store = self.server.store
        k = store.key(key)
        seg = k.segment
        if seg is not None and seg.is_manifest:
            landing.release()
            await self._error(
                sid, Err.REJECTED, "a segment's manifest commits it: send it with X_COMMIT"
            )
            return
        if seg is not None:
            st = self.server.staged.setdefault(seg.segment, _Staged())
            old = st.objects.pop(k.stored, None)
            if old is not None:
                old.release()
            st.objects[k.stored] = landing
            ok = True
        else:
            ok = await store.put_key(k, [landing.view], landing.release, landing.res)
        assert self.ch is not None
        if ok:
            async with self.ch.send_lock:
                await self.ch.send(Msg.TENSOR_PUT_ACK, sid)
        else:
            await self._error(sid, Err.NOT_STORED, "no tier of the server took the object")

    # ------------------------------------------------------------------ requests

    def _spawn(self, kind: Msg, sid: int, payload: memoryview) -> None:
        self.server.metrics.requests.labels(kind.name).inc()
        handler = getattr(self, f"_on_{kind.name.lower()}")
        self._track(handler(sid, payload), kind.name, sid)

    def _track(self, coro: Any, name: str, sid: int) -> None:
        async def timed() -> None:
            t0 = time.perf_counter()
            try:
                await coro
            except ProtocolError as e:
                if e.fatal:
                    await self._fatal(sid, e.code, str(e))
                else:
                    await self._error(sid, e.code, str(e))
            except TimeoutError:  # an answer stuck half-sent: the stream is unusable
                log.info(
                    "client %s: an answer took longer than request_timeout_s to send; closing",
                    self.peer,
                )
                self.close()
            except (tp.ConnectionClosed, OSError):
                self.close()
            except Exception as e:  # a bug of ours: this request fails, the server goes on
                log.exception("client %s: %s failed", self.peer, name)
                with contextlib.suppress(Exception):
                    await self._error(
                        sid, Err.INTERNAL, f"{name} failed on the server: {e.__class__.__name__}"
                    )
            finally:
                self.server.metrics.latency.labels(name).observe(time.perf_counter() - t0)

        task = asyncio.ensure_future(timed())
        self.handlers.add(task)
        task.add_done_callback(self.handlers.discard)

    async def _send_object(self, sid: int, k: ServedKey, read: Any) -> None:
        """Answer with a stored object (or byte ranges of one): pinned while it is sent,
        so no eviction reuses its memory under the send."""
        store = self.server.store
        groups = store.pin_keys([k])
        try:
            parts = await read()
            if parts is None:
                await self._error(sid, Err.UNKNOWN_TENSOR, "no such object")
                return
            views = [host_view(p) for p in parts]
            assert self.ch is not None
            nbytes = sum(v.nbytes for v in views)
            # A client that stops reading cannot hold the object pinned (and the
            # connection) forever: past the timeout its connection is cut.
            async with (
                self.ch.send_lock,
                asyncio.timeout(transfer_timeout_s(self.cfg.request_timeout_s, nbytes)),
            ):
                await self.ch.send_object(sid, views, self.frame)
            self.server.metrics.bytes_out.inc(sum(v.nbytes for v in views))
        finally:
            store.unpin_groups(groups)

    async def _on_tensor_request(self, sid: int, payload: memoryview) -> None:
        req = _stream(tp.decode_request, payload)
        if req.device != tp.DEVICE_CPU:
            await self._error(
                sid,
                Err.DEVICE_UNAVAILABLE,
                f"device 0x{req.device:02x}: this server serves CPU memory (0x00) only",
            )
            return
        store = self.server.store
        k = store.key(req.key)

        async def read() -> list[Any] | None:
            # The whole object as one range: a view of the tier's memory where it has
            # one (sent while pinned), not a copy.
            n = await store.key_size(k)
            if n is not None:
                got = await store.get_key_ranges(k, [(0, n)])
                if got is not None:
                    return got
            blob = await store.get_key(k)
            return None if blob is None else [blob]

        await self._send_object(sid, k, read)

    async def _on_x_ranges(self, sid: int, payload: memoryview) -> None:
        key, ranges = _stream(tp.decode_ranges, payload)
        total = sum(n for _, n in ranges)
        if total > self.cfg.max_object_bytes:
            await self._error(
                sid,
                Err.MESSAGE_TOO_LARGE,
                f"ranges of {total} bytes; at most {self.cfg.max_object_bytes}",
            )
            return
        k = self.server.store.key(key)
        await self._send_object(sid, k, lambda: self.server.store.get_key_ranges(k, ranges))

    async def _on_x_contains(self, sid: int, payload: memoryview) -> None:
        keys = _stream(tp.decode_keys, payload)
        store = self.server.store
        sizes = [await store.key_size(store.key(k)) for k in keys]
        await self._reply(sid, Msg.X_CONTAINS_REPLY, tp.encode_sizes(sizes))

    async def _on_x_delete(self, sid: int, payload: memoryview) -> None:
        store = self.server.store
        for k in _stream(tp.decode_keys, payload):
            await store.delete_key(store.key(k))
        await self._reply(sid, Msg.X_DELETE_ACK, b"")

    async def _on_x_lookup(self, sid: int, payload: memoryview) -> None:
        claim, wait_ms, seqs = _stream(lambda p: tp.decode_lookup(p, HASH_LEN), payload)
        matched, manifests = await self.server.lookup(
            self, claim, wait_ms / 1000, seqs, self.client_max - 4096
        )
        await self._reply(sid, Msg.X_LOOKUP_REPLY, tp.encode_lookup_reply(matched, manifests))

    async def _on_x_commit(self, sid: int, payload: memoryview) -> None:
        key, manifest = _stream(lambda p: tp.decode_commit(p, self.cfg.max_message_bytes), payload)
        failed = await self.server.commit(key, manifest)
        if failed is None:
            await self._reply(sid, Msg.X_COMMIT_ACK, b"")
        else:
            log.warning("client %s: commit of %s refused: %s", self.peer, key, failed[1])
            await self._error(sid, *failed)

    async def _on_x_stats(self, sid: int, payload: memoryview) -> None:
        srv = self.server
        stats = srv.store.stats()
        stats["server"] = {
            "connections": len(srv.sessions),
            "inflight_put_bytes": srv.budget.used,
            "staged_segments": len(srv.staged),
            "claimed_pages": len(srv.claims),
            "draining": srv.draining,
        }
        await self._reply(sid, Msg.X_STATS_REPLY, tp.encode_json(stats))

    async def _reply(self, sid: int, kind: Msg, payload: bytes) -> None:
        assert self.ch is not None
        async with (
            self.ch.send_lock,
            asyncio.timeout(transfer_timeout_s(self.cfg.request_timeout_s, len(payload))),
        ):
            await self.ch.send(kind, sid, payload)


def _stream(decode: Any, payload: memoryview) -> Any:
    """``decode(payload)``; a bad field is an ERROR on this request's stream only (the
    message was well framed, so the connection can go on)."""
    try:
        return decode(payload)
    except ProtocolError as e:
        raise ProtocolError(e.code, str(e), fatal=False) from None


async def serve(
    store: TieredStore,
    cfg: ServerConfig,
    *,
    host: str | None = None,
    port: int | None = None,
    metrics_port: int | None = -1,
) -> None:
    """Open the store, serve until SIGTERM/SIGINT, shut down gracefully."""
    await store.open()
    server = CacheServer(store, cfg)
    await server.start(host, port, metrics_port)
    # Everything loaded so far (torch, the index) lives as long as the server: keep it
    # out of the garbage collector's passes, which the per-request objects trigger.
    gc.freeze()
    await server.serve_forever()


__all__ = ["CacheServer", "Session", "serve"]
