"""TieredStore: the prefix level (put, lookup, retrieve) and the object level, across
tier configurations with real files and a real redis-server."""

from __future__ import annotations

import asyncio
import random
import struct
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import generate_latest
from xxhash import xxh3_64_intdigest as xxh3

from hurray_store import PagedKVPool, PoolExhaustedError
from hurray_store.keys import ObjectKey
from hurray_store.store import open_store
from hurray_store.testing.services import RedisProc, SeaweedProc
from hurray_store.tiers import SelfChecked
from hurray_store.tiers.memory import memory_charge
from tests.store_helpers import Batch, assert_pages_equal, random_pool, shared_batch, spec

PREFIX = list(range(1000, 1018))  # 4 full pages + 2 tokens


@pytest.fixture(params=["cpu", "cpu+disk", "gpu+cpu", "disk", "redis", "cpu+cluster", "s3"])
def tiers(request: pytest.FixtureRequest, tmp_path: Path) -> list[dict[str, Any]]:
    disk = {"type": "disk", "path": str(tmp_path / "disk"), "capacity_bytes": 1 << 30}
    cpu = {"type": "cpu", "capacity_bytes": 1 << 30}
    name = request.param
    if name == "cpu":
        return [cpu]
    if name == "cpu+disk":
        return [cpu, disk]
    if name == "gpu+cpu":
        return [{"type": "gpu", "device": "cpu", "capacity_bytes": 1 << 30}, cpu]
    if name == "disk":
        return [disk]
    prefix = f"t-{uuid.uuid4().hex[:8]}:"
    if name == "redis":
        r: RedisProc = request.getfixturevalue("redis_server")
        return [{"type": "redis", "url": r.url, "key_prefix": prefix}]
    if name == "s3":
        s3: SeaweedProc = request.getfixturevalue("s3_server")
        return [s3.tier(prefix.rstrip(":"))]
    nodes: list[RedisProc] = request.getfixturevalue("redis_cluster")
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in nodes)
    return [cpu, {"type": "redis", "url": url, "key_prefix": prefix}]


async def test_put_then_retrieve_is_bit_exact_and_keeps_sharing(
    tiers: list[dict[str, Any]],
) -> None:
    sp = spec()
    src = random_pool(sp)
    b = shared_batch(src, PREFIX, [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11], [12]])
    async with await open_store({"tiers": tiers}) as store:
        r = await store.put(src, b.tokens, b.tables)
        # 4 shared pages + per tail: (18+6)//4=6 -> 2 own, (23)//4=5 -> 1 own, 19//4=4 -> 0 own
        assert (r.pages_referenced, r.pages_written, r.pages_already_stored, r.segments) == (
            15,
            7,
            0,
            1,
        )
        await store.flush()
        assert await store.lookup(sp, b.tokens) == [24, 20, 16]
        dst = PagedKVPool(sp, 64)
        got = await store.retrieve(dst, b.tokens)
        assert got.num_tokens == [24, 20, 16]
        assert_pages_equal(src, b.tables, dst, got.block_tables, got.num_tokens)
        shared = got.block_tables[0][:4]
        assert all(t[:4] == shared for t in got.block_tables)
        assert [dst.refcount(p) for p in shared] == [3, 3, 3, 3]
        assert dst.num_free == 64 - 7


async def test_dedup_across_requests_and_retrieval_across_segments(tmp_path: Path) -> None:
    sp = spec()
    src = random_pool(sp)
    cfg = {
        "tiers": [
            {"type": "cpu", "capacity_bytes": 1 << 30},
            {"type": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 30},
        ]
    }
    first = shared_batch(src, PREFIX, [[]])
    second_tokens = PREFIX + list(range(50, 60))  # 28 tokens = 7 pages, the first 4 already stored
    second_table = first.tables[0] + src.allocate(3)
    async with await open_store(cfg) as store:
        r1 = await store.put(src, first.tokens, first.tables)
        r2 = await store.put(src, [second_tokens], [second_table])
        assert (
            r1.pages_written,
            r2.pages_written,
            r2.pages_already_stored,
            r2.pages_referenced,
        ) == (4, 3, 4, 7)
        assert store.stats()["segments"] == 2
        dst = PagedKVPool(sp, 32)
        got = await store.retrieve(dst, [second_tokens, PREFIX + [999] * 10])
        assert got.num_tokens == [28, 16]
        assert_pages_equal(src, [second_table, second_table], dst, got.block_tables, got.num_tokens)
        assert got.block_tables[1] == got.block_tables[0][:4]


