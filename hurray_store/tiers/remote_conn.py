"""The remote tier's connections to a cache server: the handshake (``handshake``), and
one connection carrying many requests at once, its reader writing each answer's object
data straight into its caller's buffer (``Connection``, ``Call``). Part of the remote
tier (``tiers/remote.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hurray_store import transport as tp
from hurray_store.config import RemoteTierConfig
from hurray_store.errors import ProtocolError

# What a broken or unreachable server raises: an outage, never a bug.
NETWORK_ERRORS = (tp.ConnectionClosed, OSError, TimeoutError, ProtocolError)


async def handshake(ch: tp.Channel, cfg: RemoteTierConfig) -> tp.Hello:
    """CLIENT_HELLO with this client's extension and token; the server's SERVER_HELLO.
    A refusal at the door (token, busy, draining) is a ConnectionRefusedError (an
    outage); a peer that is not a hurray_store server, a ProtocolError. The channel is
    closed on any failure."""
    try:
        async with asyncio.timeout(cfg.connect_timeout_s):
            ext = {"extensions": tp.EXTENSION, "client": "hurray_store"}
            if cfg.token:
                ext["token"] = cfg.token
            await ch.send(
                tp.Msg.CLIENT_HELLO,
                1,
                tp.Hello(max_message_size=cfg.max_message_bytes, ext=ext).encode(),
            )
            kind, _sid, n = await ch.read_header()
            if n > 1 << 20:
                raise ProtocolError(tp.Err.MESSAGE_TOO_LARGE, f"a {n}-byte answer to CLIENT_HELLO")
            payload = memoryview(await ch.read(n))
            if kind == tp.Msg.ERROR:  # refused at the door (token, busy, draining): an outage
                raise ConnectionRefusedError(
                    f"the server refused the connection: {tp.decode_error(payload)}"
                )
            if kind != tp.Msg.SERVER_HELLO:
                raise tp.invalid(f"message 0x{kind:x} where SERVER_HELLO was expected")
            hello = tp.Hello.decode(payload)
            if (
                hello.version != tp.PROTOCOL_VERSION
                or not hello.ext
                or tp.EXTENSION not in hello.ext.get("extensions", "").split(",")
            ):
                raise tp.invalid(
                    f"{cfg.url} is not a hurray_store server (version "
                    f"{hello.version}, extensions {hello.ext})"
                )
    except BaseException:
        ch.close()
        raise
    return hello


@dataclass(eq=False, slots=True)
class Call:
    """One request in flight: where its object's bytes go, and its answer."""

    fut: asyncio.Future[Any]
    sink: list[memoryview] | None = None  # destination views, filled in order
    total: int = -1  # bytes announced by TENSOR_DESCRIPTOR
    pos: int = 0
    data: bytearray | None = None
    views: list[memoryview] = field(default_factory=list)

    def begin(self, total: int) -> None:
        if self.total >= 0:
            raise tp.invalid("a second TENSOR_DESCRIPTOR on one stream")
        if self.sink is not None:
            if sum(v.nbytes for v in self.sink) != total:
                raise tp.invalid(
                    f"the server sent {total} bytes for ranges of "
                    f"{sum(v.nbytes for v in self.sink)}"
                )
            self.views = list(self.sink)
        else:
            self.data = bytearray(total)
            self.views = [memoryview(self.data)]
        self.total = total

    async def take(self, ch: tp.Channel, offset: int, n: int) -> None:
        if self.total < 0 or offset != self.pos or self.pos + n > self.total:
            raise tp.invalid(
                f"TENSOR_DATA at {offset} (+{n}) where {self.pos} of {self.total} was expected"
            )
        while n:
            v = self.views[0]
            k = min(n, v.nbytes)
            await ch.read_into(v[:k])
            self.views[0] = v[k:]
            if not self.views[0].nbytes:
                self.views.pop(0)
            n -= k
            self.pos += k

    def finish(self) -> None:
        if self.pos != self.total:
            raise tp.invalid(f"TENSOR_DATA_END after {self.pos} of {self.total} bytes")
        if not self.fut.done():
            self.fut.set_result(self.data if self.sink is None else self.sink)


class Connection:
    """One connection to the server, carrying many requests at once (told apart by
    stream ids); its reader task hands each answer to its caller."""

    def __init__(
        self,
        ch: tp.Channel,
        hello: tp.Hello,
        limit: int,
        on_lost: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.ch = ch
        self.on_lost = on_lost  # the server went away under an open connection
        self.hello = hello
        self.limit = limit
        self.pending: dict[int, Call] = {}
        self.next_sid = 1
        self.dead = False
        self.frame = max(4096, min(hello.max_message_size, tp.MAX_FRAME))
        self.reader = asyncio.ensure_future(self._read_loop())

    def start(self, sink: list[memoryview] | None = None) -> tuple[int, Call]:
        sid = self.next_sid
        self.next_sid = sid + 1 if sid < 0xFFFFFFF0 else 1
        call = Call(asyncio.get_running_loop().create_future(), sink)
        self.pending[sid] = call
        return sid, call

    def close(self, why: BaseException | None = None) -> None:
        self.dead = True
        self.ch.close()
        for call in self.pending.values():
            if not call.fut.done():
                call.fut.set_exception(why or tp.ConnectionClosed("connection closed"))
        self.pending.clear()
        if not self.reader.done() and self.reader is not asyncio.current_task():
            self.reader.cancel()

    async def _read_loop(self) -> None:
        ch = self.ch
        try:
            while True:
                kind, sid, n = await ch.read_header()
                if n > self.limit:
                    raise ProtocolError(
                        tp.Err.MESSAGE_TOO_LARGE,
                        f"server sent a {n}-byte message; the limit is {self.limit}",
                    )
                call = self.pending.get(sid)
                if kind == tp.Msg.TENSOR_DATA:
                    if n < tp.DATA_OFFSET.size:
                        raise tp.invalid("TENSOR_DATA shorter than its offset field")
                    (off,) = tp.DATA_OFFSET.unpack(await ch.read(tp.DATA_OFFSET.size))
                    if call is None:  # the caller gave up on this stream
                        await ch.skip(n - tp.DATA_OFFSET.size)
                    else:
                        await call.take(ch, off, n - tp.DATA_OFFSET.size)
                    continue
                payload = memoryview(await ch.read(n))
                if kind == tp.Msg.PING:
                    async with ch.send_lock:
                        await ch.send(tp.Msg.PONG, sid, payload)
                    continue
                if call is None:
                    continue
                if kind == tp.Msg.TENSOR_DESCRIPTOR:
                    call.begin(tp.decode_descriptor(payload, self.limit << 8))
                elif kind == tp.Msg.TENSOR_DATA_END:
                    call.finish()
                elif kind == tp.Msg.ERROR:
                    if not call.fut.done():
                        call.fut.set_exception(tp.decode_error(payload))
                elif not call.fut.done():
                    call.fut.set_result((kind, payload))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a broken stream: every call on it fails, the next reconnects
            if not self.dead and self.on_lost is not None:
                self.on_lost(e)
            self.close(
                e
                if isinstance(e, NETWORK_ERRORS)
                else tp.ConnectionClosed(f"{e.__class__.__name__}: {e}")
            )
