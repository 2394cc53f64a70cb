"""``Every``: a warning repeated for many events (pages not stored, late calls, a folder's
bad lines, a failing store) logged at most once per interval, never once per event."""

from __future__ import annotations

import time


class Every:
    """``due()`` is true at most once per ``seconds`` (the first call always)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._at = float("-inf")

    def due(self) -> bool:
        now = time.monotonic()
        if now - self._at < self.seconds:
            return False
        self._at = now
        return True
