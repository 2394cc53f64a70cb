"""The tier contract, shipped so that a tier written outside this package can be held
to it: subclass ``TierContract`` (or ``MediumContract``, for a tier whose medium lies
outside the process) in a pytest module, give it a ``tier`` fixture that returns an
opened tier, and every rule the store relies on is tested against it (a miss is None,
writes are whole, ranges exact, batches equal to the primitives, sizes, reads off the
loop or declined; for a medium, what lands in it and what is read from it).
``down_then_back`` checks the outage rules of a tier behind a service. Needs pytest
(the ``test`` extra) and pytest-asyncio in auto mode, as this package's own tests run.
docs/store.md, "Adding a tier", has a worked example.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import struct
from typing import Any

import pytest
import torch
from xxhash import xxh3_64_intdigest as xxh3

from hurray_store.format import checksum
from hurray_store.tiers import (
    NowRead,
    ReadsNow,
    SelfChecked,
    SelfCheckedObject,
    StoredObject,
    Tier,
    Unhashed,
    blob_nbytes,
    host_view,
)


def as_bytes(b: object) -> bytes:
    if isinstance(b, torch.Tensor):
        return bytes(host_view(b.cpu()))
    return bytes(host_view(b))  # type: ignore[arg-type]


async def down_then_back(t: Tier, service: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The outage rules of a tier behind a service: ``service`` stopped, every call is
    a miss or a skipped write, with one warning; started again, writes resume."""
    await t.open()
    assert await t.put("k", [b"v"])
    service.stop()
    with caplog.at_level(logging.WARNING, logger="hurray_store.tiers.outage"):
        for _ in range(5):
            assert await t.get("k") is None
            assert await t.put("k2", [b"v"]) is False
            assert await t.put("k2", [bytes(1 << 20), b"large"]) is False
            assert await t.get_ranges("k", [(0, 1)]) is None
            assert await t.get_ranges("k", [(0, 1 << 20)], [memoryview(bytearray(1 << 20))]) is None
            assert not await t.contains("k")
    assert not t.available
    assert caplog.text.count("unreachable") == 1
    service.start()
    for _ in range(200):
        await asyncio.sleep(0.05)
        if await t.put("k3", [b"back"]):
            break
    got = await t.get("k3")
    assert t.available and got is not None and as_bytes(got) == b"back"
    large = [os.urandom(1 << 20), os.urandom(1000)]
    assert await t.put("k4", large)
    got = await t.get("k4")
    assert got is not None and as_bytes(got) == b"".join(large)
    into = [memoryview(bytearray(1 << 20)), memoryview(bytearray(1000))]
    got_ranges = await t.get_ranges("k4", [(0, 1 << 20), (1 << 20, 1000)], into)
    assert got_ranges is not None and [as_bytes(g) for g in got_ranges] == large


