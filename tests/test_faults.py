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
from hurray_store.store import open_store
from hurray_store.testing.services import RedisProc, SeaweedProc
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


@pytest.mark.parametrize("service", ["redis", "s3"])
async def test_a_service_killed_mid_run_degrades_to_misses_and_recovers(
    service: str, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis or the S3 endpoint killed while the store runs: puts and retrieves go on
    (the cpu tier serves), one warning; once it is back, writes to it resume."""
    sp = spec()
    src = random_pool(sp, 512)
    outage = {"timeout_s": 0.5, "backoff_initial_s": 0.05, "backoff_max_s": 0.1}
    proc: RedisProc | SeaweedProc
    if service == "redis":
        proc = request.getfixturevalue("redis_fresh")
        lower: dict[str, Any] = {"type": "redis", "url": proc.url, "name": service, **outage}
    else:
        proc = request.getfixturevalue("s3_fresh")
        lower = proc.tier("killed", name=service, **outage)
    cfg = {"tiers": [{"type": "cpu", "capacity_bytes": 1 << 30}, lower]}
    batches = [shared_batch(src, [g] * 16, [[g] * 4]) for g in range(4)]
    async with await open_store(cfg) as store:
        await store.put(src, batches[0].tokens, batches[0].tables)
        await store.flush()
        assert store.stats()["tiers"][service]["objects"] == 4
        proc.stop()
        with caplog.at_level(logging.WARNING):
            await store.put(src, batches[1].tokens, batches[1].tables)  # no exception
            await store.flush()
            got = await store.retrieve(PagedKVPool(sp, 16), batches[1].tokens)
            assert got.num_tokens == [20]  # the cpu tier keeps serving
        st = store.stats()["tiers"][service]
        assert st["skipped_writes"] >= 1 and not st["available"]
        assert caplog.text.count("unreachable") == 1
        proc.start()
        with caplog.at_level(logging.WARNING):
            for i in range(200):  # the backoff is at most 0.1 s: the probe comes soon
                await asyncio.sleep(0.02)
                b = shared_batch(src, [100 + i] * 16, [[]])
                await store.put(src, b.tokens, b.tables)
                await store.flush()
                if store.stats()["tiers"][service]["available"]:
                    break
        assert "reachable again" in caplog.text
        assert store.stats()["tiers"][service]["available"]
        await store.put(src, batches[3].tokens, batches[3].tables)
        await store.flush()
    # A store with only that tier (nothing in memory) finds what was written after the
    # outage; on S3 also what was written before it (the test Redis persists nothing).
    async with await open_store({"tiers": [lower]}) as fresh:
        assert await fresh.lookup(sp, batches[3].tokens) == [20], "writes resumed"
        if service == "s3":
            assert await fresh.lookup(sp, batches[0].tokens) == [20]
        dst = PagedKVPool(sp, 16)
        got = await fresh.retrieve(dst, batches[3].tokens)
        assert_pages_equal(src, batches[3].tables, dst, got.block_tables, got.num_tokens)


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


async def test_corrupt_layer_object_on_s3_is_a_miss_quarantined_and_counted(
    s3_server: SeaweedProc, tmp_path: Path
) -> None:
    """One byte flipped in a layer object in the bucket: the pages before it are
    delivered, the object moves to quarantine/, and no restart finds the segment."""
    import obstore

    sp = spec(num_layers=2)
    src = random_pool(sp)
    b = shared_batch(src, PREFIX, [[1] * 8])  # 6 pages, one segment
    cfg = {"tiers": [s3_server.tier(f"corrupt-{tmp_path.name}")]}
    async with await open_store(cfg) as store:
        await store.put(src, b.tokens, b.tables)
        (seg,) = store.catalog.segments()
        m = store.catalog.cached_manifest(seg)
        t: Any = store.tiers[0]
    key = m.layers[1].key
    raw = bytearray(bytes(obstore.get(t.store, t.path(key)).bytes()))
    raw[m.layers[1].key_pool_offset + 3 * m.page_bytes + 5] ^= 0xFF  # page 3's keys
    obstore.put(t.store, t.path(key), bytes(raw))
    async with await open_store(cfg) as store:
        dst = PagedKVPool(sp, 16)
        got = await store.retrieve(dst, b.tokens)
        assert got.num_tokens == [12]  # pages 0-2 delivered, a miss from page 3 on
        assert_pages_equal(src, b.tables, dst, got.block_tables, got.num_tokens)
        stats = store.stats()
        assert stats["tiers"]["s3"]["verification_failures"] == 1 and stats["segments"] == 0
        await store.flush()
    q = bytes(obstore.get(t.store, t.quarantined + key).bytes())
    assert q == bytes(raw), "the corrupt object is kept in quarantine/"
    async with await open_store(cfg) as store:
        assert await store.lookup(sp, b.tokens) == [0]


async def test_writer_killed_between_layers_and_manifest_leaves_no_segment(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import asyncio, os, signal
        from hurray_store.store import open_store
        from hurray_store.tiers.disk import DiskTier
        from tests.store_helpers import random_pool, shared_batch, spec

        real_put = DiskTier._put_sync
        def put_then_die(self, key, buffers, nbytes=None):
            if key.endswith("/m"):          # the commit point: die just before it
                os.kill(os.getpid(), signal.SIGKILL)
            return real_put(self, key, buffers, nbytes)
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
            for g in range(5):  # more saves lost: counted, warned about once per 10 s
                more = shared_batch(src, [80 + g] * 64, [[]])
                assert (await store.put(src, more.tokens, more.tables)).pages_not_stored == 16
        assert r.pages_written == 0 and r.pages_not_stored == 16
        assert caplog.text.count("stored in no tier") == 1, caplog.text
        assert store.stats()["tiers"]["disk"]["objects"] == 8  # nothing was evicted for it
        lost = store.stats()["not_stored"]
        assert lost["groups"] == 6 and lost["bytes"] > 6 * 3 * one  # 16 pages each, 4 in one


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


@pytest.mark.parametrize("backend", ["disk", "redis", "s3"])
async def test_restart_finds_every_committed_segment(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    sp = spec()
    src = random_pool(sp, 1024)
    if backend == "disk":
        lower = {"type": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 30}
    elif backend == "redis":
        r: RedisProc = request.getfixturevalue("redis_fresh")
        lower = {"type": "redis", "url": r.url}
    else:
        s3: SeaweedProc = request.getfixturevalue("s3_server")
        lower = s3.tier(f"restart-{tmp_path.name}")
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
    from hurray_store.testing.services import free_port

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
        assert store.stats()["moves"]["budget_lowered"]["disk"]["groups"] >= 1


@pytest.mark.parametrize("medium", ["disk", "redis", "s3"])
async def test_an_object_lost_behind_the_stores_back_is_healed_on_read(
    medium: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A layer object removed by someone else (Redis eviction, another process's cleanup
    of a shared folder): the retrieve that finds it gone delivers what is left, and the
    segment leaves the index and the ledger, so lookup stops promising it."""
    import redis as redis_py

    sp = spec(num_layers=2)
    src = random_pool(sp)
    b = shared_batch(src, PREFIX, [[1] * 8])
    if medium == "disk":
        tier: dict[str, Any] = {"type": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 30}
    elif medium == "redis":
        redis_server: RedisProc = request.getfixturevalue("redis_server")
        tier = {"type": "redis", "url": redis_server.url, "capacity_bytes": 1 << 30}
    else:
        s3: SeaweedProc = request.getfixturevalue("s3_server")
        tier = s3.tier(f"lost-{tmp_path.name}", capacity_bytes=1 << 30)
    cfg = {"namespace": f"lost-{medium}", "tiers": [tier]}
    async with await open_store(cfg) as store:
        await store.put(src, b.tokens, b.tables)
        (seg,) = store.catalog.segments()
        victim = store.catalog.cached_manifest(seg).layers[1].key
        full = await store.lookup(sp, b.tokens)
        assert full == [24]
        if medium == "disk":
            store.tiers[0].path_of(victim).unlink()  # type: ignore[attr-defined]
        elif medium == "s3":
            import obstore

            t = store.tiers[0]
            obstore.delete(t.store, t.path(victim))  # type: ignore[attr-defined]
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
        assert store.ledger.used_bytes(0) == 0, "the ledger no longer count its other objects"


async def test_a_redis_cluster_master_failover_loses_no_acknowledged_segment(
    redis_cluster_replicated: list[RedisProc],
) -> None:
    """3 masters with a replica each, ``wait_replicas: 1``. A master is killed while puts
    and retrieves run: no exception reaches the caller, every page a retrieve delivers
    is the page put, the store stores and serves again once the replica took over, and
    a fresh store finds every segment whose put was acknowledged, before, during and
    after the failover."""
    nodes = redis_cluster_replicated
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in nodes)
    tier = {
        "type": "redis",
        "url": url,
        "wait_replicas": 1,
        "wait_timeout_s": 1.0,
        "timeout_s": 1.0,
        "backoff_initial_s": 0.05,
        "backoff_max_s": 0.2,
    }
    cfg = {"tiers": [tier]}
    sp = spec()
    src = random_pool(sp, 4096)
    batches = iter(shared_batch(src, [g, g + 1] * 8, [[g] * 4]) for g in range(0, 1200, 2))
    acked: list[Any] = []
    after_failover = 0
    masters = [n for n in nodes if "role:master" in n.cli("info", "replication")]
    victim = masters[0]
    loop = asyncio.get_running_loop()
    async with await open_store(cfg) as store:

        async def put_one() -> bool:
            b = next(batches)
            await store.put(src, b.tokens, b.tables)
            if await store.lookup(sp, b.tokens) == [20]:  # committed: acknowledged
                acked.append(b)
                return True
            return False

        async def check_one(i: int) -> None:
            b = acked[i % len(acked)]
            dst = PagedKVPool(sp, 16)
            got = await store.retrieve(dst, b.tokens)
            assert_pages_equal(src, b.tables, dst, got.block_tables, got.num_tokens)

        for _ in range(20):
            assert await put_one()
        victim.stop()  # SIGKILL
        killed_at = loop.time()
        live = [n for n in nodes if n is not victim]

        def failed_over() -> bool:
            """A replica took the dead master's slots, and the cluster says so."""
            roles = [n.cli("info", "replication") for n in live]
            return sum("role:master" in r for r in roles) == 3 and all(
                "cluster_state:ok" in n.cli("cluster", "info") for n in live
            )

        i = 0
        while after_failover < 20:
            assert loop.time() - killed_at < 60, "the store did not store again after failover"
            i += 1
            ok = await put_one()
            await check_one(i)
            after_failover += ok and (after_failover > 0 or failed_over())
            await asyncio.sleep(0.01)
    async with await open_store(cfg) as fresh:
        for b in acked:
            assert await fresh.lookup(sp, b.tokens) == [20]
            dst = PagedKVPool(sp, 16)
            got = await fresh.retrieve(dst, b.tokens)
            assert got.num_tokens == [20]
            assert_pages_equal(src, b.tables, dst, got.block_tables, got.num_tokens)
