"""The transport's socket channel: one connection's byte stream on the running loop.

``Channel`` wraps a non-blocking socket: reads are buffered for headers and small
payloads, and large payloads are received straight into the caller's buffer
(``recv_into``); writes go out with ``sendmsg`` (header and data in one call, no
joining). One channel is one connection; its owner serialises writes. Large reads and
writes run on ``IO_THREADS``.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import select
import socket
import threading
import traceback
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hurray_store.transport.messages import (
    HEADER,
    HEADER_LEN,
    Msg,
    data_frames,
    encode_descriptor,
    encode_error,
)

# --------------------------------------------------------------------------- socket channel


_THREAD_BYTES = 1 << 20  # reads and writes this large run in a worker thread
_IDLE_S = 0.05  # a thread whose peer moves no bytes this long goes back to the pool


class IOThreads:
    """Threads for large socket reads and writes: the kernel copies of several
    connections then run on several cores (``recv_into``/``sendmsg`` release the GIL),
    where the event loop's thread would do them one at a time. Started on first use;
    ``shutdown`` (also at interpreter exit) stops them."""

    def __init__(self, workers: int = 8) -> None:
        self.workers = workers
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=self.workers, thread_name_prefix="hurray-io"
                )
            return self._executor

    def shutdown(self) -> None:
        with self._lock:
            ex, self._executor = self._executor, None
        if ex is not None:
            ex.shutdown(wait=False, cancel_futures=True)


IO_THREADS = IOThreads()
atexit.register(IO_THREADS.shutdown)


class ConnectionClosed(ConnectionError):
    """The peer closed the connection (or it broke) mid-message or between messages."""


class Channel:
    """One connection's byte stream, on the running loop, over a non-blocking socket."""

    def __init__(self, sock: socket.socket, *, buffer_size: int = 256 << 10) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1) if sock.family in (
            socket.AF_INET,
            socket.AF_INET6,
        ) else None
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self._buf = bytearray(buffer_size)
        self._mv = memoryview(self._buf)
        self._lo = 0
        self._hi = 0
        self.send_lock = asyncio.Lock()
        self.closed = False

    def grow(self, buffer_size: int) -> None:
        """A larger read buffer (a connection past its handshake), keeping what it holds."""
        if buffer_size <= len(self._buf):
            return
        held = self._mv[self._lo : self._hi]
        buf = bytearray(buffer_size)
        buf[: len(held)] = held
        self._buf, self._mv = buf, memoryview(buf)
        self._lo, self._hi = 0, len(held)

    @classmethod
    async def connect(cls, host: str, port: int, timeout: float) -> Channel:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        err: BaseException | None = None
        for family, kind, proto, _, addr in infos:
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            try:
                async with asyncio.timeout(timeout):
                    await loop.sock_connect(sock, addr)
                return cls(sock)
            except (OSError, TimeoutError) as e:
                sock.close()
                err = e
        raise ConnectionRefusedError(f"cannot connect to {host}:{port}: {err}")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()

    # ------------------------------------------------------------------ reading

    async def _wait(self, reader: bool) -> None:
        fut = self.loop.create_future()
        fd = self.sock.fileno()
        if fd < 0:
            raise ConnectionClosed("connection closed")
        add, remove = (
            (self.loop.add_reader, self.loop.remove_reader)
            if reader
            else (self.loop.add_writer, self.loop.remove_writer)
        )

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        add(fd, ready)
        try:
            await fut
        finally:
            remove(fd)

    async def _recv_into(self, view: memoryview) -> int:
        while True:
            try:
                n = self.sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                await self._wait(True)
                continue
            except OSError as e:
                raise ConnectionClosed(f"connection broke: {e}") from e
            if n == 0:
                raise ConnectionClosed("peer closed the connection")
            return n

    async def read_into(self, view: memoryview) -> None:
        """Fill ``view`` exactly: buffered bytes first, then straight from the socket
        (a large view never passes through the buffer)."""
        need = view.nbytes
        pos = 0
        have = self._hi - self._lo
        if have:
            k = min(have, need)
            view[:k] = self._mv[self._lo : self._lo + k]
            self._lo += k
            pos = k
        if need - pos >= _THREAD_BYTES:
            # A thread while bytes flow; the loop waits when the peer sends none, so a
            # peer that stalls holds no thread.
            while pos < need:
                pos += await self._in_thread(self._recv_some, view[pos:])
                if pos < need:
                    await self._wait(True)
            return
        while pos < need:
            if need - pos >= len(self._buf) // 2:
                pos += await self._recv_into(view[pos:])
                continue
            self._lo = self._hi = 0
            self._hi = await self._recv_into(self._mv)
            k = min(self._hi, need - pos)
            view[pos : pos + k] = self._mv[:k]
            self._lo = k
            pos += k

    async def _in_thread(self, fn: Any, *args: Any) -> int:
        """Run blocking socket I/O in a worker thread; its result. On cancellation (a
        timeout) the thread is told to stop and awaited, so no thread touches the
        caller's buffer after this returns."""
        stop = threading.Event()
        fut = self.loop.run_in_executor(IO_THREADS.executor(), fn, *args, stop)
        try:
            n = int(await asyncio.shield(fut))
        except asyncio.CancelledError:
            stop.set()
            await asyncio.wait([fut])
            if not fut.cancelled() and (e := fut.exception()) is not None:
                # Retrieved (no "never retrieved" log line), and the thread's frames let
                # go of the caller's buffer.
                traceback.clear_frames(e.__traceback__)
            raise
        if n < 0:
            raise ConnectionClosed("connection closed")
        return n

    def _recv_some(self, view: memoryview, stop: threading.Event) -> int:
        """Receive into ``view`` until it is full, or until the peer has sent nothing
        for _IDLE_S (the thread is then given back); the bytes received, -1 when told to
        stop or the channel closed (no exception: none outlives the call holding the
        caller's buffer in its frames)."""
        pos, need = 0, view.nbytes
        idle = False
        while pos < need:
            if stop.is_set() or self.closed:
                return -1
            try:
                n = self.sock.recv_into(view[pos:])
            except (BlockingIOError, InterruptedError):
                if idle:
                    return pos
                idle = True
                select.select([self.sock], [], [], _IDLE_S)
                continue
            except OSError as e:
                raise ConnectionClosed(f"connection broke: {e}") from e
            if n == 0:
                raise ConnectionClosed("peer closed the connection")
            pos += n
            idle = False
        return pos

    def _send_some(self, views: list[memoryview], i: int, stop: threading.Event) -> int:
        """Send ``views[i:]`` until all are sent, or until the peer has taken nothing for
        _IDLE_S (the thread is then given back); the index of the first unsent view
        (``views`` is advanced in place), -1 when told to stop or the channel closed."""
        idle = False
        while i < len(views):
            if stop.is_set() or self.closed:
                return -1
            try:
                n = self.sock.sendmsg(views[i : i + 512])
            except (BlockingIOError, InterruptedError):
                if idle:
                    return i
                idle = True
                select.select([], [self.sock], [], _IDLE_S)
                continue
            except OSError as e:
                raise ConnectionClosed(f"connection broke: {e}") from e
            i = _advance(views, i, n)
            idle = False
        return i

    async def read(self, n: int) -> bytearray:
        out = bytearray(n)
        await self.read_into(memoryview(out))
        return out

    async def read_header(self) -> tuple[int, int, int]:
        if self._hi - self._lo >= HEADER_LEN:
            h = HEADER.unpack_from(self._buf, self._lo)
            self._lo += HEADER_LEN
            return h
        return HEADER.unpack(await self.read(HEADER_LEN))

    async def skip(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n:
            k = min(n, scratch.nbytes)
            await self.read_into(scratch[:k])
            n -= k

    # ------------------------------------------------------------------ writing

    async def send_parts(self, parts: Sequence[bytes | bytearray | memoryview]) -> None:
        """Write every part, in order, with as few ``sendmsg`` calls as the kernel
        allows. The caller holds ``send_lock`` when messages could interleave."""
        views = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]
        i = 0
        if sum(v.nbytes for v in views) >= _THREAD_BYTES:
            # A thread while bytes flow; the loop waits when the peer takes none, so a
            # peer that stops reading holds no thread.
            while i < len(views):
                i = await self._in_thread(self._send_some, views, i)
                if i < len(views):
                    await self._wait(False)
            return
        while i < len(views):
            try:
                n = self.sock.sendmsg(views[i : i + 512])
            except (BlockingIOError, InterruptedError):
                await self._wait(False)
                continue
            except OSError as e:
                raise ConnectionClosed(f"connection broke: {e}") from e
            i = _advance(views, i, n)

    async def send(self, kind: int, stream: int, *payload: bytes | bytearray | memoryview) -> None:
        n = sum(memoryview(p).nbytes for p in payload)
        await self.send_parts([HEADER.pack(kind, stream, n), *payload])

    async def send_object(
        self, stream: int, parts: Sequence[bytes | bytearray | memoryview], frame: int
    ) -> None:
        """TENSOR_DESCRIPTOR, TENSOR_DATA frames of at most ``frame`` payload bytes,
        TENSOR_DATA_END: the concatenation of ``parts`` as one object."""
        desc = encode_descriptor(sum(memoryview(p).nbytes for p in parts))
        await self.send_parts(
            [
                HEADER.pack(Msg.TENSOR_DESCRIPTOR, stream, len(desc)),
                desc,
                *data_frames(stream, parts, frame),
            ]
        )

    async def send_error(self, stream: int, code: int, message: str) -> None:
        await self.send(Msg.ERROR, stream, encode_error(code, message))


def _advance(views: list[memoryview], i: int, n: int) -> int:
    """Drop ``n`` sent bytes from ``views[i:]``; the index of the first unsent view."""
    while n:
        if n >= views[i].nbytes:
            n -= views[i].nbytes
            i += 1
        else:
            views[i] = views[i][n:]
            n = 0
    return i
