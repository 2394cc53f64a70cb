"""The cache server's requests, one handler each: every request a connection sends
besides its puts (TENSOR_REQUEST, X_RANGES, X_CONTAINS, X_DELETE, X_LOOKUP, X_COMMIT,
X_STATS). ``Session`` dispatches to them by an explicit table."""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import Any

from hurray_store import transport as tp
from hurray_store.errors import ProtocolError
from hurray_store.keys import HASH_LEN
from hurray_store.server.access import Op, ServedKey, authorize, served
from hurray_store.server.context import RequestContext
from hurray_store.tiers import host_view, transfer_timeout_s
from hurray_store.transport import Err, Msg

log = logging.getLogger(__name__)
_DECODE_ON_LOOP_BYTES = 256 << 10  # larger lookups are decoded in a worker thread


class Requests:
    """The request handlers of one connection, composed into its ``Session``: each
    reaches the connection only through ``ctx`` (``context.RequestContext``), and
    every key through ``access.served`` (whose decision is the only access check)."""

    def __init__(self, ctx: RequestContext) -> None:
        self.ctx = ctx

    def _key(self, op: Op, key: str) -> ServedKey:
        return served(self.ctx.tenant, op, key, self.ctx.server.store.namespaces)

    async def _send_object(self, sid: int, k: ServedKey, read: Any) -> None:
        """Answer with a stored object (or byte ranges of one): pinned while it is sent,
        so no eviction reuses its memory under the send."""
        store = self.ctx.server.store
        groups = store.pin_keys([k])
        try:
            parts = await read()
            if parts is None:
                await self.ctx.error(sid, Err.UNKNOWN_TENSOR, "no such object")
                return
            views = [host_view(p) for p in parts]
            assert self.ctx.ch is not None
            nbytes = sum(v.nbytes for v in views)
            # A client that stops reading cannot hold the object pinned (and the
            # connection) forever: past the timeout its connection is cut.
            async with (
                self.ctx.ch.send_lock,
                asyncio.timeout(transfer_timeout_s(self.ctx.cfg.request_timeout_s, nbytes)),
            ):
                await self.ctx.ch.send_object(sid, views, self.ctx.frame)
            self.ctx.server.metrics.bytes_out.inc(sum(v.nbytes for v in views))
        finally:
            store.unpin_groups(groups)

    async def on_tensor_request(self, sid: int, payload: memoryview) -> None:
        req = _stream(tp.decode_request, payload)
        if req.device != tp.DEVICE_CPU:
            await self.ctx.error(
                sid,
                Err.DEVICE_UNAVAILABLE,
                f"device 0x{req.device:02x}: this server serves CPU memory (0x00) only",
            )
            return
        store = self.ctx.server.store
        k = self._key("read", req.key)

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

    async def on_x_ranges(self, sid: int, payload: memoryview) -> None:
        key, ranges = _stream(tp.decode_ranges, payload)
        total = sum(n for _, n in ranges)
        if total > self.ctx.cfg.max_object_bytes:
            await self.ctx.error(
                sid,
                Err.MESSAGE_TOO_LARGE,
                f"ranges of {total} bytes; at most {self.ctx.cfg.max_object_bytes}",
            )
            return
        k = self._key("read", key)
        await self._send_object(sid, k, lambda: self.ctx.server.store.get_key_ranges(k, ranges))

    async def on_x_contains(self, sid: int, payload: memoryview) -> None:
        keys = _stream(tp.decode_keys, payload)
        store = self.ctx.server.store
        sizes = [await store.key_size(self._key("read", k)) for k in keys]
        await self._reply(sid, Msg.X_CONTAINS_REPLY, tp.encode_sizes(sizes))

    async def on_x_delete(self, sid: int, payload: memoryview) -> None:
        store = self.ctx.server.store
        for k in _stream(tp.decode_keys, payload):
            await store.delete_key(self._key("delete", k))
        await self._reply(sid, Msg.X_DELETE_ACK, b"")

    async def on_x_lookup(self, sid: int, payload: memoryview) -> None:
        decode = partial(_stream, lambda p: tp.decode_lookup(p, HASH_LEN), payload)
        # A large lookup is decoded in a worker thread: the loop serves others meanwhile.
        big = payload.nbytes > _DECODE_ON_LOOP_BYTES
        claim, wait_ms, seqs = await asyncio.to_thread(decode) if big else decode()
        matched, manifests = await self.ctx.server.staging.lookup(
            self.ctx, claim, wait_ms / 1000, seqs, self.ctx.client_max - 4096, self.ctx.tenant
        )
        await self._reply(sid, Msg.X_LOOKUP_REPLY, tp.encode_lookup_reply(matched, manifests))

    async def on_x_commit(self, sid: int, payload: memoryview) -> None:
        limit = self.ctx.cfg.max_message_bytes
        key, manifest = _stream(lambda p: tp.decode_commit(p, limit), payload)
        failed = await self.ctx.server.staging.commit(key, manifest, self.ctx.tenant)
        if failed is None:
            await self._reply(sid, Msg.X_COMMIT_ACK, b"")
        else:
            log.warning("client %s: commit of %s refused: %s", self.ctx.peer, key, failed[1])
            await self.ctx.error(sid, *failed)

    async def on_x_stats(self, sid: int, payload: memoryview) -> None:
        """An admin sees the whole server; another tenant its own counts only."""
        srv = self.ctx.server
        tenants = srv.store.tenants
        if not authorize(self.ctx.tenant, "stats", None, srv.store.namespaces).allowed:
            own = {"tenant": {"name": self.ctx.tenant.name, **self.ctx.tenant.stats()}}
            await self._reply(sid, Msg.X_STATS_REPLY, tp.encode_json(own))
            return
        stats = srv.store.stats()
        stats["tenants"] = tenants.stats()
        stats["server"] = {
            "connections": len(srv.sessions),
            "inflight_put_bytes": srv.budget.used,
            "inflight_message_bytes": srv.messages.used,
            "staged_segments": len(srv.staging.staged),
            "claimed_pages": len(srv.staging.claims),
            "draining": srv.draining,
        }
        await self._reply(sid, Msg.X_STATS_REPLY, tp.encode_json(stats))

    async def _reply(self, sid: int, kind: Msg, payload: bytes) -> None:
        assert self.ctx.ch is not None
        async with (
            self.ctx.ch.send_lock,
            asyncio.timeout(transfer_timeout_s(self.ctx.cfg.request_timeout_s, len(payload))),
        ):
            await self.ctx.ch.send(kind, sid, payload)


def _stream(decode: Any, payload: memoryview) -> Any:
    """``decode(payload)``; a bad field is an ERROR on this request's stream only (the
    message was well framed, so the connection can go on)."""
    try:
        return decode(payload)
    except ProtocolError as e:
        raise ProtocolError(e.code, str(e), fatal=False) from None
