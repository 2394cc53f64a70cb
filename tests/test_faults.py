"""Faults, one test each: Redis killed mid-run, a corrupt layer object, a writer killed
before its manifest, a full disk tier, a manifest that does not match, restarts."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hurray_store import PagedKVPool
from hurray_store.format import Manifest
from hurray_store.keys import page_hashes
from hurray_store.store import open_store
from tests.conftest import RedisProc
from tests.store_helpers import assert_pages_equal, random_pool, shared_batch, spec

PREFIX = list(range(500, 516))


def disk_cfg(path: Path, **extra: Any) -> dict[str, Any]:
    return {"tiers": [{"type": "disk", "path": str(path), "capacity_bytes": 1 << 30}], **extra}


@dataclasses.dataclass
class Stored:
    """One segment put into a disk-only store (and the store closed)."""

    sp: Any
    src: PagedKVPool
    tokens: list[list[int]]
    tables: list[list[int]]
    seg: bytes
    manifest: Manifest
    paths: dict[str, Path]  # layer keys and the manifest key -> files


async def stored_segment(tmp_path: Path, tails: list[list[int]], **spec_kw: Any) -> Stored:
    sp = spec(**spec_kw)
    src = random_pool(sp)
    b = shared_batch(src, PREFIX, tails)
    async with await open_store(disk_cfg(tmp_path)) as store:
        await store.put(src, b.tokens, b.tables)
        (seg,) = store.catalog.segments()
        keys = [lay.key for lay in store.catalog.cached_manifest(seg).layers] + [
            store.catalog.key(seg).manifest
        ]
        paths = {k: store.tiers[0].path_of(k) for k in keys}  # type: ignore[attr-defined]
        return Stored(sp, src, b.tokens, b.tables, seg, store.catalog.cached_manifest(seg), paths)


async def test_redis_killed_mid_run_degrades_to_misses_and_recovers(
    redis_fresh: RedisProc, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sp = spec()
    src = random_pool(sp, 512)
    cfg = {
        "tiers": [
            {"type": "cpu", "capacity_bytes": 1 << 30},
            {
                "type": "redis",
                "url": redis_fresh.url,
                "timeout_s": 0.5,
                "backoff_initial_s": 0.05,
                "backoff_max_s": 0.1,
            },
        ]
    }
    batches = [shared_batch(src, [g] * 16, [[g] * 4]) for g in range(4)]
    async with await open_store(cfg) as store:
        await store.put(src, batches[0].tokens, batches[0].tables)
        await store.flush()
        assert store.stats()["tiers"]["redis"]["objects"] == 4
        redis_fresh.stop()
        with caplog.at_level(logging.WARNING):
            await store.put(src, batches[1].tokens, batches[1].tables)  # no exception
            await store.flush()
            got = await store.retrieve(PagedKVPool(sp, 16), batches[1].tokens)
            assert got.num_tokens == [20]  # the cpu tier keeps serving
        st = store.stats()["tiers"]["redis"]
        assert st["skipped_writes"] >= 1 and not st["available"]
        assert caplog.text.count("unreachable") == 1
        redis_fresh.start()
        with caplog.at_level(logging.WARNING):
            for i in range(200):  # the backoff is at most 0.1 s: the probe comes soon
                await asyncio.sleep(0.02)
                b = shared_batch(src, [100 + i] * 16, [[]])
                await store.put(src, b.tokens, b.tables)
                await store.flush()
                if store.stats()["tiers"]["redis"]["available"]:
                    break
        assert "reachable again" in caplog.text
        assert store.stats()["tiers"]["redis"]["available"]
        await store.put(src, batches[3].tokens, batches[3].tables)
        await store.flush()
        (seg3,) = store.catalog.longest_prefix(page_hashes(sp, batches[3].tokens[0])).segment_ids[
            :1
        ]
        keys = redis_fresh.cli("--scan", "--pattern", "hurray:*").split()
        assert f"hurray:{store.catalog.key(seg3).manifest}" in keys, (
            "writes resumed after Redis came back"
        )


async def test_corrupt_layer_object_on_disk_is_a_miss_quarantined_and_counted(
    tmp_path: Path,
) -> None:
    st = await stored_segment(tmp_path, [[1] * 8], num_layers=2)  # 6 pages, one segment
    m, sp, b = st.manifest, st.sp, st
    path = st.paths[m.layers[1].key]
    # Flip one byte inside page 3's keys of layer 1.
    raw = bytearray(path.read_bytes())
    raw[m.layers[1].key_pool_offset + 3 * m.page_bytes + 5] ^= 0xFF
    path.write_bytes(bytes(raw))
    async with await open_store(disk_cfg(tmp_path)) as store:
        dst = PagedKVPool(sp, 16)
        got = await store.retrieve(dst, b.tokens)
        assert got.num_tokens == [12]  # pages 0-2 delivered, a miss from page 3 on
        assert_pages_equal(st.src, b.tables, dst, got.block_tables, got.num_tokens)
        assert dst.num_free == 16 - 3
        stats = store.stats()
        assert stats["tiers"]["disk"]["verification_failures"] == 1 and stats["segments"] == 0
        await store.flush()
    assert [p.name.split(".")[0] for p in (tmp_path / "quarantine").iterdir()] == [
        path.name.split(".")[0]
    ]
    assert not path.exists()
    async with await open_store(disk_cfg(tmp_path)) as store:
        assert await store.lookup(sp, b.tokens) == [0]


async def test_writer_killed_between_layers_and_manifest_leaves_no_segment(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import asyncio, os, signal
        from hurray_store.store import open_store
        from hurray_store.tiers.disk import DiskTier
        from tests.store_helpers import random_pool, shared_batch, spec

        real_put = DiskTier._put_sync
        def put_then_die(self, key, buffers):
            if key.endswith("/m"):          # the commit point: die just before it
                os.kill(os.getpid(), signal.SIGKILL)
            return real_put(self, key, buffers)
        DiskTier._put_sync = put_then_die

        async def main():
            sp = spec()
            src = random_pool(sp)
            b = shared_batch(src, list(range(500, 516)), [[1] * 8])
            disk = {{"type": "disk", "path": {str(tmp_path)!r}, "capacity_bytes": 1 << 30}}
            store = await open_store({{"tiers": [disk]}})
            await store.put(src, b.tokens, b.tables)
        asyncio.run(main())
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    left = [p for p in (tmp_path / "objects").rglob("*") if p.is_file()]
    assert len(left) == 3  # three layer objects, no manifest
    sp = spec()
    async with await open_store(disk_cfg(tmp_path)) as store:
        assert store.stats()["segments"] == 0
        assert await store.lookup(sp, [PREFIX + [1] * 8]) == [0]
    assert not [p for p in (tmp_path / "objects").rglob("*") if p.is_file()], "leftovers cleaned"


async def test_full_disk_tier_evicts_and_refuses_what_never_fits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sp = spec()
    src = random_pool(sp, 512)
    batches = [shared_batch(src, [g] * 16, [[]]) for g in range(5)]
    async with await open_store(disk_cfg(tmp_path / "probe")) as probe:
        one = (await probe.put(src, batches[0].tokens, batches[0].tables)).bytes_per_tier["disk"]
    cfg = {"tiers": [{"type": "disk", "path": str(tmp_path / "d"), "capacity_bytes": 2 * one + 10}]}
    async with await open_store(cfg) as store:
        for b in batches:
            assert (await store.put(src, b.tokens, b.tables)).pages_written == 4
        st = store.stats()["tiers"]["disk"]
        assert st["evictions"] == 3 * 4 and st["objects"] == 2 * 4 and st["bytes"] <= 2 * one + 10
        assert [await store.lookup(sp, b.tokens) for b in batches] == [[0], [0], [0], [16], [16]]
        files = [p for p in (tmp_path / "d/objects").rglob("*") if p.is_file()]
        assert len(files) == 8 and sum(p.stat().st_size for p in files) == st["bytes"]
        big = shared_batch(src, [77] * 64, [[]])  # 16 pages: larger than the whole budget
        with caplog.at_level(logging.WARNING):
            r = await store.put(src, big.tokens, big.tables)
        assert r.pages_written == 0 and "stored in no tier" in caplog.text
        assert store.stats()["tiers"]["disk"]["objects"] == 8  # nothing was evicted for it


@pytest.mark.parametrize("what", ["fingerprint", "token_ids"])
async def test_manifest_that_does_not_match_is_a_miss(tmp_path: Path, what: str) -> None:
    st = await stored_segment(tmp_path, [[]])
    m = st.manifest
    if what == "fingerprint":
        bad = dataclasses.replace(m, fingerprint=b"\x01" * 32)
    else:
        s0 = m.sequences[0]
        toks = list(s0.token_ids)
        toks[5] += 1
        bad = dataclasses.replace(m, sequences=(dataclasses.replace(s0, token_ids=tuple(toks)),))
    st.paths[list(st.paths)[-1]].write_bytes(bad.to_bytes())  # well-formed, valid checksum
    async with await open_store(disk_cfg(tmp_path)) as store:
        assert await store.lookup(st.sp, st.tokens) == [16]  # the index alone cannot tell
        dst = PagedKVPool(st.sp, 8)
        got = await store.retrieve(dst, st.tokens)
        assert got.num_tokens == [0] and dst.num_free == 8
        stats = store.stats()
        assert stats["tiers"]["disk"]["verification_failures"] == 1 and stats["segments"] == 0
        assert await store.lookup(st.sp, st.tokens) == [0]


async def test_a_manifest_with_a_bad_checksum_is_quarantined_at_open(tmp_path: Path) -> None:
    st = await stored_segment(tmp_path, [[]])
    mpath = st.paths[list(st.paths)[-1]]
    raw = bytearray(mpath.read_bytes())
    raw[40] ^= 1
    mpath.write_bytes(bytes(raw))
    async with await open_store(disk_cfg(tmp_path)) as store:
        assert (
            store.stats()["segments"] == 0
            and store.stats()["tiers"]["disk"]["verification_failures"] == 1
        )
        assert await store.lookup(st.sp, st.tokens) == [0]
    assert len(list((tmp_path / "quarantine").iterdir())) == 1


@pytest.mark.parametrize("backend", ["disk", "redis"])
async def test_restart_finds_every_committed_segment(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    sp = spec()
    src = random_pool(sp, 1024)
    if backend == "disk":
        lower = {"type": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 30}
    else:
        r: RedisProc = request.getfixturevalue("redis_fresh")
        lower = {"type": "redis", "url": r.url}
    cfg = {"tiers": [{"type": "cpu", "capacity_bytes": 1 << 30}, lower]}
    batches = [
        shared_batch(src, [g, g + 1] * 10, [[g] * 7, [g + 3] * 9, []]) for g in range(0, 40, 2)
    ]
    async with await open_store(cfg) as store:
        for b in batches:
            await store.put(src, b.tokens, b.tables)
        n = store.stats()["segments"]
    async with await open_store(cfg) as store:
        assert store.stats()["segments"] == n == 20
        for b in batches:
            dst = PagedKVPool(sp, 32)
            got = await store.retrieve(dst, b.tokens)
            assert got.num_tokens == [24, 28, 20]
            assert_pages_equal(src, b.tables, dst, got.block_tables, got.num_tokens)


async def test_redis_down_at_open_is_a_warning_not_a_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.conftest import free_port

    sp = spec()
    src = random_pool(sp)
    b = shared_batch(src, PREFIX, [[]])
    cfg = {
        "tiers": [
            {"type": "cpu", "capacity_bytes": 1 << 30},
            {"type": "redis", "url": f"redis://127.0.0.1:{free_port()}", "timeout_s": 0.3},
        ]
    }
    with caplog.at_level(logging.WARNING):
        async with await open_store(cfg) as store:
            assert (await store.put(src, b.tokens, b.tables)).pages_written == 4
            assert (await store.retrieve(PagedKVPool(sp, 8), b.tokens)).num_tokens == [16]
    assert "unreachable" in caplog.text


async def test_manifest_bytes_are_what_the_store_parses(tmp_path: Path) -> None:
    # The tests above rewrite manifests with Manifest.to_bytes: that must be the exact
    # encoding the store writes (no hidden framing).
    st = await stored_segment(tmp_path, [[]])
    raw = st.paths[list(st.paths)[-1]].read_bytes()
    assert Manifest.from_bytes(raw).to_bytes() == raw == st.manifest.to_bytes()


async def test_corrupt_descriptor_byte_fails_a_whole_read_and_is_not_promoted(
    tmp_path: Path,
) -> None:
    st = await stored_segment(tmp_path, [[1] * 8], num_layers=2)
    path = st.paths[st.manifest.layers[0].key]
    raw = bytearray(path.read_bytes())
    raw[30] ^= 0x01  # inside the key descriptor: no page checksum covers it
    path.write_bytes(bytes(raw))
    cfg = {"tiers": [{"type": "cpu", "capacity_bytes": 1 << 30}, *disk_cfg(tmp_path)["tiers"]]}
    async with await open_store(cfg) as store:  # cold cpu tier: the segment is read whole
        dst = PagedKVPool(st.sp, 16)
        got = await store.retrieve(dst, st.tokens)
        await store.flush()
        assert got.num_tokens == [0] and dst.num_free == 16
        stats = store.stats()["tiers"]
        assert (
            stats["disk"]["verification_failures"] == 1 and stats["cpu"]["objects"] == 0
        )  # nothing promoted


async def test_object_checksum_is_recomputable_from_the_object_alone(tmp_path: Path) -> None:
    import xxhash

    from hurray_store.format import object_checksum

    st = await stored_segment(tmp_path, [[1] * 8, [2] * 5])
    m = st.manifest
    pb = m.page_bytes
    for pos, lay in enumerate(m.layers):
        raw = st.paths[lay.key].read_bytes()
        ks = [
            xxhash.xxh3_64_intdigest(
                raw[lay.key_pool_offset + p * pb : lay.key_pool_offset + (p + 1) * pb]
            )
            for p in range(m.num_pages)
        ]
        vs = [
            xxhash.xxh3_64_intdigest(
                raw[lay.value_pool_offset + p * pb : lay.value_pool_offset + (p + 1) * pb]
            )
            for p in range(m.num_pages)
        ]
        assert tuple(ks) == lay.key_page_checksums and tuple(vs) == lay.value_page_checksums
        fixed = [raw[o : o + n] for o, n in m.fixed_ranges(pos)]
        assert (
            sum(n for _, n in m.fixed_ranges(pos)) + 2 * m.num_pages * pb
            == lay.object_size
            == len(raw)
        )
        assert object_checksum(fixed, ks, vs) == lay.object_checksum


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB file system (tmpfs), where this machine lets the tests mount one."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small file system here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


async def test_a_disk_that_fills_before_its_budget_evicts_and_keeps_storing(
    small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = {"tiers": [{"type": "disk", "path": str(small_disk), "capacity_bytes": 1 << 30}]}
    blob = bytes(range(256)) * 800  # 200 KiB: five fill the 1 MiB disk
    async with await open_store(cfg) as store:
        with caplog.at_level(logging.WARNING):
            results = [await store.put_object(f"obj/{i}", blob) for i in range(12)]
        assert results == [True] * 12, "every put is stored, the oldest evicted for it"
        assert "that is its budget now" in caplog.text
        got = await store.get_object("obj/11")
        assert got is not None and bytes(got) == blob
        assert await store.get_object("obj/0") is None, "the oldest made room"
        assert store.stats()["tiers"]["disk"]["capacity_bytes"] < 1 << 20


@pytest.mark.parametrize("medium", ["disk", "redis"])
async def test_an_object_lost_behind_the_stores_back_is_healed_on_read(
    medium: str, tmp_path: Path, redis_server: RedisProc
) -> None:
    """A layer object removed by someone else (Redis eviction, another process's cleanup
    of a shared folder): the retrieve that finds it gone delivers what is left, and the
    segment leaves the index and the books, so lookup stops promising it."""
    import redis as redis_py

    sp = spec(num_layers=2)
    src = random_pool(sp)
    b = shared_batch(src, PREFIX, [[1] * 8])
    if medium == "disk":
        tier: dict[str, Any] = {"type": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 30}
    else:
        tier = {"type": "redis", "url": redis_server.url, "capacity_bytes": 1 << 30}
    cfg = {"namespace": f"lost-{medium}", "tiers": [tier]}
    async with await open_store(cfg) as store:
        await store.put(src, b.tokens, b.tables)
        (seg,) = store.catalog.segments()
        victim = store.catalog.cached_manifest(seg).layers[1].key
        full = await store.lookup(sp, b.tokens)
        assert full == [24]
        if medium == "disk":
            store.tiers[0].path_of(victim).unlink()  # type: ignore[attr-defined]
        else:
            r = redis_py.Redis.from_url(redis_server.url)
            assert r.delete(store.tiers[0].prefix + victim) == 1  # type: ignore[attr-defined]
            r.close()
        dst = PagedKVPool(sp, 16)
        got = await store.retrieve(dst, b.tokens)
        assert got.num_tokens == [0], "the segment is the whole prefix: nothing is left"
        assert dst.num_free == 16, "no page of the pool is left claimed"
        assert await store.lookup(sp, b.tokens) == [0], "lookup no longer promises it"
        assert store.stats()["segments"] == 0
        assert store.ledger.used_bytes(0) == 0, "the books no longer count its other objects"
