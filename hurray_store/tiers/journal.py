"""A disk folder's journal, one store's side of it: the lines it appends for the groups
it commits and removes, and the other stores' lines it has not read yet (docs/format.md,
"A disk folder"). The folder's locks, and which file is the journal, stay with the disk
tier (``tiers/disk.py``); this module reads and writes through the descriptors it is
handed.

A line is ``["<store id>", "+" or "-", "<key>"]``. The journal is read in pieces of
``_PIECE`` bytes; a line over ``LINE_LIMIT`` bytes, nested, not JSON or of another
shape is no store's: skipped, counted, and the lines after it are read.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence

from hurray_store.throttle import Every

log = logging.getLogger(__name__)

# The journal is read in pieces of this many bytes, and a line longer than this is not
# a store's (a key's file name is at most MAX_NAME_BYTES of tiers/files.py; its line,
# JSON-escaped, a few times that): skipped unparsed, so a line of 256 MiB costs one
# pass, not one a call.
_PIECE = 1 << 20
LINE_LIMIT = 4096
_BAD_LINE_EVERY_S = 60.0  # a warning about bad lines at most this often


class Journal:
    """What one store has read of a journal (``seen`` bytes), and its own id."""

    def __init__(self, tier: str, path: os.PathLike[str] | str) -> None:
        self.tier = tier
        self.path = path
        self.me = os.urandom(6).hex()  # this store's lines, skipped when read back
        self.seen = 0  # bytes read
        self.skipping = False  # in the middle of an overlong line
        self.bad_lines = 0
        self._bad_line_warn = Every(_BAD_LINE_EVERY_S)

    def restart(self, at: int = 0) -> None:
        """Read from ``at`` on (another file at the path, or one emptied)."""
        self.seen, self.skipping = at, False

    def append(self, fd: int, added: Sequence[str], removed: Sequence[str]) -> None:
        """This store's lines, with one ``O_APPEND`` write to ``fd``."""
        lines = [json.dumps([self.me, "+", k]) for k in added]
        lines += [json.dumps([self.me, "-", k]) for k in removed]
        # A newline first: a line left without one (a writer killed mid-write, or a
        # hostile one) ends there, so these lines are not glued to it and lost.
        data = ("\n" + "\n".join(lines) + "\n").encode()
        try:
            n = os.write(fd, data)
            # An append leaves the offset at the end of what it wrote. Right after all
            # that was read, nothing unread lies before these lines: count them read,
            # so the next read does not read this store's own lines back.
            end = os.lseek(fd, 0, os.SEEK_CUR)
            if n == len(data) and end - n == self.seen and not self.skipping:
                self.seen = end
        except OSError as e:
            log.warning("disk tier %s: journal write failed: %s", self.tier, e)

    def read(self, fd: int) -> list[tuple[bool, str]]:
        """The other stores' lines after ``seen`` in the journal open as ``fd``:
        (added?, key) each."""
        out: list[tuple[bool, str]] = []
        try:
            size = os.fstat(fd).st_size
            if size < self.seen:  # emptied by hand: read it again from the start
                self.restart()
            while self.seen < size:
                data = os.pread(fd, min(_PIECE, size - self.seen), self.seen)
                last = len(data) < _PIECE  # read up to the end
                if not data:
                    break
                start = 0
                if self.skipping:  # the rest of an overlong line: up to its newline
                    nl = data.find(b"\n")
                    if nl < 0:
                        self.seen += len(data)
                        continue
                    start, self.skipping = nl + 1, False
                end = data.rfind(b"\n") + 1
                if end > start:
                    for line in data[start : end - 1].split(b"\n"):
                        self._parse(line, out)
                else:
                    end = start
                self.seen += end
                if len(data) - end > LINE_LIMIT:  # no store writes a line this long
                    self._bad_line()
                    self.skipping = True
                    self.seen += len(data) - end
                elif last:
                    break  # a line being appended now is read next time
        except OSError as e:
            log.warning("disk tier %s: journal read failed: %s", self.tier, e)
        return out

    def _parse(self, line: bytes, out: list[tuple[bool, str]]) -> None:
        if not line:
            return  # the newline a store writes before its lines
        if len(line) > LINE_LIMIT or not line.startswith(b'["'):
            self._bad_line()
            return
        try:
            got = json.loads(line)
        except (ValueError, RecursionError):
            self._bad_line()
            return
        if not (
            isinstance(got, list)
            and len(got) == 3
            and all(isinstance(x, str) for x in got)
            and got[1] in ("+", "-")
        ):
            self._bad_line()
            return
        who, op, key = got
        if who != self.me:
            out.append((op == "+", key))

    def _bad_line(self) -> None:
        """Count a line no store wrote; warn at most once a minute."""
        self.bad_lines += 1
        if self._bad_line_warn.due():
            log.warning(
                "disk tier %s: %d lines of %s are not a store's (too long, too deep or not "
                "JSON) and were skipped: something else writes to the folder",
                self.tier,
                self.bad_lines,
                self.path,
            )
