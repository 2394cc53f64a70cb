"""Several stores on one S3 prefix, as several processes on one disk folder: nothing
another store may still be uploading is swept, a manifest is committed only after its
layers are confirmed, and each store reads the others' commits and deletes through the
change log. Real stores (some in writer processes of their own) on a real SeaweedFS."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import obstore
import pytest

from hurray_store import PagedKVPool
from hurray_store.store import TieredStore, open_store
from hurray_store.testing.services import SeaweedProc
from hurray_store.tiers.changelog import ChangeFeed, parse
from hurray_store.tiers.s3 import S3Tier
from tests.store_helpers import assert_pages_equal, random_pool, shared_batch, spec

ROOT = Path(__file__).resolve().parent.parent
FAST = {"change_poll_s": 0.1, "timeout_s": 2.0}


def _cfg(s3: SeaweedProc, prefix: str, **kw: Any) -> dict[str, Any]:
    return {"tiers": [s3.tier(prefix, **{**FAST, **kw})]}


async def _until(cond: Any, timeout_s: float = 10.0) -> None:
    """Wait (polling the stores' calls) until ``await cond()`` is true."""
    deadline = time.monotonic() + timeout_s
    while not await cond():
        assert time.monotonic() < deadline, "not read in time"
        await asyncio.sleep(0.05)


async def _delivers(store: TieredStore, sp: Any, src: PagedKVPool, b: Any) -> int:
    """Retrieve ``b`` into a fresh pool: the tokens delivered (checked against ``src``),
    which must be what the lookup just before promised."""
    promised = await store.lookup(sp, b.tokens)
    dst = PagedKVPool(sp, 64)
    got = await store.retrieve(dst, b.tokens)
    assert got.num_tokens == promised, "a lookup promised what the retrieve did not deliver"
    assert_pages_equal(src, b.tables, dst, got.block_tables, got.num_tokens)
    return got.num_tokens[0]


def _objects(s3: SeaweedProc, prefix: str) -> list[str]:
    t = S3Tier(_tier_cfg(s3, prefix))
    return [m["path"] for batch in obstore.list(t.store, t.objects) for m in batch]


def _tier_cfg(s3: SeaweedProc, prefix: str) -> Any:
    from hurray_store.config import load_config

    return load_config(_cfg(s3, prefix), env={}).tiers[0]


def test_change_log_names_round_trip_and_bad_names_are_skipped() -> None:
    clock = [1_700_000_000.0]
    a = ChangeFeed("aaaa", now=lambda: clock[0])
    b = ChangeFeed("bbbb", now=lambda: clock[0])
    names = a.names(added=["ns/s/{00ff}/m"], removed=["ns/o/x"])
    assert [parse(n)[1:] for n in names] == [  # type: ignore[index]
        ("aaaa", True, "ns/s/{00ff}/m"),
        ("aaaa", False, "ns/o/x"),
    ]
    for n in names:
        a.add(n)
        b.add(n)
        b.add(n)  # a listing returns it again: added once
    assert a.take() == [], "a store does not read its own entries"
    assert b.take() == [(True, "ns/s/{00ff}/m"), (False, "ns/o/x")]
    for bad in ["junk", "123-a-1-a-00", "1700000000000-w-1-x-6161", "1700000000000-w-1-a-zz"]:
        b.add(bad)
    assert b.bad == 4 and b.take() == []
    assert b.offset() == f"{1_700_000_000_000 - 60_000:013d}", "a minute before the newest"
    clock[0] += 120
    b.add(a.names(added=["k"])[0])
    b.forget_old()
    assert len(b.seen) == 1, "names older than the window are forgotten"


async def test_two_stores_hear_each_others_commits_and_deletes(
    s3_server: SeaweedProc, tmp_path: Path
) -> None:
    sp = spec(num_layers=2)
    src = random_pool(sp, 64)
    b1 = shared_batch(src, list(range(500, 516)), [[1] * 8])
    cfg = _cfg(s3_server, f"two-{tmp_path.name}")
    async with await open_store(cfg) as a, await open_store(cfg) as b:
        await a.put(src, b1.tokens, b1.tables)
        await a.flush()

        async def b_has() -> bool:
            return (await b.lookup(sp, b1.tokens)) == [24]

        await _until(b_has)
        assert await _delivers(b, sp, src, b1) == 24
        assert await a.put_object("shared-object", b"x" * 1000)

        async def b_finds() -> bool:
            return await b.object_size("shared-object") is not None

        await _until(b_finds)
        assert await b.get_object("shared-object") == memoryview(b"x" * 1000)
        await b.delete_object("shared-object")

        async def a_lost() -> bool:
            await a.sync()
            return a.stats()["tiers"]["s3"]["objects"] == 3  # the segment's only

        await _until(a_lost)
        assert await a.get_object("shared-object") is None


async def test_three_stores_on_one_prefix_each_serve_all_three_prompts(
    s3_server: SeaweedProc, tmp_path: Path
) -> None:
    sp = spec(num_layers=2)
    src = random_pool(sp, 128)
    batches = [shared_batch(src, list(range(100 * g, 100 * g + 16)), [[g] * 8]) for g in (1, 2, 3)]
    cfg = _cfg(s3_server, f"three-{tmp_path.name}")
    async with (
        await open_store(cfg) as s1,
        await open_store(cfg) as s2,
        await open_store(cfg) as s3,
    ):
        stores = [s1, s2, s3]
        await asyncio.gather(
            *(s.put(src, b.tokens, b.tables) for s, b in zip(stores, batches, strict=True))
        )
        for s in stores:
            await s.flush()
        for s in stores:
            for b in batches:

                async def seen(s: TieredStore = s, b: Any = b) -> bool:
                    return (await s.lookup(sp, b.tokens)) == [24]

                await _until(seen)
                assert await _delivers(s, sp, src, b) == 24


WRITER = textwrap.dedent(
    """
    import asyncio, json, os, signal, sys, time
    from pathlib import Path
    from hurray_store.store import open_store
    from hurray_store.tiers.s3 import S3Tier
    from tests.store_helpers import random_pool, shared_batch, spec

    cfg, mode, marker = json.loads(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    real_put = S3Tier.put

    async def put(self, key, buffers):
        if key.endswith("/m"):  # the commit point: the layers are up
            marker.write_text("layers written")
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            await asyncio.sleep(4.0)  # a slow upload: another store opens meanwhile
        return await real_put(self, key, buffers)

    S3Tier.put = put

    async def main():
        sp = spec(num_layers=2)
        src = random_pool(sp, 64)
        b = shared_batch(src, list(range(500, 516)), [[1] * 8])
        async with await open_store(cfg) as store:
            await store.put(src, b.tokens, b.tables)
            await store.flush()

    asyncio.run(main())
    """
)


def _writer(cfg: dict[str, Any], mode: str, marker: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, json.dumps(cfg), mode, str(marker)],
        cwd=ROOT,
        stderr=subprocess.PIPE,
    )


