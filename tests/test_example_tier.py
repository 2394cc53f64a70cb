"""The example tier of docs/store.md ("Adding a tier") against the shipped tier
contract, and a store that runs on it."""

from __future__ import annotations

import pytest

from hurray_store import PagedKVPool
from hurray_store.config import StoreConfig
from hurray_store.store import TieredStore
from hurray_store.testing.contract import TierContract
from hurray_store.tiers import Tier, open_tier
from tests.example_tier import DictTier, DictTierConfig
from tests.store_helpers import assert_pages_equal, random_pool, shared_batch, spec


class TestExampleTier(TierContract):
    @pytest.fixture
    async def tier(self) -> Tier:
        t = open_tier(DictTierConfig())
        assert isinstance(t, DictTier), "register made open_tier open it"
        await t.open()
        return t


async def test_a_store_runs_on_the_example_tier() -> None:
    sp = spec(num_layers=2)
    src = random_pool(sp)
    b = shared_batch(src, list(range(500, 516)), [[1] * 8])
    cfg = StoreConfig(tiers=(DictTierConfig(capacity_bytes=1 << 20),))  # type: ignore[arg-type]
    async with TieredStore(cfg) as store:
        await store.put(src, b.tokens, b.tables)
        dst = PagedKVPool(sp, 16)
        got = await store.retrieve(dst, b.tokens)
        assert got.num_tokens == [24]
        assert_pages_equal(src, b.tables, dst, got.block_tables, got.num_tokens)
        assert store.stats()["tiers"]["dict"]["objects"] == 3
