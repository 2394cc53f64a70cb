"""The store's parts on their own: the ledger never claim bytes that are not there yet
(a tier whose writes are held open until the test lets them go), the pure planning as
exact tables, and the one page gather/scatter path."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch

from hurray_store import PagedKVPool, load_config, open_store
from hurray_store.config import DiskTierConfig
from hurray_store.engine.thread import StoreThread
from hurray_store.format import Manifest, ManifestLayer, ManifestSeq, page_checksum, plan_layer
from hurray_store.keys import SegmentKey, page_hashes
from hurray_store.page_io import (
    gather_layer,
    gather_pages,
    run_ranges,
    scatter_pages,
    verify_and_scatter,
)
from hurray_store.store import TieredStore
from hurray_store.store.plan import Match, cut_at_bad, read_plan, runs, segment_id, split_segments
from hurray_store.tiers import Buffer, open_tier
from hurray_store.tiers.disk import DiskTier
from tests.store_helpers import random_pool, shared_batch, spec


class HeldDisk(DiskTier):
    """A real disk tier whose writes wait until the test releases them."""

    def __init__(self, cfg: DiskTierConfig, namespace: str | None = None) -> None:
        super().__init__(cfg, namespace)
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()

    async def put(self, key: str, buffers: Sequence[Buffer]) -> bool:
        self.entered.set()
        await self.gate.wait()
        return await super().put(key, buffers)


async def _held_store(tmp_path: Path) -> tuple[TieredStore, HeldDisk]:
    cfg = load_config(
        {"tiers": [{"type": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 30}]}, env={}
    )
    disk = HeldDisk(cfg.tiers[0], cfg.namespace)  # type: ignore[arg-type]
    return await TieredStore(cfg, tiers=[disk]).open(), disk


async def test_an_object_group_is_not_contained_until_a_get_finds_it(tmp_path: Path) -> None:
    store, disk = await _held_store(tmp_path)
    put = asyncio.ensure_future(
        store.put_objects([("c/0", b"x" * 100), ("c/1", b"y" * 100), ("c/r", b"rec")])
    )
    await disk.entered.wait()  # the group's first write is under way, held open
    for key in ("c/0", "c/r"):
        assert not store.held(key), "the ledger claims nothing before the bytes exist"
        assert await store.object_size(key) is None
        assert await store.get_object(key) is None
    disk.gate.set()
    assert await put
    for key, want in (("c/0", b"x" * 100), ("c/r", b"rec")):
        assert store.held(key) and (await store.object_size(key) is not None)
        got = await store.get_object(key)
        assert got is not None and bytes(got) == want
    await store.close()


async def test_a_segment_is_not_looked_up_until_retrieve_delivers_it(tmp_path: Path) -> None:
    store, disk = await _held_store(tmp_path)
    sp = spec()
    src = random_pool(sp)
    b = shared_batch(src, list(range(16)), [[7] * 4])
    put = asyncio.ensure_future(store.put(src, b.tokens, b.tables))
    await disk.entered.wait()
    assert await store.lookup(sp, b.tokens) == [0], "a lookup hit must be a retrieve hit"
    got = await store.retrieve(PagedKVPool(sp, 16), b.tokens)
    assert got.num_tokens == [0]
    disk.gate.set()
    assert (await put).pages_written == 5
    assert await store.lookup(sp, b.tokens) == [20]
    got = await store.retrieve(PagedKVPool(sp, 16), b.tokens)
    assert got.num_tokens == [20]
    await store.close()


async def test_a_group_being_written_is_never_evicted_by_another_put(tmp_path: Path) -> None:
    """Room for one group: a second put while the first is held open is refused by the
    tier (it cannot evict a write in progress), and the first lands whole."""
    cfg = load_config(
        {"tiers": [{"type": "disk", "path": str(tmp_path), "capacity_bytes": 300}]}, env={}
    )
    disk = HeldDisk(cfg.tiers[0], cfg.namespace)  # type: ignore[arg-type]
    store = await TieredStore(cfg, tiers=[disk]).open()
    first = asyncio.ensure_future(store.put_object("a", b"a" * 200))
    await disk.entered.wait()
    assert not await store.put_object("b", b"b" * 200)
    disk.gate.set()
    assert await first
    got = await store.get_object("a")
    assert got is not None and bytes(got) == b"a" * 200
    assert store.stats()["tiers"]["disk"]["bytes"] == 200
    await store.close()


async def test_an_object_deleted_during_its_put_never_comes_back(tmp_path: Path) -> None:
    store, disk = await _held_store(tmp_path)
    put = asyncio.ensure_future(store.put_object("gone", b"x" * 100))
    await disk.entered.wait()
    await store.delete_object("gone")  # while its bytes are being written
    disk.gate.set()
    assert not await put, "the put is undone: stored nowhere"
    assert await store.get_object("gone") is None and not store.held("gone")
    await store.close()
    cfg = {"tiers": [{"type": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 30}]}
    async with await open_store(cfg) as again:
        assert await again.get_object("gone") is None, "not found again after a restart"


# ---------------------------------------------------------------------- plan


def test_split_segments_keeps_sharers_together_and_packs_by_bytes() -> None:
    h = [bytes([i]) * 16 for i in range(10)]
    table = [  # (hashes per sequence, firsts, max pages per segment, expected segments)
        ([[h[0], h[1]], [h[0], h[2]], [h[3]]], [0, 0, 0], 10, [[0, 1, 2]]),
        ([[h[0], h[1]], [h[0], h[2]], [h[3]]], [0, 0, 0], 3, [[0, 1], [2]]),
        ([[h[0], h[1]], [h[0], h[2]], [h[3]]], [1, 1, 0], 2, [[0, 1], [2]]),
        ([[h[0]], [h[1]], [h[2]]], [0, 0, 0], 1, [[0], [1], [2]]),
        ([[h[0]], [h[0]]], [1, 1], 5, []),  # nothing to write
        ([[h[0], h[1], h[2]], [h[4]], [h[2], h[5]]], [0, 0, 0], 4, [[0, 2], [1]]),
    ]
    for hashes, firsts, max_pages, want in table:
        assert split_segments(hashes, firsts, 10, max_pages * 10) == want, (
            hashes,
            firsts,
            max_pages,
        )


def test_segment_ids() -> None:
    a, b = b"a" * 16, b"b" * 16
    assert segment_id([a], [0]) == a, "one sequence from its start: its last page hash"
    assert segment_id([a], [1]) != a and len(segment_id([a], [1])) == 16
    assert segment_id([a, b], [0, 0]) == segment_id([a, b], [0, 0]) != segment_id([b, a], [0, 0])


def test_runs_and_cuts() -> None:
    assert runs([]) == []
    assert runs([0, 1, 2, 5, 6, 9]) == [(0, 3), (5, 7), (9, 10)]
    table = [  # (tables, bad, cut tables, lost)
        ([[0, 1, 2], [0, 1, 3]], set(), [[0, 1, 2], [0, 1, 3]], []),
        ([[0, 1, 2], [0, 1, 3]], {2}, [[0, 1], [0, 1, 3]], [2]),
        ([[0, 1, 2], [0, 1, 3]], {1}, [[0], [0]], [1, 2, 1, 3]),
        ([[0, 1, 0]], {1}, [[0]], [1]),
    ]
    for tables, bad, cut, lost in table:
        assert cut_at_bad(tables, bad) == (cut, lost)


def _manifest(
    seg: bytes, seqs: list[tuple[list[int], int, list[int]]], num_pages: int, P: int = 2
) -> Manifest:
    return Manifest(
        fingerprint=b"f" * 32,
        segment_id=seg,
        quantization=None,
        page_size=P,
        num_pages=num_pages,
        page_bytes=8,
        scale_bytes=0,
        sequences=tuple(
            ManifestSeq(tuple(t), first, len(t), tuple(b"h" * 16 for _ in table), tuple(table))
            for t, first, table in seqs
        ),
        layers=(ManifestLayer(0, "k", 100, 0, 10, 50, 0, 0, (0,) * num_pages, (0,) * num_pages),),
    )


def test_read_plan_shares_pages_and_stops_at_bad_segments() -> None:
    A, B, C = b"A" * 16, b"B" * 16, b"C" * 16
    toks = [np.array([1, 2, 3, 4, 5, 6], dtype="<u4"), np.array([1, 2, 3, 4, 9, 9], dtype="<u4")]
    manifests = {
        A: _manifest(A, [([1, 2, 3, 4], 0, [0, 1])], 2),  # the shared 2-page prefix
        B: _manifest(B, [([1, 2, 3, 4, 5, 6], 2, [0])], 1),  # seq 0's third page
        C: _manifest(C, [([1, 2, 3, 4, 7, 7], 2, [0])], 1),  # tokens differ from seq 1's
    }
    matches = [Match([A, A, B], [0, 0, 0], [0, 1, 2]), Match([A, A, C], [0, 0, 0], [0, 1, 2])]
    plan = read_plan(matches, manifests, toks, 2)
    assert plan.tables == [[0, 1, 2], [0, 1]], "the shared prefix is one set of local pages"
    assert plan.num_pages == 3 and plan.rejected == {C: "token ids differ from the request's"}
    assert [(r.segment_id, r.pages, r.dest, r.runs) for r in plan.segments] == [
        (A, [0, 1], [0, 1], [(0, 2)]),
        (B, [0], [2], [(0, 1)]),
    ]
    missing = read_plan(matches, {**manifests, A: None}, toks, 2)
    assert missing.tables == [[], []] and missing.num_pages == 0 and missing.segments == []


# ---------------------------------------------------------------------- page_io


def test_gather_and_scatter_pages_round_trip_any_dtype() -> None:
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        src = torch.randn(10, 4, 2, 3).to(dtype)
        idx = torch.tensor([7, 2, 2, 9])
        out = torch.empty(4, 4, 2, 3, dtype=dtype)
        gather_pages(src, idx, out)
        assert torch.equal(out, src[idx])
        dst = torch.zeros_like(src)
        scatter_pages(dst, torch.tensor([0, 1, 3, 5]), out)
        assert torch.equal(dst[[0, 1, 3, 5]], src[idx]) and not dst[[2, 4, 6, 7, 8, 9]].any()


def _layer_object(pool: PagedKVPool, li: int, pages: list[int]) -> tuple[Manifest, bytearray]:
    sp = pool.spec
    n = len(pages)
    bt = torch.arange(n)
    plan = plan_layer(
        li,
        bt,
        torch.tensor([0, n]),
        num_pages=n,
        page_size=sp.page_size,
        heads=sp.num_kv_heads,
        dim=sp.head_dim,
        dtype=sp.dtype,
    )
    out = bytearray(plan.nbytes)
    plan.write_fixed(memoryview(out))
    obj_sum, kc, vc = gather_layer(pool.layers[li], torch.tensor(pages), plan, memoryview(out))
    lay = ManifestLayer(
        li, "k", plan.nbytes, obj_sum, plan.key_pool_offset, plan.value_pool_offset, 0, 0, kc, vc
    )
    m = Manifest(sp.fingerprint(), b"s" * 16, None, sp.page_size, n, plan.page_bytes, 0, (), (lay,))
    return m, out


def test_gather_layer_writes_pages_and_their_checksums() -> None:
    sp = spec()
    pool = random_pool(sp, 16)
    m, obj = _layer_object(pool, 1, [5, 3, 9])
    lay = m.layers[0]
    for j, p in enumerate([5, 3, 9]):
        for role, sums in ((0, lay.key_page_checksums), (1, lay.value_page_checksums)):
            ((off, ln),) = m.page_range(0, "key" if role == 0 else "value", j)
            page = bytes(obj[off : off + ln])
            assert page == pool.layers[1][role, p].contiguous().view(torch.uint8).numpy().tobytes()
            assert sums[j] == page_checksum(page)
    assert m.verify_object(0, obj) is None


@pytest.mark.parametrize("whole", [False, True])
def test_verify_and_scatter_names_the_bad_pages_and_copies_the_rest(whole: bool) -> None:
    sp = spec()
    src = random_pool(sp, 16)
    m, obj = _layer_object(src, 0, [4, 5, 6, 7])
    ((off, _),) = m.page_range(0, "value", 2)
    obj[off] ^= 0xFF  # page 2's values
    page_runs = [(1, 3)]  # pages 1 and 2
    parts = [obj] if whole else [bytes(obj[o : o + n]) for o, n in run_ranges(m, 0, page_runs)]
    dst = PagedKVPool(sp, 8)
    rows = torch.tensor([3, 6])
    bad = verify_and_scatter(
        dst.layers[0], sp, m, 0, page_runs, parts, rows, whole=whole, check=True
    )
    assert bad == [1], "the second page of the run (segment page 2) is bad"
    assert torch.equal(dst.layers[0][:, 3], src.layers[0][:, 5]), "the good page landed"
    assert (
        verify_and_scatter(
            dst.layers[0], sp, m, 0, page_runs, parts, rows, whole=whole, check=False
        )
        == []
    )


def test_a_whole_object_with_a_bad_descriptor_or_size_is_refused_whole() -> None:
    sp = spec()
    src = random_pool(sp, 16)
    m, obj = _layer_object(src, 0, [4, 5])
    dst = PagedKVPool(sp, 8)
    rows = torch.tensor([0, 1])
    obj[0] ^= 0x01  # outside every page: only the object checksum covers it
    assert (
        verify_and_scatter(dst.layers[0], sp, m, 0, [(0, 2)], [obj], rows, whole=True, check=True)
        is None
    )
    assert (
        verify_and_scatter(
            dst.layers[0], sp, m, 0, [(0, 2)], [obj[:-1]], rows, whole=True, check=False
        )
        is None
    )
    assert not dst.layers[0].any(), "nothing copied"


def test_snapshot_and_the_store_gather_the_same_page_bytes() -> None:
    from hurray_store import snapshot

    sp = spec()
    pool = random_pool(sp, 16)
    snap = snapshot(pool, [[2, 9, 4]], [12])
    m, obj = _layer_object(pool, 2, [2, 9, 4])
    ((off, ln),) = m.page_range(0, "key", 0)
    assert (
        bytes(obj[off : off + 3 * ln])
        == snap.layers[2].keys.contiguous().view(torch.uint8).numpy().tobytes()
    )


def test_hashes_key_segments_of_one_namespace() -> None:
    sp = spec()
    hs = page_hashes(sp, list(range(8)))
    seg = SegmentKey("ns", hs[-1])
    assert seg.layer(2) == f"ns/s/{{{hs[-1].hex()}}}/2" and seg.manifest.endswith("/m")


async def test_concurrent_puts_never_evict_each_other_or_overrun_the_budget() -> None:
    """A 64 KiB cpu tier and 32 puts at once, four rounds: the tier never holds more than
    its budget, every indexed segment is held by a tier, and what lookup promises,
    retrieve delivers."""
    sp = spec()
    src = random_pool(sp, 512)
    cap = 64 << 10
    async with await open_store({"tiers": [{"type": "cpu", "capacity_bytes": cap}]}) as store:
        for r in range(4):
            batches = [shared_batch(src, [r, i] + [7] * 14, [[i] * 4]) for i in range(32)]
            await asyncio.gather(*(store.put(src, b.tokens, b.tables) for b in batches))
            assert store.ledger.used_bytes(0) <= cap, "the tier is over its budget"
            for seg in store.catalog.segments():
                assert store.ledger.group_holders(store.catalog.key(seg)), "indexed, held nowhere"
            for b in batches:
                promised = await store.lookup(sp, b.tokens)
                dst = PagedKVPool(sp, 16)
                got = await store.retrieve(dst, b.tokens)
                assert got.num_tokens == promised
                src.free([p for t in b.tables for p in t])  # the source pool is reused
        assert store.stats()["tiers"]["cpu"]["evictions"] > 0, "the budget was exercised"


async def test_the_last_put_of_a_key_wins_in_every_tier(tmp_path: Path) -> None:
    """Two puts of one key while the first one's write-through is held open: the second
    waits for it, then lands, so after a restart (disk only) the key holds the second."""
    cfg = load_config(
        {
            "tiers": [
                {"type": "cpu", "capacity_bytes": 1 << 20},
                {"type": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 30},
            ]
        },
        env={},
    )
    disk = HeldDisk(cfg.tiers[1], cfg.namespace)  # type: ignore[arg-type]
    store = await TieredStore(cfg, tiers=[open_tier(cfg.tiers[0], cfg.namespace), disk]).open()
    assert await store.put_object("k", b"old")
    await disk.entered.wait()  # the write-through of "old" is under way, held
    assert await store.put_object("k", b"new")
    disk.gate.set()
    await store.close()
    disk_only = {"tiers": [{"type": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 30}]}
    async with await open_store(disk_only) as again:
        got = await again.get_object("k")
        assert got is not None and bytes(got) == b"new"


async def test_reads_off_the_loop_come_from_disk_and_reach_the_books_at_the_next_call(
    tmp_path: Path,
) -> None:
    """``read_objects_into_now`` reads a disk tier's objects from an engine's thread; the
    hits, and the recency that eviction goes by, reach the ledger at the store's next
    operation. An object the fastest tier keeps in memory, or one gone from the disk
    behind the store's back, is left to ``read_object_into`` on the loop."""
    disk = {"type": "disk", "path": str(tmp_path / "d"), "capacity_bytes": 2500}
    store = await open_store({"tiers": [disk]})
    blobs = {k: os.urandom(1000) for k in ("a", "b", "c")}
    for k in ("a", "b"):
        assert await store.put_object(k, blobs[k])
    bufs = [memoryview(bytearray(600)), memoryview(bytearray(400))]
    ranges = [(0, 600), (600, 400)]
    got = await asyncio.to_thread(
        store.read_objects_into_now, [("a", ranges, bufs), ("absent", [(0, 1)], [bufs[0][:1]])]
    )
    assert got == [True, False]
    assert b"".join(bytes(b) for b in bufs) == blobs["a"]
    assert store.stats()["tiers"]["disk"]["hits"] == 0  # not told yet
    # The next put learns of the read first: "a" was used after "b", so "b" makes room.
    assert await store.put_object("c", blobs["c"])
    assert store.stats()["tiers"]["disk"]["hits"] == 1
    assert store.held("a") and not store.held("b") and store.held("c")
    # Gone from the disk behind the store's back: not read off the loop; on the loop a
    # miss, and the ledger heals.
    next((tmp_path / "d" / "objects").rglob("*%2Fc")).unlink()
    one = [memoryview(bytearray(10))]
    assert await asyncio.to_thread(store.read_objects_into_now, [("c", [(0, 10)], one)]) == [False]
    assert not await store.read_object_into("c", [(0, 10)], one)
    assert not store.held("c")
    await store.close()
    # A cpu tier in front holds it: the loop reads it (a memory tier is not read off it).
    cpu = {"type": "cpu", "capacity_bytes": 1 << 20}
    async with await open_store({"tiers": [cpu, {**disk, "capacity_bytes": 1 << 20}]}) as s2:
        assert await s2.put_object("m", blobs["a"])
        into = [memoryview(bytearray(1000))]
        assert await asyncio.to_thread(s2.read_objects_into_now, [("m", [(0, 1000)], into)]) == [
            False
        ]
        assert await s2.read_object_into("m", [(0, 1000)], into)
        assert bytes(into[0]) == blobs["a"]


