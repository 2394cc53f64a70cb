"""One shared test class run against every tier (gpu on the CPU device, cpu, disk,
redis, Redis Cluster), then the behaviour only some tiers have."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from hurray_store import transport as tp
from hurray_store.config import (
    CpuTierConfig,
    DiskTierConfig,
    GpuTierConfig,
    RedisTierConfig,
    RemoteTierConfig,
    S3TierConfig,
)
from hurray_store.testing.contract import MediumContract, TierContract, as_bytes, down_then_back
from hurray_store.testing.services import S3_BUCKET, S3_KEY, S3_SECRET, RedisProc, SeaweedProc
from hurray_store.tiers import (
    NowRead,
    StoredObject,
    Tier,
    open_tier,
)
from hurray_store.tiers.redis import RedisTier
from hurray_store.transport import Msg
from tests.server_helpers import Raw, ServerProc

_n = itertools.count()


class TestGpuTier(TierContract):
    @pytest.fixture
    async def tier(self) -> Tier:
        t = open_tier(GpuTierConfig(capacity_bytes=1 << 30, name="gpu", device="cpu"))
        await t.open()
        return t

    async def test_blobs_are_device_tensors(self, tier: Tier) -> None:
        await tier.put("t", [b"abcd"])
        got = await tier.get("t")
        assert (
            isinstance(got, torch.Tensor)
            and got.device == torch.device("cpu")
            and got.dtype == torch.uint8
        )


class TestCpuTier(TierContract):
    @pytest.fixture
    async def tier(self) -> Tier:
        t = open_tier(CpuTierConfig(capacity_bytes=1 << 30, name="cpu"))
        await t.open()
        return t

    async def test_stored_object_does_not_alias_the_callers_buffer(self, tier: Tier) -> None:
        buf = bytearray(b"abc")
        await tier.put("k", [buf])
        buf[:] = b"xyz"
        got = await tier.get("k")
        assert got is not None and as_bytes(got) == b"abc"


class DiskBase(MediumContract):
    fsync = False
    write_threads: int | None = None

    def raw_put(self, tier: Tier, key: str, data: bytes) -> None:
        path = tier.path_of(key)  # type: ignore[attr-defined]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def raw_get(self, tier: Tier, key: str) -> bytes | None:
        path = tier.path_of(key)  # type: ignore[attr-defined]
        return path.read_bytes() if path.exists() else None

    @pytest.fixture
    async def tier(self, tmp_path: Path) -> AsyncIterator[Tier]:
        t = open_tier(
            DiskTierConfig(
                path=str(tmp_path / "disk"),
                capacity_bytes=1 << 30,
                name="disk",
                fsync=self.fsync,
                write_threads=self.write_threads,
            )
        )
        await t.open()
        yield t
        await t.close()


class TestDiskTier(DiskBase):
    async def test_an_object_of_many_buffers_of_every_size_is_written_byte_for_byte(
        self, tier: Tier
    ) -> None:
        # Gathered writes: small buffers gathered (more of them than one writev takes),
        # a large one alone in pieces of at most 8 MiB, empty ones skipped.
        rnd = random.Random(7)
        big = rnd.randbytes((8 << 20) + 5)
        parts = [b"", b"a", b"xyz", big, b"", *(bytes([i % 251]) for i in range(600))]
        parts += [memoryview(rnd.randbytes(100_000)), bytearray(b"tail")]
        whole = b"".join(bytes(p) for p in parts)
        assert await tier.put("many", parts)
        assert self.raw_get(tier, "many") == whole
        got = await tier.get_ranges("many", [(0, 10), ((8 << 20) - 3, 20), (len(whole) - 4, 4)])
        assert got is not None and [as_bytes(g) for g in got] == [
            whole[:10],
            whole[(8 << 20) - 3 : (8 << 20) + 17],
            b"tail",
        ]

    async def test_a_shard_folder_removed_under_the_tier_is_made_again(self, tier: Tier) -> None:
        # The tier remembers the shard folders it has made; one removed by hand since
        # (here the whole objects folder, the tier open) is made again by the next put.
        assert await tier.put("k", [b"one"])
        shutil.rmtree(tier.objects)  # type: ignore[attr-defined]
        assert await tier.put("k", [b"two"])
        assert self.raw_get(tier, "k") == b"two"
        got = await tier.get("k")
        assert got is not None and as_bytes(got) == b"two"

    async def test_keys_with_odd_characters_roundtrip_through_scan(self, tier: Tier) -> None:
        keys = ["ns/s/{ab}/m", "100%/x", "ünï cödé", "a..b", "../escape"]
        for k in keys:
            await tier.put(k, [k.encode()])
        found = {k: n async for k, n in tier.scan()}
        assert found == {k: len(k.encode()) for k in keys}
        assert all(str(tier.path_of(k)).startswith(str(tier.objects)) for k in keys)  # type: ignore[attr-defined]

    async def test_a_key_too_long_for_a_file_name_is_a_skipped_write_and_a_miss(
        self, tier: Tier, caplog: pytest.LogCaptureFixture
    ) -> None:
        key = "ns/o/" + "k" * 300
        with caplog.at_level(logging.WARNING):
            assert await tier.put(key, [b"data"]) is False
        assert "write of" in caplog.text and "at most" in caplog.text
        assert await tier.get(key) is None and await tier.get_ranges(key, [(0, 1)]) is None
        assert not await tier.contains(key)
        await tier.delete(key)
        await tier.quarantine(key)
        assert await tier.put("ns/o/" + "k" * 200, [b"fits"]), "a long key that fits is kept"

    async def test_scan_keeps_the_temp_files_of_a_live_writer(self, tier: Tier) -> None:
        await tier.put("kept", [b"1"])
        shard = tier.path_of("kept").parent  # type: ignore[attr-defined]
        live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            writing = shard / f".tmp.{live.pid}.0.being-written"
            writing.write_bytes(b"partial")
            found = [k async for k, _ in tier.scan()]
            assert found == ["kept"] and writing.exists(), "another process's write is left alone"
        finally:
            live.kill()
            live.wait()
        found = [k async for k, _ in tier.scan()]
        assert not writing.exists(), "removed once its writer is gone"

    async def test_scan_removes_temp_files_of_a_killed_writer(self, tier: Tier) -> None:
        await tier.put("kept", [b"1"])
        shard = tier.path_of("kept").parent  # type: ignore[attr-defined]
        gone = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True,
            text=True,
            check=True,
        )
        leftover = shard / f".tmp.{int(gone.stdout)}.0.half-written"  # its writer exited
        leftover.write_bytes(b"partial")
        found = [k async for k, _ in tier.scan()]
        assert found == ["kept"] and not leftover.exists()

    async def test_quarantine_moves_the_file_aside(self, tier: Tier) -> None:
        await tier.put("bad", [b"corrupt"])
        await tier.quarantine("bad")
        assert not await tier.contains("bad")
        q = list(tier.quarantine_dir.iterdir())  # type: ignore[attr-defined]
        assert len(q) == 1 and q[0].read_bytes() == b"corrupt"

    async def test_a_failed_write_leaves_no_object_and_returns_false(
        self, tier: Tier, caplog: pytest.LogCaptureFixture
    ) -> None:
        # A file where the object's folder goes: its write cannot be made (a folder in
        # the object's own place is moved aside instead: tests/test_hostile_folder.py).
        shard = tier.path_of("blocked").parent  # type: ignore[attr-defined]
        shard.parent.mkdir(parents=True, exist_ok=True)
        shard.write_bytes(b"not a folder")
        with caplog.at_level(logging.WARNING):
            assert await tier.put("blocked", [b"data"]) is False
        assert "write of blocked skipped" in caplog.text
        assert shard.read_bytes() == b"not a folder"
        assert not [p for p in shard.parent.iterdir() if p.name.startswith(".tmp.")]


def test_a_gathered_write_goes_out_before_the_next_buffer_is_taken() -> None:
    # Taking a self-checked object's buffer hashes it (SelfCheckedObject.written): a disk tier hands
    # each list of views to writev as soon as it is full, so no buffer is hashed a list
    # ahead of its write (its bytes would have left the CPU's cache by then). A full
    # list ends on a multiple of 1 MiB in the file, the buffer there cut in two.
    from hurray_store.tiers.files import GATHER as _GATHER
    from hurray_store.tiers.files import pieces as _pieces

    sizes = [133, 512 << 10, 64, 8] * 5 + [3 << 20, 10, 20]  # a chunk's pools, then more
    taken: list[int] = []
    data = [bytes([i % 251]) * n for i, n in enumerate(sizes)]

    def buffers() -> Iterator[bytes]:
        for i, b in enumerate(data):
            taken.append(i)
            yield b

    written = 0
    lists = []
    out = bytearray()
    for views in _pieces(buffers(), _GATHER):
        n = sum(len(v) for v in views)
        lists.append((written, n))
        for v in views:
            out += v
        last = taken[-1]
        if sizes[last] >= _GATHER and written + n < sum(sizes[: last + 1]):
            # the small buffers before a large one go out once it is taken: they never
            # wait for another
            assert written + n == sum(sizes[:last])
        else:
            # the list ends inside the last buffer taken, or at its end: none is taken
            # before the bytes ahead of it are out
            assert sum(sizes[:last]) < written + n <= sum(sizes[: last + 1]), (lists, taken)
        written += n
    assert out == b"".join(data)
    # Gathered lists end on multiples of 1 MiB in the file, but for the ones a large
    # buffer or the end cuts short; the large buffer goes alone.
    small = sum(sizes[:20])
    assert lists[:2] == [(0, _GATHER), (_GATHER, _GATHER)]
    assert lists[2] == (2 * _GATHER, small - 2 * _GATHER)
    assert lists[3:] == [(small, 3 << 20), (small + (3 << 20), 30)]


class TestDiskTierFsync(DiskBase):
    fsync = True


class TestDiskTierOnThreeWriters(DiskBase):
    """``write_threads`` set (here above the default on a small machine)."""

    write_threads = 3

    async def test_writes_take_no_more_threads_than_write_threads(self, tmp_path: Path) -> None:
        own = open_tier(DiskTierConfig(str(tmp_path / "own"), 1 << 30, "own", write_threads=1))
        before = {x.ident for x in threading.enumerate()}

        def ours(kind: str = "") -> list[threading.Thread]:
            return [
                x for x in threading.enumerate() if x.name.startswith(f"hurray-disk-own{kind}_")
            ]

        await own.open()
        data = [os.urandom(3 << 20) for _ in range(8)]
        assert all(await asyncio.gather(*(own.put(f"o/{i}", [d]) for i, d in enumerate(data))))
        assert len(ours("-w")) == 1, "8 writes at once, on one thread"
        got = await asyncio.gather(*(own.get(f"o/{i}") for i in range(8)))
        assert [as_bytes(g) for g in got] == data
        spans = [(0, 1 << 20), (1 << 20, 1 << 20), (2 << 20, 1 << 20)]
        reads = [
            NowRead(f"o/{i}", spans, [memoryview(bytearray(1 << 20)) for _ in spans], 3 << 20)
            for i in range(8)
        ]
        assert await asyncio.to_thread(own.read_into_now, reads) == [True] * 8
        assert [b"".join(bytes(b) for b in r.buffers) for r in reads] == data
        assert len(ours("-w")) == 1 and ours(), "reads on the tier's other pool"
        # The loop's default pool started no thread for the tier: the only one is the
        # one that ran read_into_now above, as an engine's thread would.
        started = [x for x in threading.enumerate() if x.ident not in before]
        assert len([x for x in started if x.name.startswith("asyncio_")]) <= 1
        assert all(x.name.startswith(("hurray-disk-own", "asyncio_")) for x in started)
        await own.close()
        for x in ours() + ours("-w"):
            x.join(timeout=5)
        assert not ours() and not ours("-w"), "close stops the tier's threads"


async def test_a_disk_tier_by_default_leaves_a_core_and_with_fsync_writes_on_more(
    tmp_path: Path,
) -> None:
    # Page-cache writes are CPU: by default one thread fewer than the cores writes them.
    # With fsync, threads mostly wait on the device: as many as Python's default pool.
    cores = os.cpu_count() or 1
    for fsync, want in ((False, max(1, cores - 1)), (True, min(32, cores + 4))):
        name = f"dflt{int(fsync)}"
        t = open_tier(DiskTierConfig(str(tmp_path / name), 1 << 30, name, fsync=fsync))
        await t.open()
        assert t.write_threads == want  # type: ignore[attr-defined]
        # Many writes at once start at most that many threads.
        data = [os.urandom(1 << 20) for _ in range(40)]
        assert all(await asyncio.gather(*(t.put(f"o/{i}", [d]) for i, d in enumerate(data))))
        ours = [x for x in threading.enumerate() if x.name.startswith(f"hurray-disk-{name}-w_")]
        assert 1 <= len(ours) <= want, (fsync, [x.name for x in ours])
        await t.close()


class RedisBase(MediumContract):
    def raw_client(self, tier: Tier) -> redis.Redis | redis.RedisCluster:
        raise NotImplementedError

    def raw_put(self, tier: Tier, key: str, data: bytes) -> None:
        self.raw_client(tier).set(tier.cfg.key_prefix + key, data)

    def raw_get(self, tier: Tier, key: str) -> bytes | None:
        got = self.raw_client(tier).get(tier.cfg.key_prefix + key)
        return None if got is None else bytes(got)  # type: ignore[arg-type]

    @pytest.fixture
    async def tier(self, request: pytest.FixtureRequest) -> Tier:
        cfg = self.config(request)
        t = open_tier(cfg)
        await t.open()
        assert t.available, "the test Redis should be reachable"
        yield t
        await t.close()

    def config(self, request: pytest.FixtureRequest) -> RedisTierConfig:
        raise NotImplementedError

    async def test_a_large_object_of_several_buffers_is_one_value(self, tier: Tier) -> None:
        parts = [os.urandom(700_000), memoryview(os.urandom(600_000)), b"tail"]
        assert await tier.put("big", parts)
        assert self.raw_get(tier, "big") == b"".join(parts)
        got = await tier.get_ranges("big", [(0, 10), (1_299_990, 14)])
        assert got is not None and [as_bytes(g) for g in got] == [
            bytes(parts[0][:10]),
            bytes(parts[1][-10:]) + b"tail",
        ]
        assert await tier.sizes(["big"]) == [1_300_004]
        assert await tier.put("big", [b"small"]) and self.raw_get(tier, "big") == b"small"

    async def test_large_ranged_reads_land_in_the_callers_buffers(self, tier: Tier) -> None:
        data = os.urandom(1_500_000)
        assert await tier.put("rd", [data])
        spans = [(0, 1_000_000), (1_000_000, 499_990), (1_499_990, 10)]

        def bufs(spans: list[tuple[int, int]]) -> list[memoryview]:
            return [memoryview(bytearray(n)) for _, n in spans]

        for _ in range(2):  # the connection stays in step after each read
            into = bufs(spans)
            got = await tier.get_ranges("rd", spans, into)
            assert got is not None
            assert [as_bytes(g) for g in got] == [data[o : o + n] for o, n in spans]
            if not tier.is_cluster:  # type: ignore[attr-defined]  # a single Redis reads in place
                assert all(g is b for g, b in zip(got, into, strict=True))
            # Absent, and a range past the end: misses, with nothing left on the wire.
            assert await tier.get_ranges("nope", spans, bufs(spans)) is None
            past = [(0, 1_000_000), (1_499_000, 2_000)]
            assert await tier.get_ranges("rd", past, bufs(past)) is None
        assert tier.available

    async def test_scan_lists_only_this_prefix(self, tier: Tier) -> None:
        await tier.put("ns/s/{x}/0", [b"12345"])
        await tier.put("ns/o/y", [b"1"])
        found = {k: n async for k, n in tier.scan()}
        assert found == {"ns/s/{x}/0": 5, "ns/o/y": 1}


def _quick_to_fail(r: RedisProc) -> RedisTier:
    """A Redis tier that times out and backs off quickly (outage tests)."""
    return RedisTier(
        RedisTierConfig(
            url=r.url, name="redis", timeout_s=0.5, backoff_initial_s=0.05, backoff_max_s=0.2
        )
    )


class TestRedisTier(RedisBase):
    def raw_client(self, tier: Tier) -> redis.Redis:
        host, port = tier.cfg.url.split("//")[1].split("/")[0].split(":")
        return redis.Redis(host=host, port=int(port))

    def config(self, request: pytest.FixtureRequest) -> RedisTierConfig:
        r: RedisProc = request.getfixturevalue("redis_server")
        return RedisTierConfig(
            url=r.url, name="redis", key_prefix=f"t{next(_n)}-{uuid.uuid4().hex[:6]}:"
        )

    async def test_ttl_is_set_on_every_object(self, redis_server: RedisProc) -> None:
        t = RedisTier(
            RedisTierConfig(url=redis_server.url, name="redis", key_prefix="ttl:", ttl_s=100)
        )
        await t.open()
        await t.put("k", [b"v"])
        await t.put("large", [bytes(1 << 20), b"x"])  # sent without joining its buffers
        ttl = int(redis_server.cli("ttl", "ttl:k").strip())
        ttl_large = int(redis_server.cli("ttl", "ttl:large").strip())
        await t.close()
        assert 0 < ttl <= 100 and 0 < ttl_large <= 100

    async def test_large_sets_take_no_more_threads_than_write_threads(
        self, redis_server: RedisProc
    ) -> None:
        def writers(name: str) -> list[threading.Thread]:
            return [x for x in threading.enumerate() if x.name.startswith(f"redis-io-{name}-w_")]

        cfgs = {
            "w1": RedisTierConfig(
                url=redis_server.url, name="w1", key_prefix="w1:", write_threads=1
            ),
            "w0": RedisTierConfig(url=redis_server.url, name="w0", key_prefix="w0:"),
        }
        for name, cfg in cfgs.items():
            t = RedisTier(cfg)
            await t.open()
            assert t.write_threads == (1 if name == "w1" else 4)  # the default: 4
            data = [os.urandom(2 << 20) for _ in range(8)]
            assert all(await asyncio.gather(*(t.put(f"o/{i}", [d]) for i, d in enumerate(data))))
            got = await asyncio.gather(*(t.get(f"o/{i}") for i in range(8)))
            assert [as_bytes(g) for g in got] == data
            assert 1 <= len(writers(name)) <= t.write_threads
            if name == "w1":
                assert len(writers(name)) == 1, "8 large SETs at once, from one thread"
            await t.close()
            for x in writers(name):
                x.join(timeout=5)
            assert not writers(name), "close stops the tier's threads"

    async def test_password_in_the_url(self, tmp_path: Path) -> None:
        r = RedisProc(tmp_path / "pw", "--requirepass", "s3cret").start()
        try:
            bad = RedisTier(RedisTierConfig(url=f"redis://127.0.0.1:{r.port}/0", name="redis"))
            await bad.open()
            assert await bad.put("k", [b"v"]) is False  # refused without the password
            assert await bad.put("k", [bytes(1 << 20), b"x"]) is False
            big = [memoryview(bytearray(1 << 20))]
            assert await bad.get_ranges("k", [(0, 1 << 20)], big) is None
            await bad.close()
            good = RedisTier(
                RedisTierConfig(url=f"redis://:s3cret@127.0.0.1:{r.port}/0", name="redis")
            )
            await good.open()
            assert await good.put("k", [b"v"]) and await good.get("k") == b"v"
            assert await good.put("k", [bytes(1 << 20), b"x"])
            assert await good.get("k") == bytes(1 << 20) + b"x"
            got = await good.get_ranges("k", [(1, 1 << 20)], big)
            assert got is not None and bytes(big[0]) == bytes((1 << 20) - 1) + b"x"
            await good.close()
        finally:
            r.stop()

    async def test_down_server_is_a_miss_with_one_warning_then_recovers(
        self, redis_fresh: RedisProc, caplog: pytest.LogCaptureFixture
    ) -> None:
        t = _quick_to_fail(redis_fresh)
        await down_then_back(t, redis_fresh, caplog)
        await t.close()

    async def test_reads_off_the_loop_take_one_version_and_stay_in_step(
        self, tier: Tier, redis_server: RedisProc
    ) -> None:
        # Ranges in any order, past the piece size, with bytes between them; the
        # connections stay in step after a key of another type (error replies inside
        # the transaction) and a key replaced by an object of another size.
        obj = os.urandom(5 << 20)
        assert await tier.put("v/a", [obj]) and await tier.put("v/b", [obj[:1000]])
        raw = self.raw_client(tier)
        raw.rpush(tier.k("v/list"), b"x")  # type: ignore[attr-defined]
        spans = [(4096, 3 << 20), (16, 100), ((3 << 20) + 8192, (2 << 20) - 8192 - 64)]

        def reads() -> list[NowRead]:
            bufs = [memoryview(bytearray(n)) for _, n in spans]
            return [
                NowRead("v/a", spans, bufs, len(obj)),
                NowRead("v/list", [(0, 1)], [memoryview(bytearray(1))], 1),
                NowRead("v/b", [(0, 1000)], [memoryview(bytearray(1000))], 2000),
                NowRead("v/b", [(0, 1000)], [memoryview(bytearray(1000))], 1000),
            ]

        for _ in range(3):
            rs = reads()
            got = await asyncio.to_thread(tier.read_into_now, rs)
            assert got == [True, False, False, True]
            assert [bytes(b) for b in rs[0].buffers] == [obj[o : o + n] for o, n in spans]
            assert bytes(rs[3].buffers[0]) == obj[:1000]
        assert tier.available

    async def test_a_read_off_the_loop_in_an_outage_is_a_miss_then_recovers(
        self, redis_fresh: RedisProc, caplog: pytest.LogCaptureFixture
    ) -> None:
        t = _quick_to_fail(redis_fresh)
        await t.open()
        data = os.urandom(3 << 20)
        assert await t.put("k", [data])

        def read() -> tuple[bool, bytes]:
            buf = memoryview(bytearray(len(data)))
            return t.read_into_now([NowRead("k", [(0, len(data))], [buf], len(data))])[0], bytes(
                buf
            )

        assert await asyncio.to_thread(read) == (True, data)
        redis_fresh.stop()
        with caplog.at_level(logging.WARNING, logger="hurray_store.tiers.outage"):
            for _ in range(3):  # the first finds the outage; the rest do not try
                assert (await asyncio.to_thread(read))[0] is False
                assert await t.get("k") is None  # the loop's read: a miss, no new timeout
        assert not t.available and caplog.text.count("unreachable") == 1
        redis_fresh.start()
        # No call probes (none waits on a service that timed out): the tier's background
        # probe sees it back.
        for _ in range(200):
            if t.available:
                break
            await asyncio.sleep(0.05)
        assert t.available and t.outage.probes >= 1
        assert await t.put("k", [data])
        assert await asyncio.to_thread(read) == (True, data)
        await t.close()

    async def test_a_hung_server_costs_one_timeout_then_no_call_waits_until_a_probe_sees_it(
        self, redis_fresh: RedisProc
    ) -> None:
        """A server SIGSTOPped: the first call waits its timeout and starts the outage;
        every later call returns at once (none waits anything near the timeout) while
        the tier's background probe tries it, past several backoffs; resumed, the probe
        ends the outage and the object is read."""
        t = RedisTier(
            RedisTierConfig(
                url=redis_fresh.url,
                name="redis",
                timeout_s=2.0,
                backoff_initial_s=0.05,
                backoff_max_s=0.2,
            )
        )
        await t.open()
        assert await t.put("k", [b"v" * 100])
        redis_fresh.pause()
        try:
            assert await t.get("k") is None  # waits its timeout: the outage starts
            assert not t.available
            longest, calls, end = 0.0, 0, time.monotonic() + 1.0
            while time.monotonic() < end:
                t0 = time.monotonic()
                assert await t.get("k") is None
                assert await t.put("k2", [b"w"]) is False
                longest = max(longest, time.monotonic() - t0)
                calls += 1
                await asyncio.sleep(0.02)
            assert longest < t.cfg.timeout_s / 2, "a call waited on the hung server"
            assert calls > 10 and t.outage.count == 1
        finally:
            redis_fresh.resume()
        for _ in range(200):
            if t.available:
                break
            await asyncio.sleep(0.05)
        assert t.available and t.outage.probes >= 1
        got = await t.get("k")
        assert got is not None and bytes(got) == b"v" * 100
        await t.close()

    async def test_open_with_the_server_down_does_not_raise(self) -> None:
        from hurray_store.testing.services import free_port

        t = RedisTier(
            RedisTierConfig(url=f"redis://127.0.0.1:{free_port()}/0", name="redis", timeout_s=0.3)
        )
        await t.open()
        assert not t.available and await t.get("k") is None
        await t.close()


class TestRedisClusterTier(RedisBase):
    def raw_client(self, tier: Tier) -> redis.RedisCluster:
        host, port = tier.cfg.url.split("//")[1].split(",")[0].split(":")
        return redis.RedisCluster(host=host, port=int(port))

    def config(self, request: pytest.FixtureRequest) -> RedisTierConfig:
        nodes: list[RedisProc] = request.getfixturevalue("redis_cluster")
        url = "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in nodes)
        return RedisTierConfig(
            url=url, name="redis", key_prefix=f"c{next(_n)}-{uuid.uuid4().hex[:6]}:"
        )

    async def test_cluster_flag_with_a_plain_url(self, redis_cluster: list[RedisProc]) -> None:
        t = RedisTier(
            RedisTierConfig(
                url=redis_cluster[1].url.rsplit("/", 1)[0],
                name="redis",
                cluster=True,
                key_prefix="flag:",
            )
        )
        await t.open()
        assert t.is_cluster and t.available
        keys = [f"k{i}" for i in range(50)]  # spread over slots on every master
        assert await t.put_many([(k, [k.encode()]) for k in keys]) == [True] * 50
        assert {k async for k, _ in t.scan()} == set(keys)
        await t.close()


class TestValkeyTier(TestRedisTier):
    """The same tier against a real valkey-server."""

    def config(self, request: pytest.FixtureRequest) -> RedisTierConfig:
        r: RedisProc = request.getfixturevalue("valkey_server")
        return RedisTierConfig(
            url=r.url, name="redis", key_prefix=f"v{next(_n)}-{uuid.uuid4().hex[:6]}:"
        )

    async def test_it_is_valkey(self, valkey_server: RedisProc) -> None:
        assert "valkey_version" in valkey_server.cli("info", "server")


class TestRedisTlsTier(RedisBase):
    """rediss:// against a redis-server that speaks TLS only, its certificate checked
    against the CA the config names."""

    def raw_client(self, tier: Tier) -> redis.Redis:
        return redis.Redis.from_url(tier.cfg.url, ssl_ca_certs=tier.cfg.tls_ca_file)

    def config(self, request: pytest.FixtureRequest) -> RedisTierConfig:
        r: RedisProc = request.getfixturevalue("redis_tls")
        assert r.tls is not None
        return RedisTierConfig(
            url=r.url,
            name="redis",
            key_prefix=f"s{next(_n)}-{uuid.uuid4().hex[:6]}:",
            tls_ca_file=str(r.tls / "ca.pem"),
        )

    async def test_plain_redis_url_to_a_tls_server_is_an_outage(self, redis_tls: RedisProc) -> None:
        t = RedisTier(
            RedisTierConfig(url=f"redis://127.0.0.1:{redis_tls.port}/0", name="r", timeout_s=0.5)
        )
        await t.open()
        assert not t.available and await t.put("k", [b"v"]) is False
        await t.close()

    async def test_a_certificate_from_another_ca_is_one_clear_warning_then_misses(
        self, redis_tls: RedisProc, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        from hurray_store.testing.services import make_certs

        other = make_certs(tmp_path / "other-ca")
        t = RedisTier(
            RedisTierConfig(
                url=redis_tls.url,
                name="redis",
                timeout_s=1.0,
                backoff_initial_s=0.01,
                tls_ca_file=str(other / "ca.pem"),
            )
        )
        with caplog.at_level(logging.WARNING, logger="hurray_store.tiers.outage"):
            await t.open()
            for _ in range(3):
                assert await t.put("k", [b"v"]) is False
                assert await t.get("k") is None and not await t.contains("k")
        assert not t.available
        assert caplog.text.count("unreachable") == 1
        assert "certificate verify failed" in caplog.text, caplog.text
        await t.close()

    def test_a_missing_ca_file_is_a_config_error(
        self, redis_tls: RedisProc, tmp_path: Path
    ) -> None:
        from hurray_store.config import load_config
        from hurray_store.errors import ConfigError

        raw = {"tiers": [{"type": "redis", "url": redis_tls.url, "tls_ca_file": "nope.pem"}]}
        with pytest.raises(ConfigError, match=r"tiers\.redis\.tls_ca_file: no such file"):
            load_config(raw, env={})


async def test_wait_replicas_acknowledges_each_group_or_skips_it(
    redis_replicated: tuple[RedisProc, RedisProc], caplog: pytest.LogCaptureFixture
) -> None:
    """With wait_replicas, a group written counts only once a replica holds it: it is
    on the replica when put_group returns; with the replica gone, the write is skipped
    and nothing of the group stays on the master."""
    master, replica = redis_replicated
    t = RedisTier(
        RedisTierConfig(url=master.url, name="redis", wait_replicas=1, wait_timeout_s=0.3)
    )
    await t.open()
    objs = [StoredObject(f"s/{{g}}/{i}", [os.urandom(1000)]) for i in range(3)]
    assert await t.put_group(objs)
    on_replica = redis.Redis(port=replica.port)
    assert [on_replica.get("hurray:" + o.key) for o in objs] == [bytes(o.data[0]) for o in objs]
    replica.stop()
    lost = [StoredObject(f"s/{{h}}/{i}", [b"x" * 100]) for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="hurray_store.tiers.redis"):
        assert await t.put_group(lost) is False
    assert "0 of 1 replicas acknowledged" in caplog.text
    assert [await t.contains(o.key) for o in lost] == [False] * 3
    assert t.available, "a replica missing is not an outage of the master"
    await t.close()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
class TestGpuTierOnCuda(TierContract):
    @pytest.fixture
    async def tier(self) -> Tier:
        t = open_tier(GpuTierConfig(capacity_bytes=1 << 30, name="gpu", device="cuda:0"))
        await t.open()
        return t


@needs_cuda
class TestPinnedCpuTier(TierContract):
    @pytest.fixture
    async def tier(self) -> Tier:
        t = open_tier(CpuTierConfig(capacity_bytes=1 << 30, name="cpu", pin_memory="true"))
        await t.open()
        return t

    async def test_objects_are_page_locked(self, tier: Tier) -> None:
        await tier.put("p", [b"x" * 100])
        (got,) = await tier.get_ranges("p", [(0, 100)]) or [None]
        assert isinstance(got, torch.Tensor) and got.is_pinned()


async def test_cpu_tier_falls_back_to_the_heap_when_the_arena_is_full() -> None:
    t = open_tier(CpuTierConfig(capacity_bytes=4096, name="cpu"))
    await t.open()
    assert await t.put("a", [b"1" * 4000])
    assert await t.put("b", [b"2" * 4000])  # no arena room left: an ordinary bytes object
    assert as_bytes(await t.get("a")) == b"1" * 4000 and as_bytes(await t.get("b")) == b"2" * 4000
    await t.delete("a")
    assert await t.put("c", [b"3" * 4000])  # the arena space came back
    assert as_bytes(await t.get("c")) == b"3" * 4000


@pytest.fixture(scope="module")
def cache_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    s = ServerProc(tmp_path_factory.mktemp("cache-server"), token="tiers").start()
    yield s
    s.kill()


class TestRemoteTier(MediumContract):
    """The remote tier against a real `hurray-store serve` process; its medium is the
    server's store, reached by a plain Hurray client."""

    def raw_put(self, tier: Tier, key: str, data: bytes) -> None:
        r = self._raw(tier)
        assert r.put(key, data)[0] == Msg.TENSOR_PUT_ACK
        r.close()

    def raw_get(self, tier: Tier, key: str) -> bytes | None:
        r = self._raw(tier)
        try:
            return r.get(key)
        finally:
            r.close()

    def _raw(self, tier: Tier) -> Raw:
        r = Raw(int(tier.cfg.url.rsplit(":", 1)[1]))
        r.hello("tiers")
        return r

    @pytest.fixture
    async def tier(self, cache_server: ServerProc) -> Tier:
        t = open_tier(
            RemoteTierConfig(url=cache_server.url, name="remote", token="tiers", connections=2)
        )
        await t.open()
        assert t.available, "the test server should be reachable"
        yield t
        await t.close()

    async def test_many_requests_in_flight_on_one_connection(
        self, cache_server: ServerProc
    ) -> None:
        t = open_tier(
            RemoteTierConfig(url=cache_server.url, name="remote", token="tiers", connections=1)
        )
        blobs = {f"pipe/{i}": os.urandom(1000 + 37 * i) for i in range(64)}
        assert await t.put_many([(k, [v]) for k, v in blobs.items()]) == [True] * 64
        got = await asyncio.gather(
            *(t.get(k) for k in blobs), *(t.get_ranges(k, [(5, 10)]) for k in blobs)
        )
        assert [as_bytes(g) for g in got[:64]] == list(blobs.values())
        assert [as_bytes(g[0]) for g in got[64:]] == [v[5:15] for v in blobs.values()]
        await t.close()

    async def test_a_segments_layer_objects_wait_for_its_commit(self, tier: Tier) -> None:
        key = "hurray/s/{00ff}/0"
        assert await tier.put(key, [b"layer bytes"])  # staged on the server
        assert not await tier.contains(key) and await tier.get(key) is None
        assert not await tier.put("hurray/s/{00ff}/m", [b"a manifest"]), (
            "a manifest is only sent by its commit"
        )
        group = [
            StoredObject(key, [b"layer bytes"]),
            StoredObject("hurray/s/{00ff}/m", [b"not a manifest"]),
        ]
        assert not await tier.put_group(group), "a bad commit is a skipped write"
        assert await tier.get(key) is None

    async def test_a_lookup_larger_than_the_servers_caps_is_split(self, tier: Tier) -> None:
        seqs = [(0, [i.to_bytes(16, "little")]) for i in range(tp.MAX_LOOKUP_SEQS + 10)]
        got = await tier.lookup_prefix(seqs, claim=False)  # type: ignore[attr-defined]
        assert got == [], "answered (nothing stored), not refused"

    async def test_wrong_token_is_an_outage_not_an_exception(
        self, cache_server: ServerProc, caplog: pytest.LogCaptureFixture
    ) -> None:
        t = open_tier(RemoteTierConfig(url=cache_server.url, name="remote", token="nope"))
        await t.open()
        assert not t.available and await t.get("x") is None and await t.put("x", [b"1"]) is False
        assert "missing or wrong token" in caplog.text
        await t.close()

    async def test_nothing_listening(self) -> None:
        from hurray_store.testing.services import free_port

        t = open_tier(
            RemoteTierConfig(
                url=f"hurray://127.0.0.1:{free_port()}", name="remote", connect_timeout_s=0.5
            )
        )
        await t.open()
        assert not t.available
        assert (
            await t.get("x") is None
            and await t.put("x", [b"1"]) is False
            and not await t.contains("x")
        )
        await t.close()

    async def test_a_namespace_other_than_the_servers_is_named(
        self, cache_server: ServerProc, caplog: pytest.LogCaptureFixture
    ) -> None:
        t = open_tier(
            RemoteTierConfig(url=cache_server.url, name="remote", token="tiers"), "not-hurray"
        )
        await t.open()
        assert "the server's namespace is 'hurray', this store's 'not-hurray'" in caplog.text
        await t.close()


