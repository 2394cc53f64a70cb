"""The disk tier's files: how a key names its file, how files are opened (never
blocking, never following a link), and how bytes go out and in by system call. No tier
state (``tiers/disk.py`` is the tier, ``tiers/folder.py`` the folder's locks)."""

from __future__ import annotations

import errno
import functools
import itertools
import os
import stat
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import xxhash

from hurray_store.format import checksum
from hurray_store.tiers.base import NowRead, wants_sums
from hurray_store.tiers.types import Blob, Buffer, Range, RangeIn

TMP_PREFIX = ".tmp."  # then the writer's pid: ".tmp.<pid>.<n>.<name>"


def writer_alive(tmp_name: str) -> bool:
    """Whether the process that is writing a temp file still runs (its pid is in the
    name). Another process on the same folder keeps its files being written."""
    try:
        pid = int(tmp_name[len(TMP_PREFIX) :].split(".", 1)[0])
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


IO_CHUNK = 8 << 20
IOV_MAX = 512  # views per writev (Linux takes 1024)
GATHER = 1 << 20  # buffers this large are written alone
# A read on the caller's thread (``read_into_now``) of this many bytes or more, in more
# than one range, shares its ranges with helper threads: page-cache copies (and the
# caller's hashing) then run on every core. It opens at most OPEN_AT_ONCE files at once.
SPLIT_BYTES = 1 << 20
HELPERS = max(1, (os.cpu_count() or 2) - 1)
# The tier's threads: reads and the rest on a pool as large as Python's default one;
# writes by default on one thread fewer than the cores, so that one core is left to the
# engine's thread (more writers than cores starve the engine's thread beside them).
# With fsync they mostly wait on the device, so as many as for reads.
POOL_THREADS = min(32, (os.cpu_count() or 1) + 4)
DEFAULT_WRITERS = max(1, (os.cpu_count() or 2) - 1)
OPEN_AT_ONCE = 64


def pieces(buffers: Iterable[Buffer], most: int = IO_CHUNK) -> Iterator[list[memoryview]]:
    """The bytes of ``buffers`` in order, in lists of views: one ``writev`` each. Runs of
    buffers under ``GATHER`` bytes are gathered up to the next multiple of ``most``
    bytes in the file (or ``IOV_MAX`` views), the buffer that crosses it cut there, so
    an object of many small buffers (a chunk's descriptors and pools) costs a system
    call, and a hand-over of the GIL, per ``most`` bytes rather than per buffer. A
    larger buffer goes alone, in pieces of at most ``IO_CHUNK`` (gathered with small
    ones, large buffers wrote slower than alone: docs/benchmarks.md, the disk tier).

    Writes that start and end on those multiples leave the file in the page cache in
    large blocks (folios), which read back faster.

    A list is handed out as soon as it is full, before the next buffer is taken: taking
    a self-checked object's buffer hashes it (``SelfCheckedObject.written``), and a buffer hashed
    a list ahead of its write would have left the CPU's cache by then."""
    if isinstance(buffers, Sequence) and len(buffers) <= IOV_MAX:
        # The common case in one pass: an object of small buffers within one list.
        whole = [mv for b in buffers if (mv := memoryview(b).cast("B")).nbytes]
        if sum(mv.nbytes for mv in whole) <= min(most, GATHER):
            if whole:
                yield whole
            return
    views: list[memoryview] = []
    pos = 0  # where the next byte goes in the file
    for b in buffers:
        mv = memoryview(b).cast("B")
        if not len(mv):
            continue
        if len(mv) >= GATHER:
            if views:
                yield views
                views = []
            for at in range(0, len(mv), IO_CHUNK):
                yield [mv[at : at + IO_CHUNK]]
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
        if len(views) == IOV_MAX:
            yield views
            views = []
    if views:
        yield views


def skip(views: list[memoryview], n: int) -> int:
    """Drop the first ``n`` bytes of ``views`` (byte views, ``pieces``) from it, up to
    all of them; how many were dropped."""
    dropped = 0
    while views and dropped < n:
        v = views[0]
        if v.nbytes <= n - dropped:
            dropped += views.pop(0).nbytes
        else:
            views[0] = v[n - dropped :]
            dropped = n
    return dropped


