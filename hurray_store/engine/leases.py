"""Leases (``Leases``): the pins a lookup takes for the get an engine makes after it (SGLang
asks ``batch_exists``, then gets what it was promised), so what a lookup counted is not
evicted in between. Each lease ends at the get of its object or after ``lease_s``,
whichever comes first: an engine that never gets what it asked about pins nothing for
long (docs/engine.md, "Exists means a get delivers")."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from hurray_store.store import Pin


class Leases:
    """Lookups' pins by object name until the get or ``lease_s``; ``release(pins)`` lets
    pins go (any thread). Thread-safe: engines ask and get from several threads."""

    def __init__(self, release: Callable[[Sequence[Pin]], None], lease_s: float) -> None:
        self.release, self.lease_s = release, lease_s
        # A lease is a one-item list holding its pin, emptied when it ends: the deque
        # (oldest first, for expiry) and the by-name lists share it.
        self._by_name: dict[str, list[list[Pin]]] = {}
        self._order: deque[tuple[float, str, list[Pin]]] = deque()
        self._lock = threading.Lock()
        self.expired = 0  # leases that ended unused (no get came in time)

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_name.values())

    def add(self, names: Sequence[str], pins: Sequence[Pin]) -> None:
        """``pins[i]`` keeps ``names[i]`` until its get or the lease's end."""
        end = time.monotonic() + self.lease_s
        with self._lock:
            for name, pin in zip(names, pins, strict=True):
                lease = [pin]
                self._by_name.setdefault(name, []).append(lease)
                self._order.append((end, name, lease))
        self.expire()

    def end(self, names: Iterable[str]) -> None:
        """The get of ``names`` came: their leases end."""
        out: list[Pin] = []
        with self._lock:
            for name in names:
                for lease in self._by_name.pop(name, ()):
                    out += lease
                    lease.clear()
        if out:
            self.release(out)

    def expire(self) -> None:
        """End the leases whose time is up."""
        now, out = time.monotonic(), []
        with self._lock:
            while self._order and self._order[0][0] <= now:
                _, name, lease = self._order.popleft()
                if not lease:  # ended by its get
                    continue
                out += lease
                lease.clear()
                left = [x for x in self._by_name.get(name, ()) if x]
                if left:
                    self._by_name[name] = left
                else:
                    self._by_name.pop(name, None)
        self.expired += len(out)
        if out:
            self.release(out)

    def close(self) -> None:
        """End every lease."""
        self.end(list(self._by_name))
