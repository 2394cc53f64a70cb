"""The ``disk`` tier: one file per object under a root folder.

::

    <path>/objects/<2 hex of xxh3(key)>/<key, %-quoted>     published objects
    <path>/objects/<..>/.tmp.<pid>.<n>.<name>              writes in progress
    <path>/quarantine/<name>.<unix time>                   objects that failed verification
    <path>/lock                                            held (flock) by every store open on it
    <path>/journal                                         what each store added and removed

A write goes to a temp file in the object's own folder, optionally fsyncs it, and is
published by ``os.replace`` (atomic on POSIX), then the folder is fsynced when
``fsync`` is on. Readers never see a partial object. I/O goes in pieces of at most
8 MiB per system call (see ``_IO_CHUNK``); a write gathers an object's buffers into
those pieces (``writev``). ``open`` removes temp files a killed process left behind.
Each operation is one trip to a thread pool of the tier's own (``aiofiles.os.wrap``):
writes to one of ``write_threads`` threads, by default one fewer than the machine's
cores (with ``fsync``, the CPU count + 4, as Python's default pool), everything else to
one of the CPU count + 4; about 80 us a trip, so never one trip per page.

Several processes may open one folder at once (vLLM's scheduler and workers, several
engines on a host). Each holds a shared ``flock`` on ``lock``, on ``journal`` and on
the ``objects`` folder; a store that gets all three exclusively at open is alone, and
only then empties the journal and lets the restart scan delete every uncommitted
object; otherwise only those older than ``ORPHAN_AGE_S`` (no live writer takes that
long between a segment's first object and its manifest). A lock file or journal
deleted or replaced by hand is noticed by inode: a newcomer still finds the others'
locks on the rest, and each store holds the new file (``_rejoin``). An open that
cannot get a shared lock within ``LOCK_WAIT_S`` fails and says so. Each store appends
a line to ``journal`` per group it commits (its last key) and per group it removes,
with one ``O_APPEND`` write; the others read the lines they have not seen before each
operation (one ``stat`` when there are none), so each finds the others' segments and
forgets what they evicted. A journal line no store wrote (too long, too deep, not
JSON) is skipped and counted, and the lines after it are read.

Nothing in the folder is opened so that it could block or follow a link: a FIFO, a
folder, a device or a symlink where an object should be is a miss for that object.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import itertools
import logging
import os
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, unquote

import aiofiles.os
import xxhash

from hurray_store.config import DiskTierConfig
from hurray_store.format import checksum
from hurray_store.tiers.base import (
    Blob,
    Buffer,
    Capabilities,
    GroupObject,
    NowRead,
    Range,
    RangeIn,
    ReadInto,
    SealedObject,
    Tier,
    check_into,
    shared_run,
    wants_sums,
)
from hurray_store.tiers.journal import Journal

log = logging.getLogger(__name__)
T = TypeVar("T")
_TMP = ".tmp."  # then the writer's pid: ".tmp.<pid>.<n>.<name>"


def _writer_alive(tmp_name: str) -> bool:
    """Whether the process that is writing a temp file still runs (its pid is in the
    name). Another process on the same folder keeps its files being written."""
    try:
        pid = int(tmp_name[len(_TMP) :].split(".", 1)[0])
    except ValueError:
        return False
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True


_IO_CHUNK = 8 << 20
_IOV_MAX = 512  # views per writev (Linux takes 1024)
_GATHER = 1 << 20  # buffers this large are written alone
_counter = itertools.count()
# A read on the caller's thread (``read_into_now``) of this many bytes or more, in more
# than one range, shares its ranges with helper threads: page-cache copies (and the
# caller's hashing) then run on every core. It opens at most _OPEN_AT_ONCE files at once.
_SPLIT_BYTES = 1 << 20
_HELPERS = max(1, (os.cpu_count() or 2) - 1)
# The tier's threads: reads and the rest on a pool as large as Python's default one;
# writes by default on one thread fewer than the cores, so that one core is left to the
# engine's thread (on 2 cores, 6 writers cut an engine thread beside them to a fifth).
# With fsync they mostly wait on the device, so as many as for reads.
_POOL_THREADS = min(32, (os.cpu_count() or 1) + 4)
_DEFAULT_WRITERS = max(1, (os.cpu_count() or 2) - 1)
_OPEN_AT_ONCE = 64


def _pieces(buffers: Iterable[Buffer], most: int = _IO_CHUNK) -> Iterator[list[memoryview]]:
    """The bytes of ``buffers`` in order, in lists of views: one ``writev`` each. Runs of
    buffers under ``_GATHER`` bytes are gathered up to the next multiple of ``most``
    bytes in the file (or ``_IOV_MAX`` views), the buffer that crosses it cut there, so
    an object of many small buffers (a chunk's descriptors and pools) costs a system
    call, and a hand-over of the GIL, per ``most`` bytes (8 MiB unless the caller asks
    for less) rather than per buffer. A larger buffer goes alone, in pieces of at most
    ``_IO_CHUNK``: gathered with the small ones beside it, 2 MiB values took 7-8 ms a
    ``writev`` here against 2 ms in plain writes.

    Writes that start and end on those multiples leave the file in the page cache in
    large blocks (folios), and it reads back faster: the plugin's chunk files (a
    descriptor of 205 bytes before each 512 KiB pool), each pool read and hashed as a
    get does, 598-619 us a file against 645-673 when each list ended at the buffer
    that filled it (five runs of a throwaway script, 32 files, medians of 9 rounds).

    A list is handed out as soon as it is full, before the next buffer is taken: taking
    a sealed object's buffer hashes it (``SealedObject.written``), and a buffer hashed
    a list ahead of its write has left the CPU's cache by then (but for the part of a
    cut one that goes in the next list). The plugin's chunks go out in lists of 1 MiB,
    each pool hashed just before. Written straight from their sealed objects by 2
    threads, the two ways alternating round by round in one process: 3.49-4.16 GB/s
    against 3.34-3.86 when each pool was hashed a list ahead (medians of 6 processes,
    faster in each)."""
    views: list[memoryview] = []
    pos = 0  # where the next byte goes in the file
    for b in buffers:
        mv = memoryview(b).cast("B")
        if not len(mv):
            continue
        if len(mv) >= _GATHER:
            if views:
                yield views
                views = []
            for at in range(0, len(mv), _IO_CHUNK):
                yield [mv[at : at + _IO_CHUNK]]
            pos += len(mv)
            continue
        room = most - pos % most
        if len(mv) >= room:  # the list ends on the multiple; the rest starts the next
            views.append(mv[:room])
            pos += room
            yield views
            views, mv = [], mv[room:]
            if not len(mv):
                continue
        views.append(mv)
        pos += len(mv)
        if len(views) == _IOV_MAX:
            yield views
            views = []
    if views:
        yield views


def _pread_into(fd: int, view: memoryview, offset: int) -> bool:
    """Fill ``view`` from ``offset`` of ``fd``; False: the file ends first."""
    done, ln = 0, len(view)
    while done < ln:
        n = os.preadv(fd, [view[done : done + _IO_CHUNK]], offset + done)
        if n <= 0:
            return False
        done += n
    return True


class _RangeReads:
    """The ranges of one ``read_into_now``, taken one at a time by whichever thread is
    free (the caller and the helpers), so a busy helper never holds the caller up."""

    def __init__(
        self,
        reads: Sequence[NowRead],
        fds: dict[int, int],
        ok: list[bool],
        each: RangeIn | None,
    ) -> None:
        self.reads, self.fds, self.ok, self.each = reads, fds, ok, each
        self.sums = wants_sums(each)
        self.work = [(j, i) for j in fds if ok[j] for i in range(len(reads[j].ranges))]
        self._next = itertools.count()  # next() on it is atomic under the GIL

    def run(self) -> None:
        while (k := next(self._next)) < len(self.work):
            j, i = self.work[k]
            if not self.ok[j]:
                continue  # a range of it came up short: the read is a miss already
            r = self.reads[j]
            if not _pread_into(self.fds[j], r.buffers[i], r.ranges[i][0]):
                self.ok[j] = False  # the file is shorter than the ranges say
            elif self.each is not None:
                # Right after its read, while in the CPU's cache: one whole range (a
                # chunk's pool) at once, since smaller read steps cost more calls than
                # the cache saves.
                self.each(j, i, checksum(r.buffers[i]) if self.sums else 0)


# File names stay under the usual 255-byte limit with room for the temp prefix.
MAX_NAME_BYTES = 230


# A committed group's objects are all published within seconds of each other: an object
# of an uncommitted one this old has no live writer.
ORPHAN_AGE_S = 600.0


class KeyTooLongError(FileNotFoundError):
    """A key too long to be a file name: this tier cannot hold it."""


class NotAnObjectError(FileNotFoundError):
    """Something other than a regular file (a FIFO, a folder, a symlink, a device) lies
    where an object or the journal should be: put there by hand or by a co-tenant of
    the folder, never by a store. It is a miss, as an absent file is."""


# No open of the folder's files blocks or follows a link: a FIFO opened for reading
# without O_NONBLOCK waits for a writer forever; a symlink may point anywhere.


_NOT_A_FILE = (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP)


def _open_regular(path: Path | str, flags: int, said: str, mode: int = 0o644) -> int:
    """A descriptor of the regular file at ``path``, opened with ``flags`` without
    blocking or following a link; NotAnObjectError(``said``) when something else lies
    there (a symlink, even to a file, included)."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno in _NOT_A_FILE:
            raise NotAnObjectError(e.errno, said) from None
        raise
    try:
        is_file = stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        os.close(fd)
        raise
    if not is_file:
        os.close(fd)
        raise NotAnObjectError(errno.EINVAL, said)
    return fd


