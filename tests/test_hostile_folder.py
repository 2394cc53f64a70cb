"""A disk folder shared with a hostile or careless co-tenant (issue 40, items 7-9): odd
files where objects should be, journal lines no store wrote, and the folder's lock
held, deleted or replaced. Each is a miss or a clear error, never a hang, a traceback
into the caller or another store's objects swept."""

from __future__ import annotations

import asyncio
import fcntl
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest

from hurray_store import PagedKVPool
from hurray_store.store import TieredStore
from hurray_store.tiers import folder as folder_mod
from hurray_store.tiers.base import NowRead
from hurray_store.tiers.disk import DiskTier
from tests import folder_client as fc
from tests.store_helpers import random_pool, shared_batch, spec

T = TypeVar("T")

# Each kind of odd file, made at ``path`` in place of what was there.


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _folder(path: Path) -> None:
    path.mkdir()
    (path / "inside").write_bytes(b"x" * 64)


def _symlink_loop(path: Path) -> None:
    os.symlink(path.name, path)  # points at itself: ELOOP when followed


def _symlink_to_a_file(path: Path) -> None:
    # The bytes it points to may be anything on the machine (a secret, a device): a
    # store never makes links, so it never follows one.
    target = path.parent / "elsewhere"
    target.write_bytes(b"y" * 100)
    os.symlink(target, path)


ODD: dict[str, Callable[[Path], None]] = {
    "fifo": _fifo,
    "folder": _folder,
    "symlink_loop": _symlink_loop,
    "symlink_to_a_file": _symlink_to_a_file,
}


def _replace(path: Path, make: Callable[[Path], None]) -> None:
    path.unlink()
    make(path)


def _disk(store: TieredStore) -> DiskTier:
    d = store.tiers[0]
    assert isinstance(d, DiskTier)
    return d


async def _within(coro: Awaitable[T], seconds: float = 20.0) -> T:
    """The call's result; a hang (the old code on a FIFO) fails the test, not the run."""
    return await asyncio.wait_for(coro, seconds)


@pytest.mark.parametrize("kind", sorted(ODD))
async def test_an_odd_file_in_place_of_an_object_is_a_miss(tmp_path: Path, kind: str) -> None:
    """A FIFO, folder, symlink loop or symlink to a file where an object was: every read
    path (get, ranges, the caller-thread read, contains, a fresh store's scan) is a
    miss, without hanging or raising."""
    cfg = fc.config(str(tmp_path), 1 << 30)
    async with TieredStore(cfg) as store:
        d = _disk(store)
        assert await store.put_object("x", b"a" * 100)
        assert await d.put("raw", [b"b" * 100])
        for key in ("hurray/o/x", "raw"):
            _replace(d.path_of(key), ODD[kind])
        assert await _within(store.get_object("x")) is None
        assert not store.held("x"), "it left the ledger"
        assert await _within(d.get("raw")) is None
        assert await _within(d.get_ranges("raw", [(0, 10)])) is None
        assert not await _within(d.contains("raw"))
        buf = bytearray(10)
        read = NowRead("raw", [(0, 10)], [memoryview(buf)], 100)
        assert await _within(asyncio.to_thread(d.read_into_now, [read])) == [False]
        assert buf == bytearray(10), "nothing read into the buffer"
    async with TieredStore(cfg) as again:  # the restart scan passes the odd files over
        assert not again.held("x")
        assert await _within(again.get_object("x")) is None


