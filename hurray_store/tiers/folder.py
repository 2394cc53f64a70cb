"""A disk folder several stores open at once: the locks each holds on it, whether a
store is alone on it, and the journal that tells each what the others committed and
removed (docs/format.md, "A disk folder").

Each store holds a shared ``flock`` on three things: the lock file, the journal and the
objects folder. A store is alone only when it gets all three exclusively at open (then
the journal starts empty and the restart scan may delete every uncommitted object): a
lock file or journal deleted or replaced by hand leaves the others' locks on the other
two, so a newcomer is never wrongly alone, and each store then holds the new file
(``rejoin``). An open that cannot get a shared lock within ``LOCK_WAIT_S`` fails and
says so. The lines themselves are ``tiers/journal.py``'s.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

from hurray_store.tiers.files import open_object, open_regular
from hurray_store.tiers.journal import Journal

log = logging.getLogger(__name__)

# A committed group's objects are all published within seconds of each other: an object
# of an uncommitted one this old has no live writer.
ORPHAN_AGE_S = 600.0
# The longest an open waits for a shared lock on the folder (a store holds it
# exclusively only while it opens).
LOCK_WAIT_S = 30.0
# How often a store checks that the lock file at its path is still the one it holds.
LOCK_CHECK_S = 1.0


def try_lock(fd: int, how: int) -> bool:
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def open_locked_file(path: Path, flags: int) -> int:
    """The folder's lock file or journal, made if absent."""
    said = f"{path} is not a regular file: remove it, and a store makes it again"
    return open_regular(path, flags | os.O_CREAT, said)