def _open_object(path: Path | str) -> int:
    """A read-only descriptor of the object file at ``path``."""
    return _open_regular(path, os.O_RDONLY, f"not a regular file: {path}")


def _is_object(path: Path) -> bool:
    """Whether a regular file (not a link to one) lies at ``path``."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


# The longest an open waits for a shared lock on the folder (a store holds it
# exclusively only while it opens).
LOCK_WAIT_S = 30.0
# How often a store checks that the lock file at its path is still the one it holds.
LOCK_CHECK_S = 1.0


def _try_lock(fd: int, how: int) -> bool:
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _open_locked_file(path: Path, flags: int) -> int:
    """The folder's lock file or journal, made if absent."""
    said = f"{path} is not a regular file: remove it, and a store makes it again"
    return _open_regular(path, flags | os.O_CREAT, said)


@functools.lru_cache(maxsize=8192)
def _object_path(objects: Path, key: str) -> Path:
    """``DiskTier.path_of``, kept made for the last few thousand keys."""
    name = quote(key, safe="")
    if len(name.encode()) > MAX_NAME_BYTES:
        raise KeyTooLongError(
            errno.ENAMETOOLONG,
            f"the key's file name takes {len(name.encode())} bytes, at most {MAX_NAME_BYTES}",
        )
    shard = f"{xxhash.xxh3_64_intdigest(key.encode()) & 0xFF:02x}"
    return objects / shard / name


