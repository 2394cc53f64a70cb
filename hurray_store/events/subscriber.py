"""A KV-event subscriber, as a router's would be: a SUB socket on the publisher's
endpoint, and, where the publisher has one, its ROUTER for replays of what a gap in the
sequence numbers says was missed. ``hurray-store events`` prints what it receives, one
line an event (``watch``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import zmq

from hurray_store.events.publisher import END_SEQ
from hurray_store.events.wire import DECODER, BlockRemoved, BlockStored, KVEventBatch


@dataclass(frozen=True, slots=True)
class Received:
    topic: str
    seq: int
    batch: KVEventBatch


class Subscriber:
    def __init__(
        self, endpoint: str, topic: str = "", replay_endpoint: str = "", *, start: int | None = None
    ) -> None:
        """``start``: the first sequence number wanted (a first message past it is a
        gap, replayed); None: from whatever comes first."""
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.connect(endpoint)
        self._sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self._replay: zmq.Socket[bytes] | None = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.connect(replay_endpoint)
        self.last: int | None = None if start is None else start - 1  # the last seen
        self.missed = 0  # sequence numbers neither received nor replayed

    def recv(self, timeout_s: float) -> list[Received]:
        """The next message, and before it what a gap since the last one says was
        missed (replayed when the publisher can); [] after ``timeout_s``."""
        if not self._sub.poll(int(timeout_s * 1000)):
            return []
        topic, seq_b, payload = self._sub.recv_multipart()
        got = Received(topic.decode(), int.from_bytes(seq_b, "big"), DECODER.decode(payload))
        out: list[Received] = []
        if self.last is not None and got.seq > self.last + 1:
            out = [r for r in self.replay(self.last + 1, timeout_s) if r.seq < got.seq]
            self.missed += got.seq - self.last - 1 - len(out)
        self.last = got.seq
        return [*out, got]

    def replay(self, start: int, timeout_s: float = 5.0) -> list[Received]:
        """The batches from ``start`` on that the publisher still keeps ([] without a
        replay endpoint, or when it does not answer in ``timeout_s``)."""
        if self._replay is None:
            return []
        self._replay.send_multipart((b"", start.to_bytes(8, "big")))
        out: list[Received] = []
        end = time.monotonic() + timeout_s
        while self._replay.poll(max(0, int((end - time.monotonic()) * 1000))):
            _, topic, seq_b, payload = self._replay.recv_multipart()
            if seq_b == END_SEQ:
                return out
            out.append(
                Received(topic.decode(), int.from_bytes(seq_b, "big"), DECODER.decode(payload))
            )
        return out

    def close(self) -> None:
        for s in (self._sub, self._replay):
            if s is not None:
                s.close(linger=0)
        self._ctx.term()


def lines(r: Received) -> Iterator[str]:
    """One line an event of a received batch."""
    for ev in r.batch.events:
        if isinstance(ev, BlockStored):
            what = f"stored  {ev.medium or '-':7} {ev.ownership or '-'}"
            tail = f" tokens={len(ev.token_ids)}" if ev.token_ids else ""
        elif isinstance(ev, BlockRemoved):
            what, tail = f"removed {ev.medium or '-':7} {ev.ownership or '-'}", ""
        else:
            yield f"{r.seq} {r.topic} all blocks cleared"
            continue
        hashes = " ".join(_short(h) for h in ev.block_hashes[:4])
        more = f" (+{len(ev.block_hashes) - 4})" if len(ev.block_hashes) > 4 else ""
        yield f"{r.seq} {r.topic} {what} {len(ev.block_hashes)} block(s) {hashes}{more}{tail}"


def _short(h: bytes | int) -> str:
    return h.hex()[:16] if isinstance(h, bytes) else f"{h & (2**64 - 1):016x}"


def watch(
    sub: Subscriber, out: Callable[[str], None], *, count: int = 0, timeout_s: float = 0.0
) -> int:
    """Print events as they come until ``count`` events (0: no end) or ``timeout_s``
    without one (0: wait for ever); returns the events printed."""
    n = 0
    while count == 0 or n < count:
        got = sub.recv(timeout_s or 3600.0)
        if not got:
            if timeout_s:
                return n
            continue
        for r in got:
            for line in lines(r):
                out(line)
                n += 1
    return n
