"""What keeps a hostile client from holding the server's memory or its answers:
``let_go`` (an exception caught for good keeps no frames, so no request's buffer waits
for a garbage collection) and ``HelloFailures`` (failed CLIENT_HELLOs throttled per
peer address)."""

from __future__ import annotations

import time
import traceback
from collections import OrderedDict

_MAX_PEERS = 4096  # peer addresses whose failed hellos are counted
_MAX_HELD_BACK = 256  # failed hellos answered late at once


def let_go(e: BaseException) -> None:
    """Clear the finished frames of an exception caught for good, and of the ones it
    chains to: a frame left in a traceback would keep a request's buffers (a message
    half received, a put buffer's view) alive for as long as the exception object lives,
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
