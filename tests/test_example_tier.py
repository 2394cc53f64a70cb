"""The example tier of docs/store.md ("Adding a tier") against the shipped tier
contract, and a store that runs on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from hurray_store import PagedKVPool
from hurray_store.config import TIERS, StoreConfig, load_config
from hurray_store.errors import ConfigError
from hurray_store.store import TieredStore
from hurray_store.testing.contract import TierContract
from hurray_store.tiers import (
    DiskTier,
    HelpsWrites,
    ReadsNow,
    Reserves,
    SharedMedium,
    SharedTier,
    Tier,
    open_tier,
    register,
    tier_class,
)
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


def test_a_class_with_a_config_but_not_a_tier_is_refused_when_opened() -> None:
    """The config layer checks only the shape (a ``config_cls`` with a kind); the tiers
    layer refuses a class that is not a ``Tier`` when a store would open it."""

    class NotATier:
        config_cls = DictTierConfig

    with pytest.raises(ConfigError, match="not a hurray_store.tiers.Tier"):
        register(NotATier)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="no tier of kind 'nothing'"):
        tier_class("nothing")


def test_one_registry_holds_the_built_in_and_the_outside_tiers() -> None:
    """Built-in kinds name their class by module path (imported when opened); an outside
    tier is in the same registry once registered."""
    assert {k for k, e in TIERS.items() if e.built_in} == {
        "gpu",
        "cpu",
        "disk",
        "redis",
        "remote",
        "s3",
    }
    assert TIERS["dict"].tier is DictTier and not TIERS["dict"].built_in
    assert tier_class("disk") is DiskTier and tier_class("dict") is DictTier
    assert tier_class("redis").__name__ == "RedisTier"


@pytest.mark.parametrize(
    "kind, offers",
    [
        ("cpu", {Reserves}),
        ("gpu", set()),
        ("disk", {ReadsNow, SharedMedium, HelpsWrites}),
        ("redis", {ReadsNow}),
        ("remote", {SharedTier}),
        ("s3", {SharedMedium}),
        ("dict", set()),
    ],
)
def test_each_tier_offers_its_capabilities_as_protocols(kind: str, offers: set[type]) -> None:
    every = {ReadsNow, Reserves, SharedMedium, HelpsWrites, SharedTier}
    got = {p for p in every if issubclass(tier_class(kind), p)}
    assert got == offers


async def test_a_redis_cluster_does_not_offer_reads_on_the_callers_thread() -> None:
    """A capability an instance narrows: a single Redis reads on any thread, a cluster
    only on the store's loop (``Tier.offers``). Built, never opened: no server needed."""
    single = open_tier(
        load_config({"tiers": [{"type": "redis", "url": "redis://127.0.0.1:1"}]}, env={}).tiers[0]
    )
    cluster = open_tier(
        load_config(
            {"tiers": [{"type": "redis", "url": "redis+cluster://127.0.0.1:1"}]}, env={}
        ).tiers[0]
    )
    assert single.offers(ReadsNow) and not cluster.offers(ReadsNow)
    assert single.offers(SharedTier) is cluster.offers(SharedTier) is False
    await single.close()
    await cluster.close()