async def test_only_full_pages_are_stored_and_matched() -> None:
    sp = spec()
    src = random_pool(sp)
    b = shared_batch(src, list(range(7)), [[]])  # one full page and 3 tokens
    async with await open_store({"tiers": [{"type": "cpu", "capacity_bytes": 1 << 20}]}) as store:
        assert (await store.put(src, b.tokens, b.tables)).pages_written == 1
        assert await store.lookup(
            sp, [list(range(7)), list(range(4)), list(range(3)), [0, 1, 2, 9, 9]]
        ) == [4, 4, 0, 0]
        assert await store.lookup(sp, [list(range(7))]) == [4]


async def test_seq_lens_limit_what_is_stored() -> None:
    sp = spec()
    src = random_pool(sp)
    b = shared_batch(src, list(range(16)), [[]])
    async with await open_store({"tiers": [{"type": "cpu", "capacity_bytes": 1 << 20}]}) as store:
        r = await store.put(src, b.tokens, b.tables, seq_lens=[9])
        assert r.pages_written == 2 and await store.lookup(sp, b.tokens) == [8]


async def test_large_batches_split_into_segments_keeping_sharers_together(tmp_path: Path) -> None:
    sp = spec()
    src = random_pool(sp, 512)
    page_cost = 2 * sp.page_bytes * sp.num_layers
    groups = [
        shared_batch(src, [g * 100 + i for i in range(16)], [[1] * 4, [2] * 4]) for g in range(6)
    ]
    tokens = [t for g in groups for t in g.tokens]
    tables = [t for g in groups for t in g.tables]
    cfg = {
        "tiers": [{"type": "cpu", "capacity_bytes": 1 << 30}],
        "max_segment_bytes": 12 * page_cost,
    }
    async with await open_store(cfg) as store:
        r = await store.put(src, tokens, tables)
        assert r.pages_written == 36 and r.segments == 3  # 6 pages per group, 2 groups per segment
        for seg in store.catalog.segments():
            m = store.catalog.cached_manifest(seg)
            firsts = {s.token_ids[0] // 100 for s in m.sequences}
            assert len(m.sequences) == 4 and len(firsts) == 2 and m.num_pages == 12
        dst = PagedKVPool(sp, 64)
        got = await store.retrieve(dst, tokens)
        assert_pages_equal(src, tables, dst, got.block_tables, got.num_tokens)


async def test_no_read_amplification_for_one_sequence_of_a_large_segment(tmp_path: Path) -> None:
    sp = spec(page_size=16, num_kv_heads=4, head_dim=64)
    src = random_pool(sp, 2048)
    b = shared_batch(
        src, list(range(64)), [[s] * 448 for s in range(32)]
    )  # 32 x 512 tokens, 4 pages shared
    cfg = {
        "tiers": [{"type": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 32}],
        "policy": {"promote_on_hit": False},
    }
    async with await open_store(cfg) as store:
        await store.put(src, b.tokens, b.tables)
    async with await open_store(cfg) as store:  # cold: only the disk tier
        dst = PagedKVPool(sp, 64)
        got = await store.retrieve(dst, [b.tokens[7]])
        assert got.num_tokens == [512]
        assert_pages_equal(src, [b.tables[7]], dst, got.block_tables, got.num_tokens)
        amp = got.bytes_read / got.bytes_delivered
        assert got.bytes_delivered == 32 * 2 * sp.page_bytes * sp.num_layers
        assert amp <= 1.1, amp
        assert store.stats()["tiers"]["disk"]["bytes_read"] < 2 * got.bytes_delivered


async def test_retrieve_layers_streams_each_layer_in_order() -> None:
    sp = spec()
    src = random_pool(sp)
    b = shared_batch(src, PREFIX, [[5] * 6])
    async with await open_store({"tiers": [{"type": "cpu", "capacity_bytes": 1 << 30}]}) as store:
        await store.put(src, b.tokens, b.tables)
        dst = PagedKVPool(sp, 64)
        seen = []
        async for layer in store.retrieve_layers(dst, b.tokens):
            seen.append(layer.layer_index)
            li = layer.layer_index
            for i, p in enumerate(layer.block_tables[0]):
                assert torch.equal(dst.layers[li][:, p], src.layers[li][:, b.tables[0][i]])
        assert seen == [0, 1, 2] and layer.num_tokens == [24]


async def test_abandoning_retrieve_layers_gives_the_pages_back() -> None:
    sp = spec()
    src = random_pool(sp)
    b = shared_batch(src, PREFIX, [[5] * 6])
    async with await open_store({"tiers": [{"type": "cpu", "capacity_bytes": 1 << 30}]}) as store:
        await store.put(src, b.tokens, b.tables)
        dst = PagedKVPool(sp, 16)
        gen = store.retrieve_layers(dst, b.tokens)
        async for _ in gen:
            break
        await gen.aclose()  # type: ignore[attr-defined]
        assert dst.num_free == 16


async def test_a_pool_too_small_raises_and_allocates_nothing() -> None:
    sp = spec()
    src = random_pool(sp)
    b = shared_batch(src, PREFIX, [[5] * 6])
    async with await open_store({"tiers": [{"type": "cpu", "capacity_bytes": 1 << 30}]}) as store:
        await store.put(src, b.tokens, b.tables)
        dst = PagedKVPool(sp, 3)
        with pytest.raises(PoolExhaustedError):
            await store.retrieve(dst, b.tokens)
        assert dst.num_free == 3


async def test_concurrent_puts_of_one_prefix_write_it_once(tmp_path: Path) -> None:
    sp = spec()
    src = random_pool(sp, 512)
    prefix_pages = src.allocate(4)  # same tokens, same KV: one set of pages for all
    batches = [Batch([PREFIX + [i] * 8], [prefix_pages + src.allocate(2)]) for i in range(8)]
    cfg = {
        "tiers": [
            {"type": "cpu", "capacity_bytes": 1 << 30},
            {"type": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 30},
        ]
    }
    async with await open_store(cfg) as store:
        results = await asyncio.gather(*(store.put(src, b.tokens, b.tables) for b in batches))
        assert sum(r.pages_written for r in results) == 4 + 8 * 2
        dsts = [PagedKVPool(sp, 16) for _ in batches]
        gots = await asyncio.gather(
            *(store.retrieve(d, b.tokens) for d, b in zip(dsts, batches, strict=True))
        )
        for d, g, b in zip(dsts, gots, batches, strict=True):
            assert g.num_tokens == [24]
            assert_pages_equal(src, b.tables, d, g.block_tables, g.num_tokens)


async def test_tenants_with_different_salts_never_see_each_others_pages() -> None:
    sp = spec()
    src = random_pool(sp)
    b = shared_batch(src, PREFIX, [[]])
    tiers = [{"type": "cpu", "capacity_bytes": 1 << 30}]
    async with await open_store({"tiers": tiers, "salt": "tenant-a"}) as store:
        await store.put(src, b.tokens, b.tables)
        assert await store.lookup(sp, b.tokens) == [16]
        assert await store.lookup(sp, b.tokens, salt="tenant-b") == [0]
        assert (await store.retrieve(PagedKVPool(sp, 8), b.tokens, salt="tenant-b")).num_tokens == [
            0
        ]
        r = await store.put(src, b.tokens, b.tables, salt="tenant-b")
        assert r.pages_written == 4 and r.pages_already_stored == 0


async def test_salts_with_nul_bytes_never_collide_with_quantized_pages(tmp_path: Path) -> None:
    """An int8 store under salt "x" and an exact store under salt "x\\x00int8" on one disk:
    neither sees the other's pages (quantization is its own field of the hash root, not a
    salt suffix); nor do salts that differ only past a NUL."""
    sp = spec(dtype=torch.float32)
    src = random_pool(sp)
    b = shared_batch(src, PREFIX, [[]])
    disk = [{"type": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 30}]
    async with await open_store({"tiers": disk, "quantization": "int8", "salt": "x"}) as q:
        await q.put(src, b.tokens, b.tables)
        assert await q.lookup(sp, b.tokens) == [16]
    async with await open_store({"tiers": disk, "salt": "x\x00int8"}) as exact:
        assert await exact.lookup(sp, b.tokens) == [0]
        assert (await exact.retrieve(PagedKVPool(sp, 8), b.tokens)).num_tokens == [0]
        for other in ("x", "x\x00", "x\x00int", "\x00x"):
            assert await exact.lookup(sp, b.tokens, salt=other) == [0], repr(other)
    async with await open_store({"tiers": disk, "quantization": "int8", "salt": "x"}) as q:
        assert await q.lookup(sp, b.tokens) == [16], "the int8 pages are still there"


async def test_int8_tier_is_within_the_stated_bound() -> None:
    sp = spec(dtype=torch.float32)
    src = random_pool(sp)
    b = shared_batch(src, PREFIX, [[3] * 6])
    async with await open_store(
        {"tiers": [{"type": "cpu", "capacity_bytes": 1 << 30}], "quantization": "int8"}
    ) as store:
        await store.put(src, b.tokens, b.tables)
        dst = PagedKVPool(sp, 16)
        got = await store.retrieve(dst, b.tokens)
        assert got.num_tokens == [24]
        for li in range(sp.num_layers):
            a = src.layers[li][:, b.tables[0][:6]]
            c = dst.layers[li][:, got.block_tables[0]]
            # per slot: |err| <= scale/2 with scale = max|x|/127 (docs/format.md)
            bound = a.abs().amax(dim=(-2, -1), keepdim=True) / 127 / 2 * 1.001 + 1e-7
            assert ((a - c).abs() <= bound).all()
    async with await open_store({"tiers": [{"type": "cpu", "capacity_bytes": 1 << 30}]}) as exact:
        assert await exact.lookup(sp, b.tokens) == [0]  # int8 pages hash apart


async def test_restart_finds_every_committed_segment_on_disk(tmp_path: Path) -> None:
    sp = spec()
    src = random_pool(sp, 512)
    batches = [shared_batch(src, [g] * 12, [[g + 1] * 8, [g + 2] * 9]) for g in range(5)]
    cfg = {
        "tiers": [
            {"type": "cpu", "capacity_bytes": 1 << 30},
            {"type": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 30},
        ]
    }
    async with await open_store(cfg) as store:
        for b in batches:
            await store.put(src, b.tokens, b.tables)
    async with await open_store(cfg) as store:
        assert store.stats()["segments"] == 5
        for b in batches:
            dst = PagedKVPool(sp, 16)
            got = await store.retrieve(dst, b.tokens)
            assert got.num_tokens == [20, 20]
            assert_pages_equal(src, b.tables, dst, got.block_tables, got.num_tokens)
        await store.flush()
        assert (
            store.stats()["tiers"]["cpu"]["objects"] == 5 * 4
        )  # promoted: 3 layers + manifest each


async def test_eviction_keeps_data_reachable_in_lower_tiers(tmp_path: Path) -> None:
    sp = spec()
    src = random_pool(sp, 512)
    batches = [shared_batch(src, [g] * 16, [[]]) for g in range(6)]
    async with await open_store({"tiers": [{"type": "cpu", "capacity_bytes": 1 << 30}]}) as probe:
        await probe.put(src, batches[0].tokens, batches[0].tables)
        seg_bytes = probe.stats()["tiers"]["cpu"]["bytes"]  # what the cpu tier charges it
    cfg = {
        "tiers": [
            {"type": "cpu", "capacity_bytes": 2 * seg_bytes},
            {"type": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 30},
        ]
    }
    async with await open_store(cfg) as store:
        for b in batches:
            await store.put(src, b.tokens, b.tables)
        await store.flush()
        st = store.stats()["tiers"]
        assert st["cpu"]["evictions"] > 0 and st["cpu"]["bytes"] <= 2 * seg_bytes
        assert st["disk"]["objects"] == 6 * 4
        for b in batches:
            dst = PagedKVPool(sp, 8)
            got = await store.retrieve(dst, b.tokens)
            assert_pages_equal(src, b.tables, dst, got.block_tables, got.num_tokens)
            assert got.num_tokens == [16]


async def test_write_back_moves_evicted_groups_down_and_flush_persists_the_rest(
    tmp_path: Path,
) -> None:
    sp = spec()
    src = random_pool(sp, 512)
    batches = [shared_batch(src, [g] * 16, [[]]) for g in range(4)]
    async with await open_store({"tiers": [{"type": "cpu", "capacity_bytes": 1 << 30}]}) as probe:
        await probe.put(src, batches[0].tokens, batches[0].tables)
        one = probe.stats()["tiers"]["cpu"]["bytes"]  # what the cpu tier charges a segment
    cfg = {
        "tiers": [
            {"type": "cpu", "capacity_bytes": int(2.5 * one)},
            {"type": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 30},
        ],
        "policy": {"write_mode": "back"},
    }
    async with await open_store(cfg) as store:
        for b in batches:
            await store.put(src, b.tokens, b.tables)
        st = store.stats()["tiers"]
        assert st["disk"]["objects"] == 2 * 4  # the two evicted segments went down
        assert st["cpu"]["objects"] == 2 * 4
    async with await open_store(cfg) as store:  # close flushed the other two
        assert store.stats()["tiers"]["disk"]["objects"] == 4 * 4
        for b in batches:
            got = await store.retrieve(PagedKVPool(sp, 8), b.tokens)
            assert got.num_tokens == [16]


async def test_object_level_put_get_ranges_delete(tmp_path: Path) -> None:
    cfg = {
        "tiers": [
            {"type": "cpu", "capacity_bytes": 1 << 20},
            {"type": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 30},
        ]
    }
    data = bytes(range(256)) * 10
    async with await open_store(cfg) as store:
        assert await store.put_object("chunk/1", [data[:100], data[100:]])
        assert await store.object_size("chunk/1") is not None
        got = await store.get_object("chunk/1")
        assert got is not None and bytes(got) == data
        parts = await store.get_object_ranges("chunk/1", [(5, 10), (2000, 20)])
        assert parts is not None and [bytes(p) for p in parts] == [data[5:15], data[2000:2020]]
        assert await store.get_object("chunk/2") is None
    async with await open_store(cfg) as store:  # found again after a restart (disk)
        got = await store.get_object("chunk/1")
        assert got is not None and bytes(got) == data
        await store.delete_object("chunk/1")
        assert (
            await store.object_size("chunk/1") is None and await store.get_object("chunk/1") is None
        )


async def test_stats_and_prometheus_metrics_agree() -> None:
    sp = spec()
    src = random_pool(sp)
    b = shared_batch(src, PREFIX, [[]])
    async with await open_store({"tiers": [{"type": "cpu", "capacity_bytes": 1 << 30}]}) as store:
        await store.put(src, b.tokens, b.tables)
        await store.retrieve(PagedKVPool(sp, 8), b.tokens)
        st = store.stats()["tiers"]["cpu"]
        text = generate_latest(store.metrics.registry).decode()
        assert f'hurray_store_tier_hits_total{{tier="cpu"}} {float(st["hits"])}' in text
        assert (
            f'hurray_store_tier_bytes_written_total{{tier="cpu"}} {float(st["bytes_written"])}'
            in text
        )
        assert f'hurray_store_tier_objects{{tier="cpu"}} {float(st["objects"])}' in text
        assert "hurray_store_tier_op_seconds_bucket" in text
        # three layer objects read; the manifest came from the store's own cache
        assert st["hits"] == 3 and st["objects"] == 4 and st["op_count"] > 0


async def test_bad_put_input_is_a_clear_error() -> None:
    sp = spec()
    src = random_pool(sp)
    async with await open_store({"tiers": [{"type": "cpu", "capacity_bytes": 1 << 20}]}) as store:
        from hurray_store import PagingError

        with pytest.raises(PagingError, match="2 token lists but 1 block tables"):
            await store.put(src, [[1], [2]], [[0]])
        with pytest.raises(PagingError, match="seq_len 9 outside"):
            await store.put(src, [[1] * 8], [[0, 1]], seq_lens=[9])
        with pytest.raises(PagingError, match="block table"):
            await store.put(src, [[1] * 8], [[0]])
        with pytest.raises(ValueError, match="token ids"):
            await store.put(src, [[-1] * 4], [[0]])
        with pytest.raises(
            PagingError, match=r"unknown page id 9999: the pool has pages \[0, 256\)"
        ):
            await store.put(src, [[1] * 8], [[0, 9999]])
        assert store.stats()["segments"] == 0 and store.stats()["tiers"]["cpu"]["objects"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_gpu_tier_and_pool_on_cuda_round_trip() -> None:
    sp = spec()
    src = PagedKVPool(sp, 128, device="cuda:0")
    for layer in src.layers:
        layer.copy_(torch.randn(layer.shape, device="cuda:0").to(layer.dtype))
    b = shared_batch(src, PREFIX, [[1] * 6, [2] * 9])
    tiers = [
        {"type": "gpu", "device": "cuda:0", "capacity_bytes": 1 << 30},
        {"type": "cpu", "capacity_bytes": 1 << 30},
    ]
    async with await open_store({"tiers": tiers}) as store:
        await store.put(src, b.tokens, b.tables)
        dst = PagedKVPool(sp, 64, device="cuda:0")
        got = await store.retrieve(dst, b.tokens)
        assert got.num_tokens == [24, 24]
        assert_pages_equal(src, b.tables, dst, got.block_tables, got.num_tokens)


async def test_delete_right_after_put_is_not_undone_by_write_through(tmp_path: Path) -> None:
    cfg = {
        "tiers": [
            {"type": "cpu", "capacity_bytes": 1 << 30},
            {"type": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 30},
        ]
    }
    async with await open_store(cfg) as store:
        for i in range(20):
            assert await store.put_object(
                f"k{i}", b"x" * 100_000
            )  # write-through to disk still running
            await store.delete_object(f"k{i}")
        await store.flush()
        assert not any([(await store.object_size(f"k{i}") is not None) for i in range(20)])
    async with await open_store(cfg) as store:  # and nothing came back on disk
        assert not any([(await store.object_size(f"k{i}") is not None) for i in range(20)])


async def test_put_objects_is_one_group_written_record_last(tmp_path: Path) -> None:
    cfg = {
        "tiers": [
            # room for one group of 600, 600, 3 bytes and its member list in memory
            {"type": "cpu", "capacity_bytes": sum(map(memory_charge, [600, 600, 3, 200]))},
            {"type": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 30},
        ]
    }
    async with await open_store(cfg) as store:
        assert await store.put_objects(
            [("c1/0", b"a" * 600), ("c1/1", b"b" * 600), ("c1/r", b"rec")]
        )
        await store.flush()  # c1 stays pinned in memory while its write-through runs
        assert await store.put_objects(
            [("c2/0", b"c" * 600), ("c2/1", b"d" * 600), ("c2/r", b"rec")]
        )
        await store.flush()
        cpu = store.stats()["tiers"]["cpu"]
        # c1 left the cpu tier whole: its 3 objects and its member list
        assert cpu["evictions"] == 4 and cpu["objects"] == 4
        assert [(await store.object_size(k) is not None) for k in ("c1/0", "c1/1", "c1/r")] == [
            True
        ] * 3  # still on disk
        await store.delete_object("c2/r")  # any key of a group takes the group
        assert [(await store.object_size(k) is not None) for k in ("c2/0", "c2/1", "c2/r")] == [
            False
        ] * 3
        got = await store.get_object("c1/1")
        assert got is not None and bytes(got) == b"b" * 600


async def test_put_objects_takes_a_self_checked_member(tmp_path: Path) -> None:
    # A group whose last object checks itself (the checksums of its parts, hashed where
    # a disk tier writes them): the store writes it as the group's record, in memory and
    # on disk alike, and both hold the same bytes after a restart.
    rnd = random.Random(5)
    parts = [rnd.randbytes(n) for n in (700_000, 12, 300_000)]
    checked = SelfChecked(parts, [0, None, 1], [0, 0], lambda s: [struct.pack("<2Q", *s)], 16, xxh3)
    want = b"".join(parts) + struct.pack("<2Q", xxh3(parts[0]), xxh3(parts[2]))
    cfg = {
        "tiers": [
            {"type": "cpu", "capacity_bytes": 1 << 24},
            {"type": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 30},
        ]
    }
    async with await open_store(cfg) as store:
        assert await store.put_objects([("s/0", b"a" * 600), ("s/r", checked)])
        await store.flush()
        got = await store.get_object("s/r")
        assert got is not None and bytes(got) == want
    cfg["tiers"] = cfg["tiers"][1:]
    async with await open_store(cfg) as store:
        got = await store.get_object("s/r")
        assert got is not None and bytes(got) == want
        await store.delete_object("s/0")
        assert await store.object_size("s/r") is None, "one group"


async def test_object_groups_survive_a_restart_and_half_written_ones_are_deleted(
    tmp_path: Path,
) -> None:
    cfg = {"tiers": [{"type": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 30}]}
    async with await open_store(cfg) as store:
        assert await store.put_objects([("c1/0", b"a" * 60), ("c1/1", b"b" * 60), ("c1/r", b"rec")])
        assert await store.put_objects([("c2/0", b"c" * 60), ("c2/r", b"rec")])
        assert await store.put_object("solo", b"s" * 10)
        disk = store.tiers[0]
    # A writer killed mid-group: c2 lost a member before its record was written.
    (tmp_path / disk.path_of("hurray/o/c2/0").relative_to(tmp_path)).unlink()  # type: ignore[attr-defined]
    async with await open_store(cfg) as store:
        assert store.ledger.group_of(0, "hurray/o/c1/0") == ObjectKey("hurray", "c1/r"), (
            "c1 is one group again"
        )
        assert await store.object_size("c2/r") is None, "an incomplete group is deleted whole"
        assert await store.get_object("solo") is not None
        await store.delete_object("c1/0")
        assert [(await store.object_size(k) is not None) for k in ("c1/0", "c1/1", "c1/r")] == [
            False
        ] * 3
    objects = tmp_path / "objects"  # beside it: the folder's lock and journal
    assert sorted(p.name for p in objects.rglob("*") if p.is_file()) == [
        p.name for p in [disk.path_of("hurray/o/solo")]
    ]  # type: ignore[attr-defined]


async def test_skipped_leading_pages_are_matched_but_never_read(tmp_path: Path) -> None:
    """``retrieve_layers(skip=...)``: a caller that holds a sequence's first pages (an
    engine's own prefix cache, a sliding window's freed blocks) gets the rest, bit-exact,
    with fewer bytes read; the skipped positions name one page left unfilled, and a
    sequence wholly skipped reads nothing."""
    sp = spec()
    src = random_pool(sp)
    b = shared_batch(src, PREFIX, [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11]])
    cfg = {"tiers": [{"type": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 30}]}
    async with await open_store(cfg) as store:
        await store.put(src, b.tokens, b.tables)
        await store.flush()

        whole = await store.retrieve(PagedKVPool(sp, 64), b.tokens)
        part = PagedKVPool(sp, 64)
        got = await store.retrieve(part, b.tokens, skip=[5, 6])
        tables = got.block_tables
        assert got.num_tokens == whole.num_tokens == [24, 20]  # every position, as matched
        # One page of 6 distinct ones read and delivered (the 4 shared, 2 of the first
        # tail's, 1 of the second's: 7 in all; the second sequence wholly skipped).
        assert got.bytes_delivered * 7 == whole.bytes_delivered
        assert 0 < got.bytes_read < whole.bytes_read
        for s, first in enumerate([5, 6]):  # the pages past the skip: bit-exact
            keep = list(range(first, len(tables[s])))
            assert_pages_equal(
                src,
                [[b.tables[s][i] for i in keep]],
                part,
                [[tables[s][i] for i in keep]],
                [len(keep) * sp.page_size],
            )
        # The skipped positions of both sequences name one page, never read.
        skipped = {tables[0][i] for i in range(5)} | {tables[1][i] for i in range(5)}
        assert len(skipped) == 1 and skipped.isdisjoint({tables[0][5]})