class TierContract:
    """Every tier: a miss is None, writes are whole, ranges are exact."""

    @pytest.fixture
    async def tier(self) -> Tier:  # overridden per tier
        raise NotImplementedError

    async def test_put_get_roundtrip_of_a_buffer_vector(self, tier: Tier) -> None:
        parts: list[bytes | bytearray | memoryview] = [
            b"head",
            memoryview(bytearray(os.urandom(5000))),
            bytearray(b"tail"),
        ]
        assert await tier.put("a/{seg}/0", parts)
        got = await tier.get("a/{seg}/0")
        assert got is not None and as_bytes(got) == b"".join(bytes(p) for p in parts)
        assert blob_nbytes(got) == 5008

    async def test_missing_key_is_none(self, tier: Tier) -> None:
        assert await tier.get("nope") is None
        assert await tier.get_ranges("nope", [(0, 1)]) is None
        assert not await tier.contains("nope")
        assert tier.available, "a missing object says nothing about the service"

    async def test_ranges_are_exact_and_out_of_bounds_is_a_miss(self, tier: Tier) -> None:
        data = bytes(range(256)) * 40
        await tier.put("r", [data])
        got = await tier.get_ranges("r", [(0, 10), (300, 5), (len(data) - 7, 7)])
        assert got is not None
        assert [as_bytes(g) for g in got] == [data[:10], data[300:305], data[-7:]]
        assert await tier.get_ranges("r", [(len(data) - 3, 10)]) is None

    async def test_overwrite_replaces_the_whole_object(self, tier: Tier) -> None:
        await tier.put("o", [b"x" * 1000])
        await tier.put("o", [b"yz"])
        got = await tier.get("o")
        assert got is not None and as_bytes(got) == b"yz"

    async def test_delete_and_contains(self, tier: Tier) -> None:
        await tier.put("d", [b"1"])
        assert await tier.contains("d")
        await tier.delete("d")
        assert not await tier.contains("d")
        assert await tier.get("d") is None
        await tier.delete("d")  # deleting a missing key is not an error

    async def test_batches_match_the_primitives(self, tier: Tier) -> None:
        items = [(f"b{i}", [os.urandom(100 + i)]) for i in range(20)]
        assert await tier.put_many(items) == [True] * 20
        got = await tier.get_many([k for k, _ in items] + ["missing"])
        assert [as_bytes(g) for g in got[:-1]] == [v[0] for _, v in items] and got[-1] is None
        rng = await tier.get_ranges_many(
            [(k, [(1, 3)]) for k, _ in items] + [("missing", [(0, 1)])]
        )
        assert [as_bytes(r[0]) for r in rng[:-1] if r] == [v[0][1:4] for _, v in items] and rng[
            -1
        ] is None
        await tier.delete_many([k for k, _ in items])
        assert await tier.get_many([k for k, _ in items]) == [None] * 20

    async def test_empty_object(self, tier: Tier) -> None:
        assert await tier.put("e", [b""])
        got = await tier.get("e")
        assert got is not None and as_bytes(got) == b""

    async def test_sizes_of_present_absent_and_empty_objects(self, tier: Tier) -> None:
        assert await tier.put("s1", [b"abc", b"de"])
        assert await tier.put("s0", [b""])
        assert await tier.sizes(["s1", "gone", "s0"]) == [5, None, 0]
        assert await tier.sizes([]) == []

    async def test_read_into_now_reads_exact_ranges_off_the_loop_or_declines(
        self, tier: Tier
    ) -> None:
        big = os.urandom(5 << 20)  # past the size a read shares with helper threads
        small = bytes(range(256)) * 4
        assert await tier.put("n/big", [big]) and await tier.put("n/small", [small])
        # A range over 2 MiB (a Redis reads it in pieces, hashing on), an empty one.
        spans = [(0, 1 << 20), (1 << 20, (3 << 20) + 3), (len(big) - 5, 5), (7, 0)]
        reads = [
            NowRead("n/big", spans, [memoryview(bytearray(n)) for _, n in spans], len(big)),
            NowRead("n/small", [(10, 20)], [memoryview(bytearray(20))], len(small)),
            NowRead("n/gone", [(0, 4)], [memoryview(bytearray(4))], 4),
            NowRead("n/small", [(0, 4)], [memoryview(bytearray(4))], len(small) + 1),
            NowRead("n/small", [(len(small) - 2, 4)], [memoryview(bytearray(4))], len(small)),
        ]
        seen: list[tuple[int, int, int]] = []
        # From a thread of its own, as an engine's thread calls it: no event loop there.
        if not tier.offers(ReadsNow):
            return
        assert isinstance(tier, ReadsNow)
        got = await asyncio.to_thread(
            tier.read_into_now, reads, lambda j, i, s: seen.append((j, i, s))
        )
        # Read: the big object (in 3 ranges) and the small one. Declined: an absent key,
        # an object of another size than asked (another process replaced it), a range
        # past its end.
        assert got == [True, True, False, False, False]
        assert [bytes(b) for b in reads[0].buffers] == [big[o : o + n] for o, n in spans]
        assert bytes(reads[1].buffers[0]) == small[10:30]
        # Each range reported once, with the checksum of its bytes, hashed as they came.
        want = [big[o : o + n] for o, n in spans]
        assert sorted(seen) == [(0, i, checksum(b)) for i, b in enumerate(want)] + [
            (1, 0, checksum(small[10:30]))
        ]
        # An ``Unhashed`` callback is told of the same ranges, with no sums taken.
        arrived: list[tuple[int, int]] = []
        again = [
            NowRead(r.key, r.ranges, [memoryview(bytearray(len(b))) for b in r.buffers], r.size)
            for r in reads[:2]
        ]
        assert await asyncio.to_thread(
            tier.read_into_now, again, Unhashed(lambda j, i: arrived.append((j, i)))
        ) == [True, True]
        assert sorted(arrived) == [(0, i) for i in range(len(spans))] + [(1, 0)]
        assert [bytes(b) for b in again[0].buffers] == want
        with pytest.raises(ValueError, match="buffers of other sizes"):
            tier.read_into_now([NowRead("n/small", [(0, 8)], [memoryview(bytearray(4))], 1024)])