class DiskTier(Tier):
    config_cls = DiskTierConfig
    # reads_now: every write is a temp file renamed over the key, never in place.
    caps = Capabilities(persistent=True, journaled=True, reads_now=True)

    def __init__(self, cfg: DiskTierConfig, namespace: str | None = None) -> None:
        super().__init__(cfg, namespace)
        self.root = Path(cfg.path)
        self.objects = self.root / "objects"
        self.quarantine_dir = self.root / "quarantine"
        self.fsync = cfg.fsync
        # Writes go out on a pool of write_threads (by default one core is left to the
        # engine's thread); reads and the rest on a pool as large as Python's default
        # one; the help a read on the caller's thread gets, on threads of its own (from
        # the shared pool, whose thread idle longest takes the work, the helper often
        # began only once the caller had read nearly the whole chunk: docs/benchmarks.md).
        self.write_threads = cfg.write_threads or (_POOL_THREADS if cfg.fsync else _DEFAULT_WRITERS)
        self._writers: ThreadPoolExecutor | None = ThreadPoolExecutor(
            self.write_threads, f"hurray-disk-{self.name}-w"
        )
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            _POOL_THREADS, f"hurray-disk-{self.name}"
        )
        self._helpers: ThreadPoolExecutor | None = ThreadPoolExecutor(
            min(_HELPERS, _POOL_THREADS), f"hurray-disk-{self.name}-h"
        )
        self._put = self._off(self._put_sync, self._writers)
        self._read = self._off(self._read_sync)
        self._ranges = self._off(self._ranges_sync)
        self._scan = self._off(self._scan_sync)
        self._read_many = self._off(self._read_many_sync)
        self.alone = True  # no other store had the folder open when this one opened it
        self._made: set[Path] = set()  # shard folders this tier has seen exist
        self._lock_fd: int | None = None
        self._journal_fd: int | None = None
        self._objects_fd: int | None = None
        self._lock_ino = self._journal_ino = 0
        self._lock_checked_at = 0.0
        self._lock_moved = False
        self._journal_path = self.root / "journal"
        self.journal = Journal(self.name, self._journal_path)  # what this store read of it

    def _off(
        self, fn: Callable[..., T], pool: ThreadPoolExecutor | None = None
    ) -> Callable[..., Awaitable[T]]:
        """``fn`` as a coroutine function run on ``pool`` (aiofiles' wrap), by default
        the tier's pool for reads and the rest."""
        return functools.partial(aiofiles.os.wrap(fn), executor=pool or self._pool)

    def path_of(self, key: str) -> Path:
        """Where ``key`` lives. A key whose file name would pass the file system's limit
        has none (KeyTooLongError, a FileNotFoundError): reads of it miss, writes of it
        are skipped with a warning. Kept for the last few thousand keys (an engine
        reads what it wrote: making a path took 14 us of a 620 us get here)."""
        return _object_path(self.objects, key)

    async def open(self) -> None:
        await self._off(os.makedirs)(self.objects, exist_ok=True)
        await self._off(os.makedirs)(self.quarantine_dir, exist_ok=True)
        if self._lock_fd is None:
            await self._off(self._share_sync)()

    def _share_sync(self) -> None:
        """Join the stores using the folder. Each holds a shared ``flock`` on three
        things: the lock file, the journal and the objects folder. A store is alone only
        when it gets all three exclusively (then the journal starts empty and the
        restart scan may sweep every uncommitted object): a lock file or journal deleted
        or replaced by hand leaves the others' locks on the other two, so a newcomer is
        never wrongly alone. A lock held exclusively by another program is waited for at
        most ``LOCK_WAIT_S``, then the open fails and says so."""
        fd = _open_locked_file(self.root / "lock", os.O_RDWR)
        jfd = dfd = None
        try:
            self.alone = _try_lock(fd, fcntl.LOCK_EX)
            jfd = _open_locked_file(self._journal_path, os.O_WRONLY | os.O_APPEND)
            dfd = os.open(self.objects, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            if self.alone:
                self.alone = _try_lock(jfd, fcntl.LOCK_EX) and _try_lock(dfd, fcntl.LOCK_EX)
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
        self._lock_fd, self._journal_fd, self._objects_fd = fd, jfd, dfd
        self._lock_ino = os.fstat(fd).st_ino
        self._journal_ino = os.fstat(jfd).st_ino
        self._lock_checked_at = time.monotonic()
        self.journal.restart(os.fstat(jfd).st_size)  # before the restart scan: none missed
        if not self.alone:
            log.info("disk tier %s: %s is open in another process too", self.name, self.root)

    def _wait_shared(self, fd: int) -> None:
        """A shared lock on ``fd``, waited for while a newcomer holds it exclusively (for
        as long as its open takes), at most ``LOCK_WAIT_S``."""
        deadline = time.monotonic() + LOCK_WAIT_S
        while not _try_lock(fd, fcntl.LOCK_SH):
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    errno.ETIMEDOUT,
                    f"disk tier {self.name}: {self.root} has been locked exclusively for "
                    f"{LOCK_WAIT_S:g} s by something that is not a store opening it (a store "
                    "holds it so for well under a second): find the program that holds "
                    f"{self.root}/lock, its journal or objects folder (fuser -v) and stop it",
                )
            time.sleep(0.01)

    def _rejoin(self) -> None:
        """The lock file or the journal at their paths are not the ones this store
        holds (deleted or replaced by hand, or by a store that then believed it was
        alone): hold the ones there now, and read the journal there from its start."""
        if self._lock_fd is None or self._journal_fd is None:
            return
        self._lock_moved = False  # until the next check
        for which in ("lock", "journal"):
            path = self.root / "lock" if which == "lock" else self._journal_path
            held = self._lock_fd if which == "lock" else self._journal_fd
            ino = self._lock_ino if which == "lock" else self._journal_ino
            try:
                if os.stat(path).st_ino == ino:
                    continue
            except FileNotFoundError:
                pass
            flags = os.O_RDWR if which == "lock" else os.O_WRONLY | os.O_APPEND
            try:
                fd = _open_locked_file(path, flags)
            except OSError as e:
                log.warning("disk tier %s: %s could not be opened again: %s", self.name, path, e)
                continue
            if not _try_lock(fd, fcntl.LOCK_SH):
                os.close(fd)  # a newcomer holds it for its open: again next time
                continue
            log.warning(
                "disk tier %s: %s was deleted or replaced while this store held it; "
                "holding the new one%s",
                self.name,
                path,
                " and reading it from its start" if which == "journal" else "",
            )
            os.close(held)
            if which == "lock":
                self._lock_fd, self._lock_ino = fd, os.fstat(fd).st_ino
            else:
                self._journal_fd, self._journal_ino = fd, os.fstat(fd).st_ino
                self.journal.restart()
            self.alone = False

    async def close(self) -> None:
        for pool in (self._writers, self._pool, self._helpers):
            if pool is not None:
                pool.shutdown(wait=True)
        self._writers = self._pool = self._helpers = None
        for fd in (self._journal_fd, self._objects_fd, self._lock_fd):
            if fd is not None:
                os.close(fd)
        self._journal_fd = self._objects_fd = self._lock_fd = None

    # ------------------------------------------------------------------ other processes

    def announce(self, added: Sequence[str] = (), removed: Sequence[str] = ()) -> None:
        if self._journal_fd is not None and (added or removed):
            self.journal.append(self._journal_fd, added, removed)

    def changes(self) -> list[tuple[bool, str]]:
        """The other stores' lines not read before: (added?, key) each (a line that is
        not a store's is skipped with a warning, and the lines after it are read)."""
        news, moved = self._journal_news()
        if not news:
            return []  # one stat: nothing new (or no journal there)
        if moved:
            self._rejoin()  # other files at the paths: held, the journal read from 0
        try:
            fd = _open_object(self._journal_path)
        except OSError:
            return []
        try:
            return self.journal.read(fd)
        finally:
            os.close(fd)

    @property
    def bad_journal_lines(self) -> int:
        return self.journal.bad_lines

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
        if self._journal_fd is None:
            return False, False
        self._check_lock()
        try:
            st = os.stat(self._journal_path)
        except OSError:
            return False, False
        moved = self._lock_moved or st.st_ino != self._journal_ino
        return moved or st.st_size != self.journal.seen, moved

    def has_changes(self) -> bool:
        # One ``stat`` of the journal's path (another size, or another file there); the
        # lock file's path checked at most once every LOCK_CHECK_S. It may run on any
        # thread, so it only says so: ``changes``, on the store's loop, holds the new
        # files (``_rejoin``) and reads the new journal from its start.
        return self._journal_news()[0]

    async def removable_orphans(self, keys: Sequence[str]) -> list[str]:
        if self.alone:
            return list(keys)
        old: list[str] = await self._off(self._older_sync)(keys, ORPHAN_AGE_S)
        if len(old) < len(keys):
            log.info(
                "disk tier %s: %d uncommitted objects kept: another process may be writing them",
                self.name,
                len(keys) - len(old),
            )
        return old

    def _older_sync(self, keys: Sequence[str], age_s: float) -> list[str]:
        now = time.time()
        out = []
        for k in keys:
            try:
                if now - os.stat(self.path_of(k)).st_mtime > age_s:
                    out.append(k)
            except OSError:
                pass
        return out

    # ------------------------------------------------------------------ sync bodies

    def _create(self, tmp: Path) -> int:
        """A new file ``tmp``, open for writing; its shard folder made the first time
        (a mkdir per put cost two system calls and an exception), and again if it has
        gone since (removed by hand)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        if tmp.parent in self._made:
            try:
                return os.open(tmp, flags, 0o644)
            except FileNotFoundError:
                self._made.discard(tmp.parent)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        self._made.add(tmp.parent)
        return os.open(tmp, flags, 0o644)

    def _put_sync(self, key: str, buffers: Iterable[Buffer]) -> bool:
        """Write ``buffers`` as ``key``'s file, whole or not at all. Buffers made as
        they are taken (a sealed object's, hashed on the way) go out in groups of about
        ``_GATHER`` bytes (a group goes once it reaches them), each written while its
        bytes are still in the CPU's cache."""
        try:
            dst = self.path_of(key)
        except KeyTooLongError as e:
            log.warning("disk tier %s: write of %s skipped: %s", self.name, key[:80], e.strerror)
            return False
        tmp = dst.with_name(f"{_TMP}{os.getpid()}.{next(_counter)}.{dst.name[:100]}")
        try:
            fd = self._create(tmp)
            try:
                # About _IO_CHUNK per system call (a gathered group goes once it
                # reaches it, a large buffer in pieces of at most that): one 100 MB
                # write() stalls in the kernel's dirty-page throttling far longer than
                # 8 MiB pieces do.
                most = _IO_CHUNK if isinstance(buffers, Sequence) else _GATHER
                for views in _pieces(buffers, most):
                    while views:
                        n = os.writev(fd, views)
                        if n <= 0:
                            raise OSError(errno.EIO, "writev wrote nothing")
                        while views and n >= len(views[0]):
                            n -= len(views.pop(0))
                        if n:
                            views[0] = views[0][n:]
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, dst)
            if self.fsync:
                dfd = os.open(dst.parent, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
            return True
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                self.out_of_space = True
                log.warning(
                    "disk tier %s: write of %s skipped: the disk is full (%s)",
                    self.name,
                    key,
                    e.strerror,
                )
            else:
                log.warning("disk tier %s: write of %s skipped: %s", self.name, key, e)
            return False
        except BaseException:  # a sealed object's record failed: no file left behind
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _read_sync(self, key: str) -> bytearray | None:
        try:
            fd = _open_object(self.path_of(key))
        except OSError as e:
            self._not_read(key, e)
            return None
        try:
            size = os.fstat(fd).st_size
            buf = bytearray(size)
            return buf if _pread_into(fd, memoryview(buf), 0) else None
        except OSError as e:
            self._not_read(key, e)
            return None
        finally:
            os.close(fd)

    def _not_read(self, key: str, e: OSError) -> None:
        """A file that could not be opened or read: a miss for that object alone (an
        absent one is an ordinary miss; anything else is said)."""
        if type(e) is not FileNotFoundError and not isinstance(e, KeyTooLongError):
            log.warning("disk tier %s: %s is a miss: %s", self.name, key[:120], e)

    def _ranges_sync(self, key: str, ranges: Sequence[Range], into: Any) -> list[Blob] | None:
        try:
            fd = _open_object(self.path_of(key))
        except OSError as e:
            self._not_read(key, e)
            return None
        total = sum(ln for _, ln in ranges)
        per_range = isinstance(
            into, list | tuple
        )  # one destination per range: read straight into each
        dst = (
            None
            if per_range
            else memoryview(into if into is not None and len(into) >= total else bytearray(total))
        )
        try:
            out: list[Blob] = []
            pos = 0
            for i, (off, ln) in enumerate(ranges):
                view = into[i] if per_range else dst[pos : pos + ln]  # type: ignore[index]
                if len(view) != ln or not _pread_into(fd, view, off):
                    return None  # the file is shorter than the manifest says
                out.append(view)
                pos += ln
            return out
        except OSError as e:
            self._not_read(key, e)
            return None
        finally:
            os.close(fd)

    def _scan_sync(self) -> tuple[list[tuple[str, int]], int]:
        found: list[tuple[str, int]] = []
        removed = 0
        if not self.objects.is_dir():
            return found, 0
        for shard in os.scandir(self.objects):
            if not shard.is_dir(follow_symlinks=False):
                continue
            for e in os.scandir(shard.path):
                if e.name.startswith(_TMP):
                    if _writer_alive(e.name):
                        continue  # another live process is writing it: not ours to remove
                    try:
                        os.unlink(e.path)
                        removed += 1
                    except FileNotFoundError:
                        pass
                elif e.is_file(follow_symlinks=False):  # a FIFO, folder or link: not ours
                    found.append((unquote(e.name), e.stat(follow_symlinks=False).st_size))
        return found, removed

    # ------------------------------------------------------------------ interface

    async def put(self, key: str, buffers: Sequence[Buffer]) -> bool:
        return bool(await self._put(key, buffers))

    def _buffers_of(self, obj: GroupObject) -> Iterable[Buffer]:
        # A sealed object is hashed on the writer thread, part by part, as it is written.
        return obj.written() if isinstance(obj, SealedObject) else obj.buffers()

    async def _put_object(self, obj: GroupObject, bufs: Iterable[Buffer]) -> bool:
        if isinstance(obj, SealedObject) and obj.reservation is None:
            return bool(await self._put(obj.key, bufs))
        return await super()._put_object(obj, bufs)

    async def get(self, key: str) -> Blob | None:
        got: bytearray | None = await self._read(key)
        return got

    async def get_many(self, keys: Sequence[str]) -> list[Blob | None]:
        """Many whole objects in one trip to the thread pool (a restart reads every
        manifest: one trip each would cost more than the reads)."""
        got: list[Blob | None] = await self._read_many(keys)
        return got

    def _read_many_sync(self, keys: Sequence[str]) -> list[Blob | None]:
        return [self._read_sync(k) for k in keys]

    async def get_ranges(
        self, key: str, ranges: Sequence[Range], into: ReadInto = None
    ) -> list[Blob] | None:
        got: list[Blob] | None = await self._ranges(key, ranges, into)
        return got

    def read_into_now(self, reads: Sequence[NowRead], each: RangeIn | None = None) -> list[bool]:
        ok = [False] * len(reads)
        for lo in range(0, len(reads), _OPEN_AT_ONCE):
            self._read_now(reads, range(lo, min(lo + _OPEN_AT_ONCE, len(reads))), ok, each)
        return ok

    def _read_now(
        self,
        reads: Sequence[NowRead],
        which: range,
        ok: list[bool],
        each: RangeIn | None,
    ) -> None:
        # An open file is the whole object it was when opened: a put renames a new
        # file over it, an eviction unlinks it; neither changes these bytes.
        fds: dict[int, int] = {}
        try:
            for j in which:
                r = reads[j]
                check_into(r.key, r.ranges, r.buffers)
                try:
                    fds[j] = fd = _open_object(self.path_of(r.key))
                    # Another size: another process replaced it; a range past the end:
                    # the loop's read says it is a miss.
                    ok[j] = os.fstat(fd).st_size == r.size and all(
                        off + ln <= r.size for off, ln in r.ranges
                    )
                except OSError as e:
                    self._not_read(r.key, e)
            jobs = _RangeReads(reads, fds, ok, each)
            nbytes = sum(ln for j in fds if ok[j] for _, ln in reads[j].ranges)
            if len(jobs.work) > 1 and nbytes >= _SPLIT_BYTES:
                shared_run(jobs.run, self._helpers, min(_HELPERS, len(jobs.work) - 1))
            else:
                jobs.run()
        finally:
            for fd in fds.values():
                os.close(fd)

    async def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            await self._off(os.remove)(self.path_of(key))

    async def contains(self, key: str) -> bool:
        try:
            return bool(await self._off(_is_object)(self.path_of(key)))
        except KeyTooLongError:
            return False

    async def scan(self) -> AsyncIterator[tuple[str, int]]:
        """Every published object; removes temp files left by a killed writer."""
        found, removed = await self._scan()
        if removed:
            log.info("disk tier %s: removed %d unfinished temp files", self.name, removed)
        for item in found:
            yield item

    async def quarantine(self, key: str) -> None:
        try:
            src = self.path_of(key)
        except KeyTooLongError:
            return
        dst = self.quarantine_dir / f"{src.name[:200]}.{int(time.time() * 1000)}"
        try:
            await self._off(os.replace)(src, dst)
            log.warning("disk tier %s: moved %s to %s", self.name, key, dst)
        except FileNotFoundError:
            pass