@pytest.mark.parametrize("kind", sorted(ODD))
async def test_the_next_put_of_a_key_replaces_an_odd_file_in_its_place(
    tmp_path: Path, kind: str
) -> None:
    """Whatever sits where an object goes (a folder with files in it too, which a rename
    cannot replace), the next put of that key stores it and a get reads it back; a
    folder is moved aside into the tier's quarantine, not deleted."""
    cfg = fc.config(str(tmp_path), 1 << 30)
    async with TieredStore(cfg) as store:
        d = _disk(store)
        assert await d.put("raw", [b"b" * 100])
        _replace(d.path_of("raw"), ODD[kind])
        assert await _within(d.put("raw", [b"c" * 100]))
        got = await _within(d.get("raw"))
        assert got is not None and bytes(got) == b"c" * 100
        assert d.path_of("raw").is_file() and not d.path_of("raw").is_symlink()
        aside = [p for p in d.quarantine_dir.iterdir() if p.name.startswith("dir.")]
        assert len(aside) == (kind == "folder")
        if aside:
            assert (aside[0] / "inside").read_bytes() == b"x" * 64, "moved, nothing lost"


async def test_a_fifo_in_place_of_layer_objects_is_a_miss_for_retrieve_and_lookup(
    tmp_path: Path,
) -> None:
    cfg = fc.config(str(tmp_path), 1 << 30)
    sp = spec(num_layers=2)
    src = random_pool(sp)
    b = shared_batch(src, list(range(100, 116)), [[1] * 8])
    async with TieredStore(cfg) as store:
        await store.put(src, b.tokens, b.tables)
        assert await store.lookup(sp, b.tokens) == [24]
        d = _disk(store)
        layers = [
            Path(e.path)
            for shard in os.scandir(d.objects)
            for e in os.scandir(shard.path)
            if not e.name.endswith("%2Fm")  # the segment's layers, not its manifest
        ]
        assert layers, "the put left layer objects"
        for p in layers:
            _replace(p, _fifo)
        got = await _within(store.retrieve(PagedKVPool(sp, 16), b.tokens))
        assert got.num_tokens == [0]
        assert await _within(store.lookup(sp, b.tokens)) == [0], "it left the ledger"


def _journal(tmp_path: Path) -> Path:
    return tmp_path / "journal"


async def test_a_journal_line_nested_2000_deep_is_skipped_and_the_lines_after_it_read(
    tmp_path: Path,
) -> None:
    """2,000 ``[`` used to raise RecursionError into the next put or lookup (the
    writer's own too) and lose the lines after it in that read."""
    cfg = fc.config(str(tmp_path), 1 << 30)
    async with TieredStore(cfg) as a, TieredStore(cfg) as b:
        da, db = _disk(a), _disk(b)
        with open(_journal(tmp_path), "ab") as f:
            f.write(b"[" * 2000 + b"\n" + b'["' + b"[" * 2000 + b"\n")
        db.log_changes(added=["k/after"])
        assert da.changes() == [(True, "k/after")]
        assert da.bad_journal_lines == 2
        assert await a.put_object("y", b"y" * 10), "the writer's own put works"
        assert await b.get_object("y") == b"y" * 10, "and the other store reads it"


@pytest.mark.parametrize("newline", [True, False], ids=["with_newline", "without_newline"])
async def test_a_journal_line_of_24_mib_is_read_once(tmp_path: Path, newline: bool) -> None:
    """A line far longer than any store writes, with or without its newline, is skipped
    in one pass: later calls do not read it again (it used to be re-read by every call,
    0.45 s and +255 MiB a call at 256 MiB), and the lines after it are read."""
    cfg = fc.config(str(tmp_path), 1 << 30)
    async with TieredStore(cfg) as a, TieredStore(cfg) as b:
        da, db = _disk(a), _disk(b)
        with open(_journal(tmp_path), "ab") as f:
            f.write(b"x" * (24 << 20) + (b"\n" if newline else b""))
        assert da.changes() == []
        assert da.journal.seen == _journal(tmp_path).stat().st_size, "read once, to its end"
        assert da.bad_journal_lines == 1
        db.log_changes(added=["k/after"])  # its newline first ends a line left without one
        assert da.changes() == [(True, "k/after")]
        assert not da.has_changes()


