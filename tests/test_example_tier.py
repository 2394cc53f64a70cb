"""The example tier of docs/store.md ("Adding a tier") against the shipped tier
contract, and a store that runs on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from hurray_store import PagedKVPool
from hurray_store.config import StoreConfig, load_config
from hurray_store.errors import ConfigError
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


async def test_a_config_names_the_example_tier_by_module_path(tmp_path: Path) -> None:
    """``type: module:Class`` in a config: the tier's own config class reads the rest of
    the entry, and a store runs on it."""
    cfg = load_config(
        {"tiers": [{"type": "tests.example_tier:DictTier", "capacity_bytes": 1 << 20}]}, env={}
    )
    assert cfg.tiers == (DictTierConfig(name="dict", capacity_bytes=1 << 20),)
    async with TieredStore(cfg) as store:
        assert await store.put_object("o", b"x" * 100)
        assert store.stats()["tiers"]["dict"]["objects"] == 1


@pytest.mark.parametrize(
    "kind, says",
    [
        ("tests.no_such_module:DictTier", "cannot load the tier"),
        ("tests.example_tier:NoSuchTier", "cannot load the tier"),
        ("tests.example_tier:DictTierConfig", "is not a tier"),
        ("os.path:join", "is not a tier"),
    ],
    ids=["no-module", "no-class", "a-config-not-a-tier", "not-a-class"],
)
def test_a_tier_named_by_module_path_that_is_not_one_is_a_config_error(
    kind: str, says: str
) -> None:
    with pytest.raises(ConfigError, match=says):
        load_config({"tiers": [{"type": kind}]}, env={})