# --------------------------------------------------------------------------- S3


def _s3_tier(server: SeaweedProc, prefix: str, **kw: Any) -> Tier:
    from hurray_store.config.loader import _tiers

    (cfg,) = _tiers([server.tier(prefix, **kw)], "tiers")
    return open_tier(cfg)


class TestS3Tier(MediumContract):
    """An s3 tier against SeaweedFS's S3 gateway, read and written around the tier
    with obstore's own client."""

    def raw_put(self, tier: Tier, key: str, data: bytes) -> None:
        import obstore

        obstore.put(self.raw, tier.path(key), data)  # type: ignore[attr-defined]

    def raw_get(self, tier: Tier, key: str) -> bytes | None:
        import obstore

        try:
            return bytes(obstore.get(self.raw, tier.path(key)).bytes())  # type: ignore[attr-defined]
        except FileNotFoundError:
            return None

    @pytest.fixture
    async def tier(self, s3_server: SeaweedProc) -> Tier:
        self.raw = s3_server.client()
        t = _s3_tier(s3_server, f"t{next(_n)}-{uuid.uuid4().hex[:6]}")
        await t.open()
        assert t.available, "the test S3 should be reachable"
        yield t
        await t.close()

    async def test_keys_with_odd_characters_roundtrip_through_scan(self, tier: Tier) -> None:
        keys = ["ns/s/{ab}/m", "100%/x", "ünï cödé", "a..b", "q?x=1&y#z", "ns/s/{ab}/0"]
        for k in keys:
            assert await tier.put(k, [k.encode()])
        found = {k: n async for k, n in tier.scan()}
        assert found == {k: len(k.encode()) for k in keys}
        assert [as_bytes(await tier.get(k)) for k in keys] == [k.encode() for k in keys]  # type: ignore[arg-type]

    async def test_scan_lists_only_this_prefix_and_not_the_quarantine(
        self, tier: Tier, s3_server: SeaweedProc
    ) -> None:
        other = _s3_tier(s3_server, tier.root + "deeper")  # type: ignore[attr-defined]
        await other.put("x", [b"other"])
        await tier.put("kept", [b"12345"])
        await tier.put("bad", [b"corrupt"])
        await tier.quarantine("bad")
        assert {k: n async for k, n in tier.scan()} == {"kept": 5}
        assert not await tier.contains("bad")
        import obstore

        q = bytes(obstore.get(self.raw, tier.quarantined + "bad").bytes())  # type: ignore[attr-defined]
        assert q == b"corrupt", "a quarantined object is kept aside for a post-mortem"

    async def test_an_object_larger_than_a_part_goes_up_in_parts(
        self, s3_server: SeaweedProc
    ) -> None:
        t = _s3_tier(s3_server, f"mp{next(_n)}", multipart_bytes=5 << 20)
        await t.open()
        parts = [os.urandom(3 << 20), os.urandom(4 << 20), os.urandom(5 << 20)]
        assert await t.put("big", parts)
        whole = b"".join(parts)
        got = await t.get("big")
        assert got is not None and as_bytes(got) == whole
        ranges = [(0, 10), ((5 << 20) - 3, 7), (len(whole) - 5, 5)]
        got_r = await t.get_ranges("big", ranges)
        assert got_r is not None and [as_bytes(p) for p in got_r] == [
            whole[o : o + n] for o, n in ranges
        ]
        await t.close()

    async def test_wrong_credentials_are_one_clear_warning_then_misses(
        self, s3_server: SeaweedProc, caplog: pytest.LogCaptureFixture
    ) -> None:
        t = _s3_tier(s3_server, "creds", secret_access_key="wrong", backoff_initial_s=0.01)
        with caplog.at_level(logging.WARNING, logger="hurray_store.tiers.outage"):
            await t.open()
            assert await t.put("k", [b"v"]) is False
            assert await t.get("k") is None and not await t.contains("k")
        assert not t.available
        assert caplog.text.count("unreachable") == 1
        assert "SignatureDoesNotMatch" in caplog.text or "403" in caplog.text, caplog.text

    async def test_down_endpoint_is_a_miss_with_one_warning_then_recovers(
        self, s3_fresh: SeaweedProc, caplog: pytest.LogCaptureFixture
    ) -> None:
        t = _s3_tier(s3_fresh, "down", timeout_s=1.0, backoff_initial_s=0.05, backoff_max_s=0.2)
        await down_then_back(t, s3_fresh, caplog)
        got = await t.get("k")
        assert got is not None and as_bytes(got) == b"v", "what was stored before is still there"
        await t.close()

    async def test_credentials_and_region_from_the_usual_aws_variables(
        self, s3_server: SeaweedProc, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_KEY)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET)
        monkeypatch.setenv("AWS_REGION", "us-east-1")
        t = open_tier(
            S3TierConfig(url=f"s3://{S3_BUCKET}/env", name="s3", endpoint=s3_server.endpoint)
        )
        await t.open()
        assert await t.put("k", [b"from env"]) and t.available
        got = await t.get("k")
        assert got is not None and as_bytes(got) == b"from env"
        await t.close()

    async def test_open_with_nothing_listening_does_not_raise(self) -> None:
        from hurray_store.testing.services import free_port

        t = open_tier(
            S3TierConfig(
                url="s3://kvcache/x",
                name="s3",
                endpoint=f"http://127.0.0.1:{free_port()}",
                region="us-east-1",
                access_key_id="a",
                secret_access_key="b",
                timeout_s=0.3,
            )
        )
        await t.open()
        assert not t.available and await t.get("k") is None
        await t.close()