async def test_an_odd_file_in_place_of_the_journal_is_no_hang(tmp_path: Path) -> None:
    cfg = fc.config(str(tmp_path), 1 << 30)
    async with TieredStore(cfg) as a:
        da = _disk(a)
        _replace(_journal(tmp_path), _fifo)
        assert da.changes() == []
        assert await _within(a.put_object("z", b"z")), "puts go on"
    with pytest.raises(OSError, match="not a regular file"):
        async with TieredStore(cfg):
            pass


async def test_a_lock_held_exclusively_by_another_program_is_waited_for_a_bounded_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every open used to wait forever; now it waits LOCK_WAIT_S and says why."""
    monkeypatch.setattr(folder_mod, "LOCK_WAIT_S", 0.5)
    cfg = fc.config(str(tmp_path), 1 << 30)
    async with TieredStore(cfg):
        pass  # makes the folder
    hog = os.open(tmp_path / "lock", os.O_RDWR)
    try:
        fcntl.flock(hog, fcntl.LOCK_EX)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="locked exclusively"):
            async with TieredStore(cfg):
                pass
        assert time.monotonic() - t0 < 10
    finally:
        os.close(hog)
    async with TieredStore(cfg) as store:  # let go: it opens
        assert _disk(store).alone


@pytest.mark.parametrize("how", ["deleted", "replaced"])
async def test_a_lock_file_deleted_or_replaced_never_makes_a_newcomer_alone(
    tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock file deleted (or replaced) while a store holds it: the next store used to
    believe it was alone, empty the journal and sweep the first store's in-flight
    objects (lookup 224, retrieve 0). The journal and objects folder are still held, so
    it is not alone; and the first store takes the new lock file."""
    monkeypatch.setattr(folder_mod, "LOCK_CHECK_S", 0.0)
    cfg = fc.config(str(tmp_path), 1 << 30)
    sp = spec(num_layers=2)
    src = random_pool(sp)
    b = shared_batch(src, list(range(100, 116)), [[1] * 8])
    async with TieredStore(cfg) as first:
        d1 = _disk(first)
        await first.put(src, b.tokens, b.tables)
        orphan = "hurray/s/{00ff}/0"
        assert await d1.put(orphan, [b"in flight"])
        lock = tmp_path / "lock"
        lock.unlink()
        if how == "replaced":
            lock.write_bytes(b"")
        journal_size = _journal(tmp_path).stat().st_size
        async with TieredStore(cfg) as second:
            d2 = _disk(second)
            assert not d2.alone
            assert await d2.contains(orphan), "the first store's in-flight object is kept"
            assert _journal(tmp_path).stat().st_size >= journal_size, "journal not emptied"
            assert await second.lookup(sp, b.tokens) == [24]
            got = await second.retrieve(PagedKVPool(sp, 16), b.tokens)
            assert got.num_tokens == [24]
            # The first store's next operation checks the lock file's path.
            assert await first.lookup(sp, b.tokens) == [24]
            assert os.fstat(d1.folder.lock_fd).st_ino == lock.stat().st_ino  # type: ignore[arg-type]
            assert not d1.alone


async def test_a_journal_replaced_by_hand_is_held_again_and_read_from_its_start(
    tmp_path: Path,
) -> None:
    cfg = fc.config(str(tmp_path), 1 << 30)
    async with TieredStore(cfg) as a, TieredStore(cfg) as b:
        da, db = _disk(a), _disk(b)
        _journal(tmp_path).unlink()
        _journal(tmp_path).write_bytes(b"")
        assert db.has_changes(), "another file at the path"
        assert db.changes() == []
        assert os.fstat(db.folder.journal_fd).st_ino == _journal(tmp_path).stat().st_ino  # type: ignore[arg-type]
        assert await b.put_object("w", b"w" * 10)  # announced in the new journal
        assert await a.get_object("w") == b"w" * 10, "the other store reads it there"
        assert os.fstat(da.folder.journal_fd).st_ino == _journal(tmp_path).stat().st_ino  # type: ignore[arg-type]
