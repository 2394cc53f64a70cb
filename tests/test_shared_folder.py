"""Several processes on one cache folder: 3 processes put and retrieve overlapping
prefixes at once, one of them killed mid-run and started again. No process deletes
another's files in flight, each finds the others' committed segments while it runs,
lookup never promises more than retrieve delivers, and nothing is lost or wrong."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hurray_store import PagedKVPool
from hurray_store.store import TieredStore
from hurray_store.tiers.disk import DiskTier
from tests import folder_client as fc
from tests.server_client import SPEC, batches, check

ROOT = Path(__file__).resolve().parent.parent
ROUNDS = 6


def _client(folder: Path, barrier: Path, client: int, rounds: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.folder_client",
            "--folder",
            str(folder),
            "--barrier",
            str(barrier),
            "--client",
            str(client),
            "--clients",
            "3",
            "--rounds",
            str(rounds),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "LMCACHE_TRACK_USAGE": "false"},
    )


def _report(p: subprocess.Popen[bytes]) -> dict[str, int]:
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err.decode()[-3000:]
    return json.loads(out.decode().strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_three_processes_one_restarted_share_one_folder(tmp_path: Path) -> None:
    folder, barrier = tmp_path / "cache", tmp_path / "barrier"
    barrier.mkdir()
    # Client 2 first runs long (many rounds) and is killed in the middle of its puts.
    doomed = _client(folder, barrier, 2, 400)
    journal = folder / "journal"
    deadline = time.monotonic() + 120
    while not (journal.exists() and journal.stat().st_size > 4000):
        assert time.monotonic() < deadline and doomed.poll() is None, "client 2 never wrote"
        time.sleep(0.05)
    others = [_client(folder, barrier, c, ROUNDS) for c in (0, 1)]
    time.sleep(1.0)
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(timeout=30)
    restarted = _client(folder, barrier, 2, ROUNDS)  # opens while 0 and 1 are writing
    reports = [_report(p) for p in [*others, restarted]]
    for r in reports:
        assert r["bad_pages"] == 0, r
        assert r["overpromised"] == 0, r
        assert r["short_at_end"] == 0, f"a process missed what the others committed: {r}"
    assert sum(r["pages_written"] for r in reports) > 0

    async def fresh() -> None:
        cfg = fc.config(str(folder), 1 << 30)
        async with TieredStore(cfg) as store:
            disk = store.tiers[0]
            assert isinstance(disk, DiskTier) and disk.alone
            for c in range(3):
                for seqs in batches(c, ROUNDS):
                    dst = PagedKVPool(SPEC, 512)
                    got = await store.retrieve(dst, seqs)
                    assert got.num_tokens == [len(t) // 8 * 8 for t in seqs]
                    assert check(dst, seqs, got.block_tables, got.num_tokens) == 0

    asyncio.run(fresh())


async def test_a_store_that_is_not_alone_keeps_young_uncommitted_objects(tmp_path: Path) -> None:
    """An uncommitted layer object (another process's segment in flight) survives the
    open of a second store; a first store alone removes it."""
    cfg = fc.config(str(tmp_path), 1 << 30)
    async with TieredStore(cfg) as first:
        disk = first.tiers[0]
        assert isinstance(disk, DiskTier) and disk.alone
        orphan = "hurray/s/{00ff}/0"
        assert await disk.put(orphan, [b"in flight"])
        async with TieredStore(cfg) as second:
            other = second.tiers[0]
            assert isinstance(other, DiskTier) and not other.alone
            assert await other.contains(orphan), "a live writer's object is kept"
            os.utime(disk.path_of(orphan), (time.time() - 3600,) * 2)
        async with TieredStore(cfg) as third:
            assert not await third.tiers[0].contains(orphan), "an hour-old one is not"


async def test_what_one_process_commits_and_evicts_the_other_hears(tmp_path: Path) -> None:
    """Two stores on one folder: a segment one commits, the other retrieves; an object
    one deletes leaves the other's ledger; an object one replaces with another size is
    never read at the old size by the other."""
    from tests.store_helpers import random_pool, shared_batch, spec

    cfg = fc.config(str(tmp_path), 1 << 30)
    sp = spec(num_layers=2)
    src = random_pool(sp)
    b = shared_batch(src, list(range(100, 116)), [[1] * 8])
    async with TieredStore(cfg) as a, TieredStore(cfg) as other:
        await a.put(src, b.tokens, b.tables)
        assert await other.lookup(sp, b.tokens) == [24], "the other store found the segment"
        got = await other.retrieve(PagedKVPool(sp, 16), b.tokens)
        assert got.num_tokens == [24]
        assert await a.put_object("x", b"a" * 100)
        assert await other.get_object("x") == b"a" * 100
        assert await a.put_object("x", b"b" * 50)  # replaced with another size
        assert await other.get_object("x") == b"b" * 50
        await a.delete_object("x")
        assert await other.object_size("x") is None
        assert other.ledger.used_bytes(0) == a.ledger.used_bytes(0) > 0


async def test_an_object_replaced_unannounced_with_the_same_size_is_a_miss(tmp_path: Path) -> None:
    """Bytes changed under a key without a journal line (by hand, or by a writer that
    does not keep one): the checksum the store kept at put says so, and it is a miss."""
    async with TieredStore(fc.config(str(tmp_path), 1 << 30)) as store:
        assert await store.put_object("x", b"a" * 100)
        disk = store.tiers[0]
        assert isinstance(disk, DiskTier)
        disk.path_of("hurray/o/x").write_bytes(b"b" * 100)
        assert await store.get_object("x") is None
        assert not store.held("x"), "it left the ledger"
        disk.path_of("hurray/o/x").write_bytes(b"c" * 7)
        assert await store.put_object("y", b"y" * 10)
        disk.path_of("hurray/o/y").write_bytes(b"c" * 7)
        assert await store.get_object("y") is None, "another size is a miss too"


async def test_a_store_skips_reading_back_only_its_own_lines_with_none_unread_before(
    tmp_path: Path,
) -> None:
    """A store counts the journal lines it appends as read, so the next operation does
    not read them back, but only when nothing unread lies before them: another store's
    line written just before its own is still read."""
    cfg = fc.config(str(tmp_path), 1 << 30)
    async with TieredStore(cfg) as a, TieredStore(cfg) as b:
        da, db = a.tiers[0], b.tiers[0]
        assert isinstance(da, DiskTier) and isinstance(db, DiskTier)
        journal = tmp_path / "journal"
        db.log_changes(added=["k/from-b"])
        da.log_changes(added=["k/from-a"])
        da.log_changes(removed=["k/gone-a"])
        assert da.changes() == [(True, "k/from-b")]
        assert da.changes() == []
        da.log_changes(added=["k/more-a"])  # right after all it read: counted read
        assert da.journal.seen == journal.stat().st_size
        assert da.changes() == []
        assert db.changes() == [(True, "k/from-a"), (False, "k/gone-a"), (True, "k/more-a")]