def write_all(fd: int, views: list[memoryview]) -> None:
    """Every byte of ``views`` (byte views, ``pieces``) written to ``fd``, in order."""
    left = sum(v.nbytes for v in views)
    while True:
        n = os.writev(fd, views)
        if n == left:
            return
        if n <= 0:
            raise OSError(errno.EIO, "writev wrote nothing")
        left -= n
        skip(views, n)  # a short write: what is left of the views


def pread_into(fd: int, view: memoryview, offset: int) -> bool:
    """Fill ``view`` from ``offset`` of ``fd``; False: the file ends first."""
    done, ln = 0, len(view)
    while done < ln:
        n = os.preadv(fd, [view[done : done + IO_CHUNK]], offset + done)
        if n <= 0:
            return False
        done += n
    return True


class RangeReads:
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
            if not pread_into(self.fds[j], r.buffers[i], r.ranges[i][0]):
                self.ok[j] = False  # the file is shorter than the ranges say
            elif self.each is not None:
                # Right after its read, while in the CPU's cache: one whole range (a
                # chunk's pool) at once, since smaller read steps cost more calls than
                # the cache saves.
                self.each(j, i, checksum(r.buffers[i]) if self.sums else 0)


# File names stay under the usual 255-byte limit with room for the temp prefix.
MAX_NAME_BYTES = 230


class KeyTooLongError(FileNotFoundError):
    """A key too long to be a file name: this tier cannot hold it."""


class NotAnObjectError(FileNotFoundError):
    """Something other than a regular file (a FIFO, a folder, a symlink, a device) lies
    where an object or the journal should be: put there by hand or by a co-tenant of
    the folder, never by a store. It is a miss, as an absent file is."""


# No open of the folder's files blocks or follows a link: a FIFO opened for reading
# without O_NONBLOCK waits for a writer forever; a symlink may point anywhere.


_NOT_A_FILE = (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP)


def open_regular(path: Path | str, flags: int, said: str, mode: int = 0o644) -> int:
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


def open_object(path: Path | str) -> int:
    """A read-only descriptor of the object file at ``path``."""
    return open_regular(path, os.O_RDONLY, f"not a regular file: {path}")


def is_object(path: Path) -> bool:
    """Whether a regular file (not a link to one) lies at ``path``."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


@functools.lru_cache(maxsize=8192)
def object_path(objects: Path, key: str) -> Path:
    """``DiskTier.path_of``, kept made for the last few thousand keys."""
    name = quote(key, safe="")
    if len(name.encode()) > MAX_NAME_BYTES:
        raise KeyTooLongError(
            errno.ENAMETOOLONG,
            f"the key's file name takes {len(name.encode())} bytes, at most {MAX_NAME_BYTES}",
        )
    shard = f"{xxhash.xxh3_64_intdigest(key.encode()) & 0xFF:02x}"
    return objects / shard / name


def read_ranges(fd: int, ranges: Sequence[Range], into: Any) -> list[Blob] | None:
    """Each ``(offset, length)`` range of the open file ``fd``: into ``into[i]`` when it
    is one buffer per range, else into one buffer (``into`` when large enough), as
    views of it. None: the file is shorter than a range asks."""
    total = sum(ln for _, ln in ranges)
    per_range = isinstance(into, list | tuple)
    dst = (
        None
        if per_range
        else memoryview(into if into is not None and len(into) >= total else bytearray(total))
    )
    out: list[Blob] = []
    pos = 0
    for i, (off, ln) in enumerate(ranges):
        view = into[i] if per_range else dst[pos : pos + ln]  # type: ignore[index]
        if len(view) != ln or not pread_into(fd, view, off):
            return None
        out.append(view)
        pos += ln
    return out


def scan_objects(objects: Path) -> tuple[list[tuple[str, int]], int]:
    """Every published object under ``objects`` and its size, and how many temp files
    of writers no longer alive were removed."""
    found: list[tuple[str, int]] = []
    removed = 0
    if not objects.is_dir():
        return found, 0
    for shard in os.scandir(objects):
        if not shard.is_dir(follow_symlinks=False):
            continue
        for e in os.scandir(shard.path):
            if e.name.startswith(TMP_PREFIX):
                if writer_alive(e.name):
                    continue  # another live process is writing it: not ours to remove
                try:
                    os.unlink(e.path)
                    removed += 1
                except FileNotFoundError:
                    pass
            elif e.is_file(follow_symlinks=False):  # a FIFO, folder or link: not ours
                found.append((unquote(e.name), e.stat(follow_symlinks=False).st_size))
    return found, removed
