"""Every move has a reason: each way a group leaves a tier or is copied into one is
counted under its reason (``metrics.MOVE_REASONS``), in ``stats()["moves"]``, in
Prometheus and in a DEBUG log line. One test per reason (``budget_lowered`` is in
tests/test_faults.py's full-disk test, ``quota`` in tests/test_tenants.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from hurray_store import PagedKVPool
from hurray_store.keys import object_stored
from hurray_store.metrics import MOVE_REASONS
from hurray_store.store import TieredStore, open_store
from hurray_store.tiers.memory import memory_charge
from tests.store_helpers import random_pool, shared_batch, spec

BLOB = bytes(range(256)) * 16  # 4 KiB


def _disk(path: Path, **kw: Any) -> dict[str, Any]:
    return {"type": "disk", "path": str(path), "capacity_bytes": 1 << 30, **kw}


def _moved(store: TieredStore, reason: str, tier: str) -> int:
    return int(store.stats()["moves"].get(reason, {}).get(tier, {}).get("groups", 0))


async def test_evict_is_counted_logged_and_exported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = {"tiers": [{"type": "cpu", "capacity_bytes": 4 * memory_charge(len(BLOB))}]}
    async with await open_store(cfg) as store:
        with caplog.at_level(logging.DEBUG, logger="hurray_store.metrics"):
            for i in range(8):
                assert await store.put_object(f"o{i}", BLOB)
        assert _moved(store, "evict", "cpu") == 8 - 4, store.stats()["moves"]
        assert store.stats()["moves"]["evict"]["cpu"]["bytes"] == 4 * len(BLOB)
        assert caplog.text.count("moved: evict, tier cpu") == 4
        text = generate_latest(store.metrics.registry).decode()
        assert 'hurray_store_moves_total{reason="evict",tier="cpu"} 4.0' in text
        assert 'hurray_store_moved_bytes_total{reason="evict",tier="cpu"} 16384.0' in text


async def test_demote_and_flush_in_write_back(tmp_path: Path) -> None:
    cfg = {
        "policy": {"write_mode": "back"},
        "tiers": [{"type": "cpu", "capacity_bytes": 4 * memory_charge(len(BLOB))}, _disk(tmp_path)],
    }
    async with await open_store(cfg) as store:
        for i in range(6):
            assert await store.put_object(f"o{i}", BLOB)
        assert _moved(store, "demote", "cpu") == 2, "evicted from cpu, copied to disk first"
        assert _moved(store, "evict", "cpu") == 0
        await store.flush()
        assert _moved(store, "flush", "disk") == 4, "the four left in cpu, copied down"


async def test_promote_after_a_read_from_a_lower_tier(tmp_path: Path) -> None:
    sp = spec(num_layers=2)
    src = random_pool(sp)
    b = shared_batch(src, list(range(500, 516)), [[1] * 8])
    cfg = {"tiers": [{"type": "cpu", "capacity_bytes": 1 << 20}, _disk(tmp_path)]}
    async with await open_store(cfg) as store:
        await store.put(src, b.tokens, b.tables)
    async with await open_store(cfg) as store:  # a fresh cpu tier: only the disk has it
        got = await store.retrieve(PagedKVPool(sp, 16), b.tokens)
        assert got.num_tokens == [24]
        await store.flush()
        assert _moved(store, "promote", "cpu") == 1
        assert store.stats()["moves"]["promote"]["cpu"]["bytes"] == sum(
            store.ledger.group_keys(0, store.catalog.key(store.catalog.segments()[0])).values()
        )


async def test_quarantine_lost_and_delete(tmp_path: Path) -> None:
    sp = spec(num_layers=2)
    src = random_pool(sp)
    b = shared_batch(src, list(range(500, 516)), [[1] * 8])
    cfg = {"tiers": [_disk(tmp_path)]}
    async with await open_store(cfg) as store:
        await store.put(src, b.tokens, b.tables)
        (seg,) = store.catalog.segments()
        m = store.catalog.cached_manifest(seg)
        disk: Any = store.tiers[0]
        path = disk.path_of(m.layers[1].key)
        raw = bytearray(path.read_bytes())
        raw[m.layers[1].key_pool_offset + 5] ^= 0xFF
        path.write_bytes(bytes(raw))
        await store.retrieve(PagedKVPool(sp, 16), b.tokens)
        assert _moved(store, "quarantine", "disk") == 1
        assert await store.put_object("gone", BLOB)
        disk.path_of(object_stored(store.namespace, "gone")).unlink()  # behind its back
        assert await store.get_object("gone") is None
        assert _moved(store, "lost", "disk") == 1
        assert await store.put_object("deleted", BLOB)
        await store.delete_object("deleted")
        assert _moved(store, "delete", "disk") == 1


async def test_other_process_removals_are_counted_as_such(tmp_path: Path) -> None:
    cfg = {"tiers": [_disk(tmp_path)]}
    async with await open_store(cfg) as a, await open_store(cfg) as b:
        assert await a.put_object("shared", BLOB)
        assert await b.object_size("shared") is not None
        await a.delete_object("shared")
        assert await b.object_size("shared") is None
        assert _moved(b, "other_process", "disk") == 1
        assert _moved(a, "delete", "disk") == 1


def test_every_reason_is_documented_in_docs_store_md() -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs/store.md").read_text()
    assert [r for r in MOVE_REASONS if f"| `{r}` |" not in doc] == []