class MediumContract(TierContract):
    """Tiers with a medium outside the process (files, a Redis, a cache server): each
    is checked against its medium, read and written around the tier."""

    def raw_put(self, tier: Tier, key: str, data: bytes) -> None:
        raise NotImplementedError

    def raw_get(self, tier: Tier, key: str) -> bytes | None:
        raise NotImplementedError

    async def test_a_put_lands_in_the_medium(self, tier: Tier) -> None:
        parts: list[bytes | bytearray | memoryview] = [
            b"head",
            os.urandom(3000),
            bytearray(b"tail"),
        ]
        assert await tier.put("m/{seg}/0", parts)
        assert self.raw_get(tier, "m/{seg}/0") == b"".join(bytes(p) for p in parts)

    async def test_a_self_checked_object_ends_in_its_parts_sums(self, tier: Tier) -> None:
        # A disk tier hashes the parts on its writer thread as it writes them; the
        # others hash them first. Either way the record (the sums, packed) comes last.
        rnd = random.Random(3)
        parts = [rnd.randbytes(n) for n in (10, 600_000, 3, 2 << 20, 700_000)]
        sum_at = [None, 0, None, 2, 1]
        checked = SelfChecked(
            parts, sum_at, [0, 0, 0], lambda s: [struct.pack("<3Q", *s)], 24, xxh3
        )
        assert await tier.put_group([SelfCheckedObject("m/{checked}/0", checked)])
        want = struct.pack("<3Q", *(xxh3(parts[i]) for i in (1, 4, 3)))
        assert self.raw_get(tier, "m/{checked}/0") == b"".join(parts) + want

    async def test_a_record_of_another_length_stores_nothing(self, tier: Tier) -> None:
        # Small, and large enough that a Redis sends it from a worker thread, hashing
        # as it goes: the record fails after the parts went out.
        for n in (4, 3 << 20):
            parts = [b"abc", os.urandom(n)]
            checked = SelfChecked(parts, [0, None], [0], lambda s: [b"too long"], 3, xxh3)
            with pytest.raises(ValueError, match="not the 3 bytes promised"):
                await tier.put_group([SelfCheckedObject("m/{bad}/0", checked)])
            assert self.raw_get(tier, "m/{bad}/0") is None
            assert [k async for k, _ in tier.scan()] == []
        # The tier still works (a Redis dropped the connection it was sending on).
        assert await tier.put("m/{ok}/0", [b"fine"])
        assert self.raw_get(tier, "m/{ok}/0") == b"fine"

    async def test_reads_what_the_medium_holds(self, tier: Tier) -> None:
        data = os.urandom(4000)
        self.raw_put(tier, "m/raw", data)
        got = await tier.get("m/raw")
        assert got is not None and as_bytes(got) == data
        parts = await tier.get_ranges("m/raw", [(10, 20), (3990, 10)])
        assert parts is not None and [as_bytes(p) for p in parts] == [data[10:30], data[3990:]]
        assert await tier.contains("m/raw")

    async def test_a_group_lands_whole_in_the_medium(self, tier: Tier) -> None:
        objs = [StoredObject(f"grp/{{g}}/{i}", [os.urandom(500 + i)]) for i in range(3)]
        assert await tier.put_group(objs)
        assert [self.raw_get(tier, o.key) for o in objs] == [bytes(o.data[0]) for o in objs]

    async def test_a_delete_leaves_the_medium(self, tier: Tier) -> None:
        self.raw_put(tier, "m/gone", b"x" * 10)
        await tier.delete("m/gone")
        assert self.raw_get(tier, "m/gone") is None
