"""The cache server's puts on one connection: a TENSOR_PUT's descriptor, its data frames
received straight into a ``PutBuffer`` (budget and the tenant's quota taken as bytes
arrive), its end, and the store of the object (or the staging of a segment's layer
object until its X_COMMIT). Composed into ``Session``, which reads the frames and hands
them here; it reaches the connection through ``context.PutContext``."""

from __future__ import annotations

import time
from dataclasses import dataclass

from hurray_store import transport as tp
from hurray_store.errors import FormatError, ProtocolError
from hurray_store.server.access import served
from hurray_store.server.context import PutContext
from hurray_store.server.segments import PER_OBJECT_BYTES, PutBuffer
from hurray_store.tiers import transfer_timeout_s
from hurray_store.transport import Err, Msg


@dataclass(eq=False, slots=True)
class PutInFlight:
    key: str
    buffer: PutBuffer | None  # None: refused; its frames are read and dropped
    total: int
    pos: int = 0
    deadline: float = 0.0


class Puts:
    """The puts in flight on one connection, by stream."""

    def __init__(self, ctx: PutContext) -> None:
        self.ctx = ctx
        self.inflight: dict[int, PutInFlight] = {}

    def release_all(self) -> None:
        """The connection ended: every put buffer's budget goes back."""
        for p in self.inflight.values():
            if p.buffer is not None:
                p.buffer.release()
        self.inflight.clear()

    async def begin(self, sid: int, payload: memoryview) -> None:
        cfg = self.ctx.cfg
        if sid in self.inflight:
            raise ProtocolError(Err.INVALID_MESSAGE, f"a second TENSOR_PUT on stream {sid}")
        key, n = tp.decode_put(
            payload
        )  # a bad descriptor is fatal: its frames cannot be told from what follows
        self.ctx.server.metrics.requests.labels("TENSOR_PUT").inc()
        put = PutInFlight(
            key,
            None,
            n,
            deadline=time.monotonic() + transfer_timeout_s(cfg.request_timeout_s, n),
        )
        self.inflight[sid] = put
        if n > cfg.max_object_bytes:
            await self.ctx.error(
                sid,
                Err.MESSAGE_TOO_LARGE,
                f"an object of {n} bytes; this server takes at most {cfg.max_object_bytes}",
            )
            return
        # An object costs its key and what the server keeps per object now (many empty
        # puts are not free), and its bytes as they arrive (a put that announces much and
        # sends little holds little).
        cost = len(key.encode()) + PER_OBJECT_BYTES
        got = await self.ctx.server.budget.take(cost, cfg.request_timeout_s / 2)
        # The frames' deadline runs from now: the wait for room is not the client's delay.
        put.deadline = time.monotonic() + transfer_timeout_s(cfg.request_timeout_s, n)
        if not got:
            await self.ctx.error(
                sid,
                Err.BUSY,
                f"no room for {cost} more bytes of puts in flight within {cfg.request_timeout_s} s",
            )
            return
        if not await self._stage_room(sid, cost):
            self.ctx.server.budget.give(cost)
            return
        put.buffer = PutBuffer(
            self.ctx.server.store, self.ctx.server.budget, n, cost, self.ctx.tenant
        )

    async def data(self, sid: int, n: int) -> None:
        cfg = self.ctx.cfg
        ch = self.ctx.ch
        assert ch is not None
        put = self.inflight.get(sid)
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
        buffer = put.buffer
        if buffer is not None and not await self._stage_room(sid, k):
            put.buffer = None  # over the tenant's quota: refused, its frames dropped
            buffer.release()
            buffer = None
        if buffer is not None and not await self.ctx.server.budget.take(
            k, cfg.request_timeout_s / 2
        ):
            # No room for these bytes: the put is refused; its other frames are dropped.
            put.buffer = None
            buffer.release()
            buffer = None
            await self.ctx.error(
                sid, Err.BUSY, f"no room for {k} more bytes of puts in flight; the put is dropped"
            )
        if buffer is None:
            await ch.skip(k)
        else:
            # Given back with the rest once the store no longer needs it; counted in the
            # tenant's staging until then.
            buffer.grow(k)
            await ch.read_into(buffer.view[off : off + k])
            self.ctx.server.metrics.bytes_in.inc(k)
        put.pos += k

    async def _stage_room(self, sid: int, n: int) -> bool:
        """Room under the tenant's quota for ``n`` more bytes of its puts in flight
        (made by deleting its own least recently used groups); else ERROR NOT_STORED on
        the put's stream, and False."""
        why = await self.ctx.server.store.tenants.stage_room(self.ctx.tenant, n)
        if why:
            await self.ctx.error(sid, Err.NOT_STORED, why)
        return not why

    def end(self, sid: int, n: int) -> None:
        put = self.inflight.pop(sid, None)
        if put is None or n:
            raise ProtocolError(
                Err.INVALID_MESSAGE,
                f"TENSOR_DATA_END on stream {sid} without a TENSOR_PUT, or with a payload",
            )
        if put.pos != put.total:
            if put.buffer is not None:
                put.buffer.release()
            raise ProtocolError(
                Err.INVALID_MESSAGE, f"TENSOR_DATA_END after {put.pos} of {put.total} bytes"
            )
        if put.buffer is not None:
            self.ctx.track(self._store(sid, put.key, put.buffer), "TENSOR_PUT", sid)

    async def _store(self, sid: int, key: str, buffer: PutBuffer) -> None:
        store = self.ctx.server.store
        k = served(self.ctx.tenant, "write", key, store.namespaces)
        seg = k.segment
        if seg is not None and seg.is_manifest:
            buffer.release()
            await self.ctx.error(
                sid, Err.REJECTED, "a segment's manifest commits it: send it with X_COMMIT"
            )
            return
        if seg is not None:
            self.ctx.server.staging.stage(seg.segment, k.stored, buffer)
            ok = True
        else:
            try:
                ok = await store.put_key(
                    k, [buffer.view], self.ctx.tenant, buffer.release, buffer.res
                )
            except FormatError as e:
                await self.ctx.error(sid, Err.NOT_STORED, str(e))
                return
        assert self.ctx.ch is not None
        if ok:
            async with self.ctx.ch.send_lock:
                await self.ctx.ch.send(Msg.TENSOR_PUT_ACK, sid)
        else:
            await self.ctx.error(sid, Err.NOT_STORED, "no tier of the server took the object")
