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
8 MiB per system call (see ``IO_CHUNK``); a write gathers an object's buffers into
those pieces (``writev``). ``open`` removes temp files a killed process left behind.
Writes go to ``write_threads`` threads, by default one fewer than the machine's cores
(with ``fsync``, the CPU count + 4, as Python's default pool): those asked for in one
turn of the loop as a few jobs (``tiers/write_jobs.py``), which a caller that would only
wait for them may also run (``help_write``). Everything else is one trip to a pool of
the CPU count + 4 threads (``aiofiles.os.wrap``); a trip costs tens of microseconds, so
never one per page.

Several processes may open one folder at once (vLLM's scheduler and workers, several
engines on a host): ``tiers/folder.py`` holds the folder's locks and journal, through
which each store finds the others' segments and forgets what they evicted. A restart
scan deletes uncommitted objects only when this store is alone on the folder, else
only those older than ``ORPHAN_AGE_S``.

Nothing in the folder is opened so that it could block or follow a link: a FIFO, a
folder, a device or a symlink where an object should be is a miss for that object.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import logging
import os
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import aiofiles.os

from hurray_store.config import DiskTierConfig
from hurray_store.tiers.base import Capabilities, GroupObject, NowRead, Tier
from hurray_store.tiers.files import (
    DEFAULT_WRITERS,
    GATHER,
    HELPERS,
    IO_CHUNK,
    IOV_MAX,
    OPEN_AT_ONCE,
    POOL_THREADS,
    SPLIT_BYTES,
    TMP_PREFIX,
    KeyTooLongError,
    RangeReads,
    is_object,
    object_path,
    open_object,
    pieces,
    pread_into,
    read_ranges,
    scan_objects,
    skip,
    write_all,
)
from hurray_store.tiers.folder import ORPHAN_AGE_S, SharedFolder
from hurray_store.tiers.helpers import check_into, shared_run
from hurray_store.tiers.journal import Journal
from hurray_store.tiers.self_checked import SelfCheckedObject
from hurray_store.tiers.types import Blob, Buffer, Range, RangeIn, ReadInto
from hurray_store.tiers.write_jobs import WriteJobs

log = logging.getLogger(__name__)
T = TypeVar("T")
_counter = itertools.count()  # temp file names


class DiskTier(Tier):
    config_cls = DiskTierConfig
    # reads_now: every write is a temp file renamed over the key, never in place.
    caps = Capabilities(persistent=True)

    def __init__(self, cfg: DiskTierConfig, namespace: str | None = None) -> None:
        super().__init__(cfg, namespace)
        self.root = Path(cfg.path)
        self.objects = self.root / "objects"
        self.quarantine_dir = self.root / "quarantine"
        self.fsync = cfg.fsync
        # Writes go out on a pool of write_threads (by default one core is left to the
        # engine's thread); reads and the rest on a pool as large as Python's default
        # one; the help a read on the caller's thread gets, on threads of its own (a
        # shared pool hands work to its longest-idle thread, which starts late).
        self.write_threads = cfg.write_threads or (POOL_THREADS if cfg.fsync else DEFAULT_WRITERS)
        self._writers: ThreadPoolExecutor | None = ThreadPoolExecutor(
            self.write_threads, f"hurray-disk-{self.name}-w"
        )
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            POOL_THREADS, f"hurray-disk-{self.name}"
        )
        self._helpers: ThreadPoolExecutor | None = ThreadPoolExecutor(
            min(HELPERS, POOL_THREADS), f"hurray-disk-{self.name}-h"
        )
        self._writes = WriteJobs(self._put_sync, self._writers, self.write_threads)
        self._put = self._writes.put
        self._read = self._off(self._read_sync)
        self._ranges = self._off(self._ranges_sync)
        self._scan = self._off(scan_objects)
        self._read_many = self._off(self._read_many_sync)
        self._made: set[str] = set()  # shard folders this tier has seen exist
        self.folder = SharedFolder(self.name, self.root, self.objects)  # its locks, journal

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
        reads what it wrote, and quoting and hashing a key is a visible part of a get)."""
        return object_path(self.objects, key)

    async def open(self) -> None:
        await self._off(os.makedirs)(self.objects, exist_ok=True)
        await self._off(os.makedirs)(self.quarantine_dir, exist_ok=True)
        if not self.folder.joined:
            await self._off(self.folder.join)()

    async def close(self) -> None:
        for pool in (self._writers, self._pool, self._helpers):
            if pool is not None:
                pool.shutdown(wait=True)
        self._writers = self._pool = self._helpers = None
        self.folder.close()

    # ------------------------------------------------------------------ other processes

    @property
    def alone(self) -> bool:
        """No other store had the folder open when this one opened it."""
        return self.folder.alone

    @property
    def journal(self) -> Journal:
        return self.folder.journal

    @property
    def bad_journal_lines(self) -> int:
        return self.folder.journal.bad_lines

    def log_changes(self, added: Sequence[str] = (), removed: Sequence[str] = ()) -> None:
        self.folder.log_changes(added, removed)

    def changes(self) -> list[tuple[bool, str]]:
        return self.folder.changes()

    def has_changes(self) -> bool:
        return self.folder.has_changes()

    async def confirm(self, objects: Sequence[GroupObject]) -> bool:
        # Another store's cleanup removes only orphans older than ORPHAN_AGE_S: a
        # group being written is never one.
        return True

    async def removable_orphans(self, keys: Sequence[str]) -> list[str]:
        if self.folder.alone:
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

    def _create(self, folder: str, tmp: str) -> int:
        """A new file ``tmp`` in ``folder``, open for writing; the (shard) folder made
        the first time (a mkdir per put cost two system calls and an exception), and
        again if it has gone since (removed by hand). Paths as strings: pathlib's
        operations were a visible part of a page-sized put."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        if folder in self._made:
            try:
                return os.open(tmp, flags, 0o644)
            except FileNotFoundError:
                self._made.discard(folder)
        os.makedirs(folder, exist_ok=True)
        self._made.add(folder)
        return os.open(tmp, flags, 0o644)

    def _put_sync(self, key: str, buffers: Iterable[Buffer], nbytes: int | None = None) -> bool:
        """Write ``buffers`` as ``key``'s file, whole or not at all. Buffers made as
        they are taken (a self-checked object's, hashed on the way) go out in groups of about
        ``GATHER`` bytes (a group goes once it reaches them), each written while its
        bytes are still in the CPU's cache. A list of at most ``GATHER`` bytes in all
        (``nbytes``, when the caller knows it) goes in one ``writev`` as it is."""
        try:
            dst = self.path_of(key)
        except KeyTooLongError as e:
            log.warning("disk tier %s: write of %s skipped: %s", self.name, key[:80], e.strerror)
            return False
        folder, name = os.path.split(dst)
        tmp = f"{folder}/{TMP_PREFIX}{os.getpid()}.{next(_counter)}.{name[:100]}"
        try:
            fd = self._create(folder, tmp)
            try:
                # About IO_CHUNK per system call (a gathered group goes once it
                # reaches it, a large buffer in pieces of at most that): one 100 MB
                # write() stalls in the kernel's dirty-page throttling far longer than
                # 8 MiB pieces do.
                most = IO_CHUNK if isinstance(buffers, Sequence) else GATHER
                done = 0
                if (
                    nbytes is not None
                    and nbytes <= GATHER
                    and isinstance(buffers, list | tuple)
                    and len(buffers) <= IOV_MAX
                ):
                    done = os.writev(fd, buffers)  # the common case: no view made
                if done != nbytes:
                    for views in pieces(buffers, most):
                        done -= skip(views, done)  # what a short writev wrote already
                        if views:
                            write_all(fd, views)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.replace(tmp, dst)
            except OSError as e:  # a directory in the page's place (put there by hand)
                if e.errno not in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                    raise
                if not stat.S_ISDIR(os.lstat(dst).st_mode):
                    raise
                aside = f"{self.quarantine_dir}/dir.{os.getpid()}.{next(_counter)}.{name[:100]}"
                os.replace(dst, aside)
                log.warning(
                    "disk tier %s: a directory at %s's path moved to %s", self.name, key, aside
                )
                os.replace(tmp, dst)
            if self.fsync:
                dfd = os.open(folder, os.O_RDONLY)
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
        except BaseException:  # a self-checked object's record failed: no file left behind
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _read_sync(self, key: str) -> bytearray | None:
        try:
            fd = open_object(self.path_of(key))
        except OSError as e:
            self._not_read(key, e)
            return None
        try:
            size = os.fstat(fd).st_size
            buf = bytearray(size)
            return buf if pread_into(fd, memoryview(buf), 0) else None
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
            fd = open_object(self.path_of(key))
        except OSError as e:
            self._not_read(key, e)
            return None
        try:
            return read_ranges(fd, ranges, into)
        except OSError as e:
            self._not_read(key, e)
            return None
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ interface

    async def put(self, key: str, buffers: Sequence[Buffer]) -> bool:
        return bool(await self._put(key, buffers))

    def _buffers_of(self, obj: GroupObject) -> Iterable[Buffer]:
        # A self-checked object is hashed on the writer thread, part by part, as it is written.
        return obj.written() if isinstance(obj, SelfCheckedObject) else obj.buffers()

    async def _put_object(self, obj: GroupObject, bufs: Iterable[Buffer]) -> bool:
        res = obj.reservation
        reserved = res is not None and res.tier is self and not res.committed
        if reserved or (type(self).put is not DiskTier.put and isinstance(bufs, Sequence)):
            return await super()._put_object(obj, bufs)  # a subclass's put sees every write
        # Its size known: a page-sized object of small buffers goes in one writev.
        return bool(await self._put(obj.key, bufs, obj.nbytes))

    def help_write(self) -> bool:
        return self._writes.help()

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
        for lo in range(0, len(reads), OPEN_AT_ONCE):
            self._read_now(reads, range(lo, min(lo + OPEN_AT_ONCE, len(reads))), ok, each)
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
                    fds[j] = fd = open_object(self.path_of(r.key))
                    # Another size: another process replaced it; a range past the end:
                    # the loop's read says it is a miss.
                    ok[j] = os.fstat(fd).st_size == r.size and all(
                        off + ln <= r.size for off, ln in r.ranges
                    )
                except OSError as e:
                    self._not_read(r.key, e)
            jobs = RangeReads(reads, fds, ok, each)
            nbytes = sum(ln for j in fds if ok[j] for _, ln in reads[j].ranges)
            if len(jobs.work) > 1 and nbytes >= SPLIT_BYTES:
                shared_run(jobs.run, self._helpers, min(HELPERS, len(jobs.work) - 1))
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
            return bool(await self._off(is_object)(self.path_of(key)))
        except KeyTooLongError:
            return False

    async def scan(self) -> AsyncIterator[tuple[str, int]]:
        """Every published object; removes temp files left by a killed writer."""
        found, removed = await self._scan(self.objects)
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
