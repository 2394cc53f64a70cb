"""A ZMQ publisher of KV-event batches in vLLM's framing: a PUB socket sends ``[topic,
seq, payload]``, and an optional ROUTER socket answers a replay request (``[client, b"",
start seq]``) with every batch still kept from that number on, then ``[client, b"",
b"", -1, b""]``, as vLLM's ``ZmqEventPublisher`` does; a subscriber that saw a gap in the
sequence numbers asks it for what it missed.

``publish`` never blocks: batches wait in a bounded queue for the publisher's thread;
past ``max_waiting`` the oldest is dropped and counted. A PUB socket itself drops for a
subscriber that does not keep up (ZMQ's high-water mark), never holding the sender.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

import zmq

from hurray_store.events.wire import ENCODER, KVEventBatch
from hurray_store.throttle import Every

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
# What a peer may send the publisher's sockets (ZMQ_MAXMSGSIZE: a peer that sends a longer
# message part is disconnected before it is stored): a subscription is its topic behind
# ZMTP 3.1's SUBSCRIBE command name (10 bytes; 1 in ZMTP 3.0), and libzmq keeps a
# subscribed topic as a trie node per byte (a 64 MiB SUBSCRIBE grew a publisher by about
# 3 GiB); a replay request's frames are an empty delimiter and an 8-byte sequence number.
# The number of subscriptions is not bounded here: libzmq keeps each one (in XPUB's manual
# mode too, for the unsubscriptions it sends when the peer leaves), about 47 bytes a
# topic byte, and names no peer a publisher could cut off.
MAX_TOPIC_BYTES = 1024
MAX_REQUEST_BYTES = 64


class ZmqPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str = "",
        *,
        buffer_batches: int = 10_000,
        max_waiting: int = 1024,
    ) -> None:
        if buffer_batches < 1 or max_waiting < 1:
            raise ValueError("a publisher keeps at least one batch")
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.MAXMSGSIZE, MAX_TOPIC_BYTES + len(b"\x09SUBSCRIBE"))
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint = ""
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise OSError(f"KV events: cannot bind {endpoint or replay_endpoint}: {e}") from None
        self._kept: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer_batches)
        self._waiting: deque[tuple[bytes, KVEventBatch]] = deque()
        self._max_waiting = max_waiting
        self._cv = threading.Condition()
        self._seq = 0
        self._sending = False  # the thread holds batches taken from the queue
        self._closed = False
        self.dropped = 0  # batches dropped before they were sent
        self.sent = 0
        self.bad_requests = 0  # replay requests not of the form asked, ignored
        self._warn_replay = Every(60.0)
        self._thread = threading.Thread(target=self._run, name="hurray-kv-events", daemon=True)
        self._thread.start()

    def publish(self, topic: str, batch: KVEventBatch) -> None:
        """Queue ``batch`` under ``topic``; never blocks."""
        with self._cv:
            if self._closed:
                return
            if len(self._waiting) >= self._max_waiting:
                self._waiting.popleft()
                self.dropped += 1
            self._waiting.append((topic.encode(), batch))
            self._cv.notify()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued batch is sent; False on timeout."""
        end = time.monotonic() + timeout
        with self._cv:
            while self._waiting or self._sending:
                if not self._cv.wait(max(0.0, end - time.monotonic())):
                    return not (self._waiting or self._sending)
        return True

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5)
        self._close_sockets()

    def _close_sockets(self) -> None:
        # What was sent but is still in the PUB socket's queue gets half a second to
        # reach its subscribers (a closing engine's last batch).
        self._pub.close(linger=500)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            with self._cv:
                if not self._waiting and not self._closed:
                    self._cv.wait(0.05)
                batches = list(self._waiting)
                self._waiting.clear()
                self._sending = bool(batches)
                closed = self._closed
            try:
                self._send(batches)
                if self._replay is not None:
                    while poller.poll(0):
                        self._answer_replay()
            except zmq.ZMQError as e:  # a socket error ends no save: logged, retried
                log.warning("KV events: publishing failed: %s", e)
                time.sleep(0.1)
            finally:
                with self._cv:
                    self._sending = False
                    self._cv.notify_all()  # for flush
            if closed:
                return

    def _send(self, batches: Sequence[tuple[bytes, KVEventBatch]]) -> None:
        for topic, batch in batches:
            payload = ENCODER.encode(batch)
            seq = self._seq
            self._seq += 1
            self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            self._kept.append((seq, topic, payload))
            self.sent += 1

    def _answer_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            self.bad_requests += 1
            if self._warn_replay.due():
                log.warning(
                    "KV events: a replay request of %d frames ignored (%d in all)",
                    len(frames),
                    self.bad_requests,
                )
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, topic, payload in list(self._kept):
            if seq >= first:
                self._replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