def test_a_store_thread_hands_a_batch_over_at_once_and_settles_each_future() -> None:
    """``StoreThread.start_all`` runs each coroutine on the store's loop and sets its
    outcome on its own future (callbacks added before the hand-over run); a future
    cancelled first never runs its coroutine; on a closed loop every future fails."""
    st = StoreThread({"tiers": [{"type": "cpu", "capacity_bytes": 1 << 20}]}, "t")
    ran: list[int] = []

    async def double(x: int) -> int:
        await asyncio.sleep(0)
        ran.append(x)
        return 2 * x

    async def bad() -> int:
        raise ValueError("no such chunk")

    try:
        futs: list[Future[int]] = [Future() for _ in range(4)]
        seen: list[int] = []
        futs[0].add_done_callback(lambda f: seen.append(f.result()))
        futs[3].cancel()
        st.start_all([(double(1), futs[0]), (bad(), futs[1]), (double(5), futs[2])])
        st.start_all([(double(7), futs[3])])
        assert futs[0].result(10) == 2 and futs[2].result(10) == 10
        with pytest.raises(ValueError, match="no such chunk"):
            futs[1].result(10)
        st.call(asyncio.sleep(0))  # the cancelled one's turn has passed
        assert seen == [2] and sorted(ran) == [1, 5], "the cancelled coroutine never ran"
    finally:
        st.close()
    st.loop.close()
    late: Future[int] = Future()
    with pytest.raises(RuntimeError):
        st.start_all([(double(9), late)])
    with pytest.raises(RuntimeError):
        late.result(0)