def _wait_for(marker: Path, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
        assert time.monotonic() < deadline
        time.sleep(0.02)


async def test_a_store_opening_while_another_uploads_sweeps_nothing_of_it(
    s3_server: SeaweedProc, tmp_path: Path
) -> None:
    """A writer process has put its layer objects and is slow to put the manifest; a
    store opens meanwhile: it keeps those objects (they are young), then reads the commit
    and delivers every page (it used to delete them, and the writer then committed a
    manifest without layers: lookup 24, retrieve 0)."""
    sp = spec(num_layers=2)
    src = random_pool(sp, 64)
    b = shared_batch(src, list(range(500, 516)), [[1] * 8])
    cfg = _cfg(s3_server, f"upload-{tmp_path.name}")
    marker = tmp_path / "marker"
    proc = _writer(cfg, "slow", marker)
    try:
        _wait_for(marker, proc)
        async with await open_store(cfg) as store:
            assert await store.lookup(sp, b.tokens) == [0], "nothing committed yet"
            assert len(_objects(s3_server, f"upload-{tmp_path.name}")) == 2, "layers kept"
            assert proc.wait(timeout=60) == 0

            async def seen() -> bool:
                return (await store.lookup(sp, b.tokens)) == [24]

            await _until(seen)
            assert await _delivers(store, sp, src, b) == 24
    finally:
        proc.kill()


async def test_a_writer_killed_mid_put_leaves_nothing_promised(
    s3_server: SeaweedProc, tmp_path: Path
) -> None:
    """SIGKILL between the layers and the manifest: a store opening then promises
    nothing and keeps the young layer objects; one opening once they are older than
    ``orphan_age_s`` deletes them."""
    sp = spec(num_layers=2)
    b = shared_batch(random_pool(sp, 64), list(range(500, 516)), [[1] * 8])
    prefix = f"killed-{tmp_path.name}"
    cfg = _cfg(s3_server, prefix)
    marker = tmp_path / "marker"
    proc = _writer(cfg, "kill", marker)
    assert proc.wait(timeout=60) == -9
    async with await open_store(cfg) as store:
        assert await store.lookup(sp, b.tokens) == [0]
    assert len(_objects(s3_server, prefix)) == 2, "young: another store may be writing them"
    async with await open_store(_cfg(s3_server, prefix, orphan_age_s=0.0)) as store:
        assert await store.lookup(sp, b.tokens) == [0]
    assert _objects(s3_server, prefix) == [], "old uncommitted objects are deleted"


async def test_a_manifest_waits_for_its_layers_to_be_confirmed(
    s3_server: SeaweedProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layer object deleted from the bucket (as another store's sweep would) while the
    segment's other layer goes up: the HEADs before the commit see it gone, the manifest
    is not written, and no store ever promises the segment."""
    sp = spec(num_layers=2)
    src = random_pool(sp, 64)
    b = shared_batch(src, list(range(500, 516)), [[1] * 8])
    cfg = _cfg(s3_server, f"confirm-{tmp_path.name}")
    real_put = S3Tier.put

    async def put(self: S3Tier, key: str, buffers: Any) -> bool:
        ok = await real_put(self, key, buffers)
        if key.endswith("/1"):  # the last layer is up: layer 0 is swept under it
            await asyncio.sleep(0.3)
            await obstore.delete_async(self.store, self.path(key[:-1] + "0"))
        return ok

    async with await open_store(cfg) as store:
        monkeypatch.setattr(S3Tier, "put", put)
        await store.put(src, b.tokens, b.tables)
        await store.flush()
        monkeypatch.undo()
        assert await store.lookup(sp, b.tokens) == [0]
    assert _objects(s3_server, f"confirm-{tmp_path.name}") == [], "the group's objects undone"
    async with await open_store(cfg) as fresh:
        assert await fresh.lookup(sp, b.tokens) == [0]


async def test_a_slow_change_log_list_never_marks_the_tier_unreachable(
    s3_server: SeaweedProc, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A change-log poll has its own limit: every LIST here runs past it (the limit set
    below any LIST's time, as a busy machine makes a LIST slower than a request's
    timeout). The polls fail quietly (one INFO line), the tier stays available, and a
    put and a retrieve right after are served (they used to miss for the backoff)."""
    sp = spec(num_layers=2)
    src = random_pool(sp, 64)
    b1 = shared_batch(src, list(range(700, 716)), [[1] * 8])
    cfg = _cfg(s3_server, f"slow-{tmp_path.name}", change_poll_timeout_s=1e-6)
    async with await open_store(cfg) as store:
        with caplog.at_level(logging.INFO, logger="hurray_store.tiers.outage"):
            t = store.tiers[0]
            assert isinstance(t, S3Tier)
            for _ in range(3):
                await t.poll()  # a poll now, as the poller makes every 0.1 s
            await asyncio.sleep(0.3)
        assert store.stats()["tiers"]["s3"]["available"]
        assert "unreachable" not in caplog.text
        assert caplog.text.count("LIST (change log) did not finish") == 1, caplog.text
        await store.put(src, b1.tokens, b1.tables)
        await store.flush()
        assert await _delivers(store, sp, src, b1) == 24
