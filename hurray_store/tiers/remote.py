"""The ``remote`` tier: a hurray_store cache server (``hurray://host:port``) that many
engine processes share.

A pool of ``connections`` connections, opened on first use; each speaks the Hurray
network transport (``transport.py``) and carries many requests at once, told apart by
their stream ids (pipelining): one task per connection reads the answers and hands each
to its caller, writing object data straight into the caller's buffer.

Mapping of the tier interface onto the wire:

===============  ==============================================================
get              TENSOR_REQUEST -> TENSOR_DESCRIPTOR, TENSOR_DATA..., DATA_END
get_ranges       X_RANGES (the bytes of the ranges, as one object)
put              TENSOR_PUT, TENSOR_DATA..., DATA_END -> TENSOR_PUT_ACK; a
                 segment's manifest goes as X_COMMIT instead: the server then
                 stores the segment's staged layer objects and the manifest as one
contains/sizes   X_CONTAINS
delete           X_DELETE
lookup_prefix    X_LOOKUP (segments other engines stored; claims for a put)
===============  ==============================================================

Outages (server down, restarting, unreachable): a call that cannot connect, breaks or
times out is a miss or a skipped write, never an exception; the tier logs once, backs
off (``backoff_initial_s`` doubling to ``backoff_max_s``) and the first call after the
backoff reconnects. An ERROR answer (not found, refused) is a miss or a skipped write
for that call only.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from hurray_store import transport as tp
from hurray_store.config import RemoteTierConfig, parse_hurray_url
from hurray_store.errors import ConfigError, ProtocolError, RemoteError
from hurray_store.keys import SegmentPart, parse_key
from hurray_store.tiers.base import Capabilities, GroupObject
from hurray_store.tiers.helpers import transfer_timeout_s
from hurray_store.tiers.outage import Outage, ServiceTier
from hurray_store.tiers.remote_conn import NETWORK_ERRORS, Connection, handshake
from hurray_store.tiers.types import Blob, Buffer, Range, ReadInto

log = logging.getLogger(__name__)
T = TypeVar("T")


class RemoteTier(ServiceTier):
    config_cls = RemoteTierConfig
    caps = Capabilities(persistent=True, networked=True)

    def __init__(self, cfg: RemoteTierConfig, namespace: str | None = None) -> None:
        super().__init__(cfg, namespace)
        self.host, self.port = parse_hurray_url(cfg.url)
        if cfg.connections < 1:
            raise ConfigError("connections: expected at least 1")
        self.outage = Outage(self.name, cfg.backoff_initial_s, cfg.backoff_max_s)
        self._conns: list[Connection | None] = [None] * cfg.connections
        self._opening: list[asyncio.Lock] = [asyncio.Lock() for _ in range(cfg.connections)]
        self.server_hello: tp.Hello | None = None
        self._warned_ns = False

    # ------------------------------------------------------------------ connections

    async def _connect(self) -> Connection:
        cfg = self.cfg
        ch = await tp.Channel.connect(self.host, self.port, cfg.connect_timeout_s)
        hello = await handshake(ch, cfg)
        self.server_hello = hello
        theirs = (hello.ext or {}).get("namespace")
        if self.namespace is not None and theirs != self.namespace and not self._warned_ns:
            self._warned_ns = True
            log.warning(
                "tier %s: the server's namespace is %r, this store's %r: it will refuse "
                "this store's segments "
                "(set the same namespace on both)",
                self.name,
                theirs,
                self.namespace,
            )
        # A connection that breaks is an outage at once: the tier's holdings stop counting
        # (lookup) before a call has to fail on it.
        return Connection(ch, hello, cfg.max_message_bytes, lambda e: self.outage.down("read", e))

    async def _conn(self) -> Connection:
        """The least busy live connection; a missing or dead connection is (re)opened."""
        live = [c for c in self._conns if c is not None and not c.dead]
        if live:
            best = min(live, key=lambda c: len(c.pending))
            if not best.pending or len(live) == len(self._conns):
                return best
        for i, c in enumerate(self._conns):
            if c is None or c.dead:
                async with self._opening[i]:
                    c = self._conns[i]
                    if c is None or c.dead:
                        c = self._conns[i] = await self._connect()
                return c
        return min(live, key=lambda c: len(c.pending))  # pragma: no cover - all connections live

    async def _call(
        self,
        what: str,
        send: Callable[[Connection, int], Awaitable[None]],
        default: T,
        *,
        nbytes: int = 0,
        sink: list[memoryview] | None = None,
        expect: int | None = None,
    ) -> T | Any:
        """One request under the outage rules. ``expect``: the reply message type
        (its payload is returned); else the request's object (bytes or ``sink``)."""
        if not self.outage.ready:
            return default
        conn: Connection | None = None
        sid = 0
        try:
            async with asyncio.timeout(transfer_timeout_s(self.cfg.timeout_s, nbytes)):
                conn = await self._conn()
                sid, call = conn.start(sink)
                async with conn.ch.send_lock:
                    await send(conn, sid)
                result = await call.fut
        except RemoteError as e:
            self.outage.up()
            if e.code != tp.Err.UNKNOWN_TENSOR:
                log.warning("tier %s: %s refused: %s", self.name, what, e)
            return default
        except NETWORK_ERRORS as e:
            if conn is not None:
                # A half-sent request leaves no usable stream. Wait for the reader to
                # stop: until then it may still be writing into this call's buffer.
                conn.close(tp.ConnectionClosed(str(e)))
                await asyncio.gather(conn.reader, return_exceptions=True)
            self.outage.down(what, e)
            return default
        finally:
            if conn is not None:
                conn.pending.pop(sid, None)
        self.outage.up()
        if expect is not None:
            kind, payload = result
            if kind != expect:
                log.warning("tier %s: %s answered with message 0x%x", self.name, what, kind)
                return default
            return payload
        if isinstance(result, tuple):  # a control message where an object was due
            log.warning("tier %s: %s answered with message 0x%x", self.name, what, result[0])
            return default
        return result

    async def open(self) -> None:
        await self.ping()
        self.outage.watch(self._probe, self.cfg.timeout_s)

    async def _probe(self) -> None:
        """The outage's probe: a PING answered with a PONG, on a pooled connection (a
        new one if none is live); a connection it gave up on is not used again."""
        conn = await self._conn()
        sid, call = conn.start(None)
        try:
            async with conn.ch.send_lock:
                await conn.ch.send(tp.Msg.PING, sid, b"hs")
            kind, _ = await call.fut
        except BaseException as e:
            conn.close(tp.ConnectionClosed(f"probe: {e!r}"))
            raise
        finally:
            conn.pending.pop(sid, None)
        if kind != tp.Msg.PONG:
            raise ConnectionError(f"PING answered with message 0x{kind:x}")

    async def close(self) -> None:
        self.outage.stop()
        for i, c in enumerate(self._conns):
            if c is not None:
                c.close()
                await asyncio.gather(c.reader, return_exceptions=True)
                self._conns[i] = None

    async def ping(self) -> bool:
        async def send(c: Connection, sid: int) -> None:
            await c.ch.send(tp.Msg.PING, sid, b"hs")

        return await self._call("PING", send, None, expect=tp.Msg.PONG) is not None

    # ------------------------------------------------------------------ interface

    async def get(self, key: str) -> Blob | None:
        async def send(c: Connection, sid: int) -> None:
            await c.ch.send(tp.Msg.TENSOR_REQUEST, sid, tp.encode_request(key))

        return await self._call("TENSOR_REQUEST", send, None)

    async def get_ranges(
        self, key: str, ranges: Sequence[Range], into: ReadInto = None
    ) -> list[Blob] | None:
        total = sum(n for _, n in ranges)
        if into is None:
            into = bytearray(total)
        if isinstance(into, list):
            views = [memoryview(v).cast("B") for v in into]
        else:
            mv = memoryview(into).cast("B")
            views, pos = [], 0
            for _, n in ranges:
                views.append(mv[pos : pos + n])
                pos += n

        async def send(c: Connection, sid: int) -> None:
            await c.ch.send(tp.Msg.X_RANGES, sid, tp.encode_ranges(key, ranges))

        got = await self._call("X_RANGES", send, None, nbytes=total, sink=list(views))
        return None if got is None else list(views)

    async def put_group(self, objects: Sequence[GroupObject]) -> bool:
        """A segment (its last object is its manifest): the layer objects are staged on
        the server by TENSOR_PUT, then X_COMMIT stores the segment, verified, at once.
        Any other group: as the base class does it."""
        last = parse_key(objects[-1].key) if objects else None
        if not (isinstance(last, SegmentPart) and last.is_manifest):
            return await super().put_group(objects)
        if len(objects) > 1 and not await super().put_group(objects[:-1]):
            return False
        manifest = objects[-1]
        parts = [memoryview(b).cast("B") for b in manifest.buffers()]

        async def commit(c: Connection, sid: int) -> None:
            await c.ch.send(
                tp.Msg.X_COMMIT,
                sid,
                *tp.encode_commit(manifest.key, b"".join(parts) if len(parts) > 1 else parts[0]),
            )

        return (
            await self._call(
                "X_COMMIT", commit, None, nbytes=manifest.nbytes, expect=tp.Msg.X_COMMIT_ACK
            )
            is not None
        )

    async def put(self, key: str, buffers: Sequence[Buffer]) -> bool:
        parts = [memoryview(b).cast("B") for b in buffers]
        n = sum(p.nbytes for p in parts)

        async def send(c: Connection, sid: int) -> None:
            head = tp.encode_put(key, n)
            await c.ch.send_parts(
                [
                    tp.HEADER.pack(tp.Msg.TENSOR_PUT, sid, len(head)),
                    head,
                    *tp.data_frames(sid, parts, c.frame),
                ]
            )

        return (
            await self._call("TENSOR_PUT", send, None, nbytes=n, expect=tp.Msg.TENSOR_PUT_ACK)
            is not None
        )

    async def sizes(self, keys: Sequence[str]) -> list[int | None]:
        async def send(c: Connection, sid: int) -> None:
            await c.ch.send(tp.Msg.X_CONTAINS, sid, tp.encode_keys(keys))

        payload = await self._call("X_CONTAINS", send, None, expect=tp.Msg.X_CONTAINS_REPLY)
        if payload is None:
            return [None] * len(keys)
        got = tp.decode_sizes(payload)
        return got if len(got) == len(keys) else [None] * len(keys)

    async def contains(self, key: str) -> bool:
        return (await self.sizes([key]))[0] is not None

    async def delete_many(self, keys: Sequence[str]) -> None:
        if not keys:
            return

        async def send(c: Connection, sid: int) -> None:
            await c.ch.send(tp.Msg.X_DELETE, sid, tp.encode_keys(keys))

        await self._call("X_DELETE", send, None, expect=tp.Msg.X_DELETE_ACK)

    async def delete(self, key: str) -> None:
        await self.delete_many([key])

    async def lookup_prefix(
        self, seqs: Sequence[tuple[int, Sequence[bytes]]], *, claim: bool
    ) -> list[bytes] | None:
        """The manifests behind each sequence's pages past what it has, asked in
        requests within the server's caps (``MAX_LOOKUP_SEQS``, ``MAX_LOOKUP_HASHES``)."""
        out: list[bytes] = []
        for part in _lookup_parts(seqs):
            got = await self._lookup(part, claim)
            if got is None:
                return None
            out += got
        return out

    async def _lookup(
        self, seqs: Sequence[tuple[int, Sequence[bytes]]], claim: bool
    ) -> list[bytes] | None:
        async def send(c: Connection, sid: int) -> None:
            # Waiting for another engine's claim must end well inside this call's timeout.
            wait_ms = int(self.cfg.timeout_s * 500) if claim else 0
            await c.ch.send(
                tp.Msg.X_LOOKUP, sid, tp.encode_lookup(seqs, claim=claim, wait_ms=wait_ms)
            )

        payload = await self._call("X_LOOKUP", send, None, expect=tp.Msg.X_LOOKUP_REPLY)
        if payload is None:
            return None
        try:
            _matched, manifests = tp.decode_lookup_reply(payload)
        except ProtocolError as e:
            log.warning("tier %s: a malformed lookup answer: %s", self.name, e)
            return None
        return manifests

    async def server_stats(self) -> dict[str, Any] | None:
        """The server's stats (its store's, plus connections and requests)."""

        async def send(c: Connection, sid: int) -> None:
            await c.ch.send(tp.Msg.X_STATS, sid)

        payload = await self._call("X_STATS", send, None, expect=tp.Msg.X_STATS_REPLY)
        return None if payload is None else json.loads(bytes(payload))


def _lookup_parts(
    seqs: Sequence[tuple[int, Sequence[bytes]]],
) -> list[list[tuple[int, Sequence[bytes]]]]:
    """``seqs`` in runs that fit one X_LOOKUP (a sequence longer than the hash cap is
    asked for up to the cap: its match cannot reach past it anyway)."""
    out: list[list[tuple[int, Sequence[bytes]]]] = []
    cur: list[tuple[int, Sequence[bytes]]] = []
    n = 0
    for have, hashes in seqs:
        hashes = hashes[: tp.MAX_LOOKUP_HASHES]
        if cur and (len(cur) == tp.MAX_LOOKUP_SEQS or n + len(hashes) > tp.MAX_LOOKUP_HASHES):
            out.append(cur)
            cur, n = [], 0
        cur.append((have, hashes))
        n += len(hashes)
    if cur:
        out.append(cur)
    return out
