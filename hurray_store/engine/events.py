"""What the store committed and lost, as an engine sees it: one ``StoreEvent`` per page
or chunk object (or segment) that became readable in a tier or stopped being, with the
tier and the reason, kept in a bounded feed (``EventFeed``) that the port's
``take_events`` drains. A consumer that never drains loses the oldest events, counted
in ``dropped``, never memory. docs/engine.md says what each reason means."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from hurray_store.keys import ObjectKey, SegmentKey

EVENTS_KEPT = 65536  # events a feed keeps until they are taken


@dataclass(frozen=True, slots=True)
class StoreEvent:
    """``kind`` ``stored`` (readable in ``tier`` from now) or ``removed`` (no longer);
    ``name`` the object's name as the engine gave it (a segment: ``segment:<hex>``);
    ``reason`` why (``write``, ``found``, ``evict``, ``rejected``, ...:
    ``metrics.MOVE_REASONS``); ``seq`` counts the feed's events from 1."""

    kind: str
    tier: str
    name: str
    reason: str
    seq: int
    time: float


class EventFeed:
    """The events of one namespace's objects and segments, at most ``kept`` of them
    waiting; ``note`` is a ``TieredStore.watch`` watcher."""

    def __init__(self, namespace: str, kept: int = EVENTS_KEPT) -> None:
        if kept < 1:
            raise ValueError(f"an event feed keeps at least one event, not {kept}")
        self.namespace = namespace
        self._events: deque[StoreEvent] = deque(maxlen=kept)
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self.dropped = 0  # events lost because none took them in time

    def note(self, kind: str, tier: str, group: Any, reason: str) -> None:
        if group.__class__ is ObjectKey:
            if group.namespace != self.namespace:
                return
            name = group.name
        elif isinstance(group, SegmentKey) and group.namespace == self.namespace:
            name = f"segment:{group.hex}"
        else:
            return  # a member list, another namespace's object
        ev = StoreEvent(kind, tier, name, reason, next(self._seq), time.time())
        with self._lock:
            if len(self._events) == self._events.maxlen:
                self.dropped += 1
            self._events.append(ev)

    def take(self) -> list[StoreEvent]:
        """Every event noted since the last call, oldest first."""
        with self._lock:
            out = list(self._events)
            self._events.clear()
        return out
