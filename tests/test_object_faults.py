"""Faults of one object are that object's, on S3 and Redis (the disk folder's are in
tests/test_hostile_folder.py): a truncated object (S3's 416 and short reads), a deleted
one (404), a value of the wrong type, and a large whole-object GET on a short
``timeout_s`` (its timeout scales with its size). Each is a miss for that object alone;
the tier stays up and every other prompt is served. A real SeaweedFS S3 endpoint and
redis-server on loopback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import obstore
import pytest
import redis

from hurray_store import PagedKVPool
from hurray_store.config import load_config
from hurray_store.store import open_store
from hurray_store.testing.services import SeaweedProc
from hurray_store.tiers import helpers
from hurray_store.tiers.s3 import S3Tier, object_fault
from tests.store_helpers import assert_pages_equal, random_pool, shared_batch, spec


class Bucket:
    """Damage done to one stored object behind the tier's back, on S3 or Redis."""

    def __init__(self, t: Any, redis_url: str | None) -> None:
        self.t = t
        self.r = None if redis_url is None else redis.Redis.from_url(redis_url)

    def read(self, key: str) -> bytes:
        if self.r is not None:
            return bytes(self.r.get(self.t.prefix + key) or b"")
        return bytes(obstore.get(self.t.store, self.t.path(key)).bytes())

    def write(self, key: str, data: bytes) -> None:
        if self.r is not None:
            self.r.set(self.t.prefix + key, data)
        else:
            obstore.put(self.t.store, self.t.path(key), data)

    def delete(self, key: str) -> None:
        if self.r is not None:
            self.r.delete(self.t.prefix + key)
        else:
            obstore.delete(self.t.store, self.t.path(key))

    def wrong_type(self, key: str) -> None:
        """Redis only: a list where the value was (GETRANGE answers WRONGTYPE)."""
        assert self.r is not None
        self.r.delete(self.t.prefix + key)
        self.r.rpush(self.t.prefix + key, b"not a value")


FAULTS = {
    "truncated-empty": lambda b, k: b.write(k, b""),
    "truncated-to-its-head": lambda b, k: b.write(k, b.read(k)[:100]),
    "truncated-to-half": lambda b, k: b.write(k, b.read(k)[: len(b.read(k)) // 2]),
    "deleted": lambda b, k: b.delete(k),
    "wrong-type": lambda b, k: b.wrong_type(k),
}
CASES = [
    pytest.param(service, fault, id=f"{service}-{fault}")
    for service in ("s3", "redis")
    for fault in FAULTS
    if service == "redis" or fault != "wrong-type"
]


@pytest.mark.parametrize("service, fault", CASES)
async def test_one_bad_object_is_a_miss_and_the_tier_stays_up(
    service: str, fault: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A layer object of one segment damaged behind the store's back while the store
    holds it in its ledger: retrieving that prompt delivers nothing wrong, its segment
    leaves the ledger, the tier stays available, and another prompt is served every time
    (the S3 tier used to take a 416 for an outage and miss everything for its backoff,
    over and over)."""
    if service == "s3":
        entry = request.getfixturevalue("s3_server").tier(f"fault-{tmp_path.name}")
        url = None
    else:
        url = request.getfixturevalue("redis_server").url
        entry = {"type": "redis", "url": url, "key_prefix": f"{tmp_path.name}:"}
    sp = spec(num_layers=2)
    src = random_pool(sp, 64)
    bad = shared_batch(src, list(range(500, 516)), [[1] * 8])
    good = shared_batch(src, list(range(700, 716)), [[2] * 8])
    async with await open_store({"tiers": [{**entry, "name": service, "timeout_s": 2.0}]}) as store:
        await store.put(src, bad.tokens, bad.tables)
        (seg,) = store.catalog.segments()
        m = store.catalog.cached_manifest(seg)
        await store.put(src, good.tokens, good.tables)
        await store.flush()
        FAULTS[fault](Bucket(store.tiers[0], url), m.layers[1].key)
        dst = PagedKVPool(sp, 64)
        got = await store.retrieve(dst, bad.tokens)
        assert got.num_tokens[0] < 24, "the damaged layer's pages are not delivered"
        assert_pages_equal(src, bad.tables, dst, got.block_tables, got.num_tokens)
        assert store.stats()["tiers"][service]["available"], "one object's fault is no outage"
        assert await store.lookup(sp, bad.tokens) == [0], "its segment left the ledger"
        for _ in range(20):
            dst = PagedKVPool(sp, 64)
            got = await store.retrieve(dst, good.tokens)
            assert got.num_tokens == [24]
            assert_pages_equal(src, good.tables, dst, got.block_tables, got.num_tokens)
        assert store.stats()["tiers"][service]["available"]


async def test_a_range_past_the_end_is_an_object_fault_not_an_outage(
    s3_server: SeaweedProc, tmp_path: Path
) -> None:
    """The tier's own calls: a ranged GET past the end of an object (HTTP 416) and one
    that runs over it (a short read) are misses; the endpoint stays up."""
    cfg = load_config({"tiers": [s3_server.tier(f"range-{tmp_path.name}")]}, env={}).tiers[0]
    t = S3Tier(cfg)  # type: ignore[arg-type]
    await t.open()
    assert await t.put("o", [b"x" * 100])
    assert await t.get_ranges("o", [(200, 10)]) is None
    assert await t.get_ranges("o", [(50, 100)]) is None
    assert t.available and await t.get_ranges("o", [(10, 5)]) == [memoryview(b"x" * 5)]
    try:
        await obstore.get_ranges_async(t.store, t.path("o"), starts=[200], lengths=[10])
    except Exception as e:
        assert object_fault(e), e
    else:
        raise AssertionError("SeaweedFS served a range past the end")


def test_a_transfers_timeout_grows_with_its_size() -> None:
    """The rule: the base timeout plus one second per ``TRANSFER_BYTES_PER_S`` moved."""
    assert helpers.transfer_timeout_s(0.2, 0) == 0.2
    assert helpers.transfer_timeout_s(0.2, int(helpers.TRANSFER_BYTES_PER_S * 3)) == 3.2


async def test_a_whole_get_is_timed_by_its_size(
    s3_server: SeaweedProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """256 MiB on a tier whose ``timeout_s`` is 0.2 s (less than the transfer takes on
    loopback): the GET is given 0.2 s plus a time for its size once its head says the
    size, and returns the whole object; the tier stays up. The rate the budget allows
    for is set to 1 MB/s here (256 s for this object), so the check does not depend on
    how fast a loaded machine moves it (at the shipped 50 MB/s a busy CI machine once
    took longer)."""
    monkeypatch.setattr(helpers, "TRANSFER_BYTES_PER_S", 1e6)
    entry = s3_server.tier(f"big-{tmp_path.name}", timeout_s=0.2)
    cfg = load_config({"tiers": [entry]}, env={}).tiers[0]
    t = S3Tier(cfg)  # type: ignore[arg-type]
    await t.open()
    data = bytes(range(256)) * (1 << 20)
    assert await t.put("big", [data])
    got = await t.get("big")
    assert got is not None and bytes(got) == data
    assert t.available