class SharedFolder:
    """One store's hold on a disk folder (``root``, its objects under ``objects``) and
    its side of the folder's journal."""

    def __init__(self, tier: str, root: Path, objects: Path) -> None:
        self.tier, self.root, self.objects = tier, root, objects
        self.alone = True  # no other store had the folder open when this one opened it
        self.lock_fd: int | None = None
        self.journal_fd: int | None = None
        self.objects_fd: int | None = None
        self._lock_ino = self._journal_ino = 0
        self._lock_checked_at = 0.0
        self._lock_moved = False
        self.journal_path = root / "journal"
        self.journal = Journal(tier, self.journal_path)  # what this store read of it

    @property
    def joined(self) -> bool:
        return self.lock_fd is not None

    def join(self) -> None:
        """Take this store's locks on the folder (blocking: run off the loop). A lock
        held exclusively by another program is waited for at most ``LOCK_WAIT_S``, then
        the open fails and says so."""
        fd = open_locked_file(self.root / "lock", os.O_RDWR)
        jfd = dfd = None
        try:
            self.alone = try_lock(fd, fcntl.LOCK_EX)
            jfd = open_locked_file(self.journal_path, os.O_WRONLY | os.O_APPEND)
            dfd = os.open(self.objects, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            if self.alone:
                self.alone = try_lock(jfd, fcntl.LOCK_EX) and try_lock(dfd, fcntl.LOCK_EX)
            if self.alone:
                os.ftruncate(jfd, 0)
            # The journal and the folder first, the lock file last: while this store
            # holds the lock file exclusively no newcomer gets past it, and when it
            # does, it finds the other two held.
            for held in (jfd, dfd, fd):
                self._wait_shared(held)
        except BaseException:
            for f in (fd, jfd, dfd):
                if f is not None:
                    os.close(f)
            raise
        self.lock_fd, self.journal_fd, self.objects_fd = fd, jfd, dfd
        self._lock_ino = os.fstat(fd).st_ino
        self._journal_ino = os.fstat(jfd).st_ino
        self._lock_checked_at = time.monotonic()
        self.journal.restart(os.fstat(jfd).st_size)  # before the restart scan: none missed
        if not self.alone:
            log.info("disk tier %s: %s is open in another process too", self.tier, self.root)

    def _wait_shared(self, fd: int) -> None:
        """A shared lock on ``fd``, waited for while a newcomer holds it exclusively (for
        as long as its open takes), at most ``LOCK_WAIT_S``."""
        deadline = time.monotonic() + LOCK_WAIT_S
        while not try_lock(fd, fcntl.LOCK_SH):
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    errno.ETIMEDOUT,
                    f"disk tier {self.tier}: {self.root} has been locked exclusively for "
                    f"{LOCK_WAIT_S:g} s by something that is not a store opening it (a store "
                    "holds it so for well under a second): find the program that holds "
                    f"{self.root}/lock, its journal or objects folder (fuser -v) and stop it",
                )
            time.sleep(0.01)

    def rejoin(self) -> None:
        """The lock file or the journal at their paths are not the ones this store
        holds (deleted or replaced by hand, or by a store that then believed it was
        alone): hold the ones there now, and read the journal there from its start."""
        if self.lock_fd is None or self.journal_fd is None:
            return
        self._lock_moved = False  # until the next check
        for which in ("lock", "journal"):
            path = self.root / "lock" if which == "lock" else self.journal_path
            held = self.lock_fd if which == "lock" else self.journal_fd
            ino = self._lock_ino if which == "lock" else self._journal_ino
            try:
                if os.stat(path).st_ino == ino:
                    continue
            except FileNotFoundError:
                pass
            flags = os.O_RDWR if which == "lock" else os.O_WRONLY | os.O_APPEND
            try:
                fd = open_locked_file(path, flags)
            except OSError as e:
                log.warning("disk tier %s: %s could not be opened again: %s", self.tier, path, e)
                continue
            if not try_lock(fd, fcntl.LOCK_SH):
                os.close(fd)  # a newcomer holds it for its open: again next time
                continue
            log.warning(
                "disk tier %s: %s was deleted or replaced while this store held it; "
                "holding the new one%s",
                self.tier,
                path,
                " and reading it from its start" if which == "journal" else "",
            )
            os.close(held)
            if which == "lock":
                self.lock_fd, self._lock_ino = fd, os.fstat(fd).st_ino
            else:
                self.journal_fd, self._journal_ino = fd, os.fstat(fd).st_ino
                self.journal.restart()
            self.alone = False

    def close(self) -> None:
        for fd in (self.journal_fd, self.objects_fd, self.lock_fd):
            if fd is not None:
                os.close(fd)
        self.journal_fd = self.objects_fd = self.lock_fd = None

    # ------------------------------------------------------------------ the journal

    def log_changes(self, added: Sequence[str] = (), removed: Sequence[str] = ()) -> None:
        """This store's lines: the groups it committed (their last keys) and removed."""
        if self.journal_fd is not None and (added or removed):
            self.journal.append(self.journal_fd, added, removed)

    def changes(self) -> list[tuple[bool, str]]:
        """The other stores' lines not read before: (added?, key) each (a line that is
        not a store's is skipped with a warning, and the lines after it are read)."""
        news, moved = self._journal_news()
        if not news:
            return []  # one stat: nothing new (or no journal there)
        if moved:
            self.rejoin()  # other files at the paths: held, the journal read from 0
        try:
            fd = open_object(self.journal_path)
        except OSError:
            return []
        try:
            return self.journal.read(fd)
        finally:
            os.close(fd)

    def _check_lock(self) -> None:
        """At most once every LOCK_CHECK_S, whether the lock file at its path is still
        the one this store holds (``_lock_moved``). From any thread."""
        now = time.monotonic()
        if now - self._lock_checked_at >= LOCK_CHECK_S:
            self._lock_checked_at = now
            try:
                self._lock_moved = os.stat(self.root / "lock").st_ino != self._lock_ino
            except OSError:
                self._lock_moved = True

    def _journal_news(self) -> tuple[bool, bool]:
        """(anything to read, other files at the paths), from one ``stat`` of the
        journal's path (and the lock check); nothing when no journal lies there."""
        if self.journal_fd is None:
            return False, False
        self._check_lock()
        try:
            st = os.stat(self.journal_path)
        except OSError:
            return False, False
        moved = self._lock_moved or st.st_ino != self._journal_ino
        return moved or st.st_size != self.journal.seen, moved

    def has_changes(self) -> bool:
        """Whether ``changes`` has lines to read: one ``stat`` of the journal's path
        (another size, or another file there), the lock file's path checked at most once
        every LOCK_CHECK_S. From any thread, with no effect: ``changes``, on the store's
        loop, holds the new files (``rejoin``) and reads the new journal from its start."""
        return self._journal_news()[0]
