"""The change log several stores keep under one S3 prefix, without I/O: how an entry is
named, read back and forgotten (``tiers/s3.py`` lists and writes them).

An entry is an empty object whose name says everything, so one LIST reads a batch of
changes and no GET is needed::

    <prefix>/log/<ms since the epoch, 13 digits>-<writer>-<seq, 8 digits>-<a|r>-<key hex>

``a``: the writer committed the group whose last key this is; ``r``: it removed the
group holding this key. Names sort by time. A reader lists from ``window_s`` before the
newest entry it has seen (entries a writer with a slower clock, or a slower upload,
landed late still come by) and drops the ones it has seen already.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

_MAX_NAME = 1024  # S3's longest key


class ChangeFeed:
    """One store's side of the change log: names for its own entries, and what it read
    of the others' (``take``)."""

    def __init__(
        self, writer: str, window_s: float = 60.0, now: Callable[[], float] = time.time
    ) -> None:
        self.writer = writer
        self.window_ms = int(window_s * 1000)
        self.now = now
        self.seq = 0
        self.newest = self._ms() - self.window_ms  # a store reads from its open on
        self.seen: dict[str, int] = {}  # entry name -> its time, within the window
        self.pending: list[tuple[bool, str]] = []  # read, not yet taken
        self.bad = 0  # names that did not parse (skipped)

    def _ms(self) -> int:
        return int(self.now() * 1000)

    def names(self, added: Sequence[str] = (), removed: Sequence[str] = ()) -> list[str]:
        """The entries announcing these changes of this writer."""
        ts = self._ms()
        out = []
        for flag, keys in (("a", added), ("r", removed)):
            for key in keys:
                self.seq += 1
                out.append(f"{ts:013d}-{self.writer}-{self.seq:08d}-{flag}-{key.encode().hex()}")
        return out

    def offset(self) -> str:
        """List the log from after this name on."""
        return f"{max(0, self.newest - self.window_ms):013d}"

    def add(self, name: str) -> None:
        """An entry the listing found (its name under ``log/``)."""
        if name in self.seen:
            return
        parsed = parse(name)
        if parsed is None:
            self.bad += 1
            return
        ts, writer, added, key = parsed
        self.seen[name] = ts
        self.newest = max(self.newest, ts)
        if writer != self.writer:
            self.pending.append((added, key))

    def forget_old(self) -> None:
        """Drop the names seen before the window: a listing no longer returns them."""
        edge = self.newest - self.window_ms
        self.seen = {n: ts for n, ts in self.seen.items() if ts >= edge}

    def take(self) -> list[tuple[bool, str]]:
        out, self.pending = self.pending, []
        return out


def parse(name: str) -> tuple[int, str, bool, str] | None:
    """(time ms, writer, added, key) of an entry's name; None when it is not one."""
    if len(name) > _MAX_NAME:
        return None
    parts = name.split("-", 4)
    if len(parts) != 5:
        return None
    ts, writer, seq, flag, hexkey = parts
    if not (len(ts) == 13 and ts.isdigit() and seq.isdigit() and flag in ("a", "r") and writer):
        return None
    try:
        key = bytes.fromhex(hexkey).decode()
    except (ValueError, UnicodeDecodeError):
        return None
    if not key:
        return None
    return int(ts), writer, flag == "a", key


def entry_time_ms(name: str) -> int | None:
    """The time an entry's name carries, None when it carries none."""
    ts = name[:13]
    return int(ts) if len(ts) == 13 and ts.isdigit() else None
