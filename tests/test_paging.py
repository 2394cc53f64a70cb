"""Snapshot and restore: exact scenario tables, properties, errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hurray_store import KVSpec, PagedKVPool, PagingError, PoolExhaustedError, restore, snapshot
from hurray_store.format import decode_layer, encode_layer
from hurray_store.paging import Snapshot

SPEC = KVSpec("m", 2, 2, 8, 4, torch.float32)


def filled_pool(spec: KVSpec = SPEC, num_blocks: int = 10, seed: int = 0) -> PagedKVPool:
    pool = PagedKVPool(spec, num_blocks)
    g = torch.Generator().manual_seed(seed)
    for t in pool.layers:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return pool


# --------------------------------------------------------------------------- allocator


def test_allocator_fifo_and_refcounts() -> None:
    pool = PagedKVPool(SPEC, 4)
    assert pool.allocate(2) == [0, 1] and pool.num_free == 2
    pool.incref([1])
    pool.free([0, 1])
    assert pool.refcount(0) == 0 and pool.refcount(1) == 1 and pool.num_free == 3
    assert pool.allocate(3) == [2, 3, 0]
    pool.free([1])
    assert pool.allocate(1) == [1]


def test_allocating_more_than_free_allocates_nothing() -> None:
    pool = PagedKVPool(SPEC, 3)
    pool.allocate(2)
    with pytest.raises(PoolExhaustedError, match="asked for 2 pages, 1 of 3"):
        pool.allocate(2)
    assert pool.num_free == 1


def test_free_of_unallocated_page_is_refused_whole() -> None:
    pool = PagedKVPool(SPEC, 3)
    pool.allocate(1)
    with pytest.raises(PagingError, match="not allocated"):
        pool.free([0, 1])
    assert pool.refcount(0) == 1
    with pytest.raises(PagingError, match="not allocated"):
        pool.free([0, 0])


def test_from_tensors_wraps_without_copy() -> None:
    layers = [torch.zeros(2, 6, 4, 2, 8) for _ in range(2)]
    pool = PagedKVPool.from_tensors(SPEC, layers)
    assert pool.layers[0].data_ptr() == layers[0].data_ptr() and pool.num_pages == 6
    with pytest.raises(PagingError, match="expected"):
        PagedKVPool.from_tensors(SPEC, [torch.zeros(2, 6, 4, 2, 4)] * 2)
    with pytest.raises(PagingError, match="dtype"):
        PagedKVPool.from_tensors(SPEC, [torch.zeros(2, 6, 4, 2, 8, dtype=torch.float16)] * 2)


# --------------------------------------------------------------------------- scenario tables

SCENARIOS = [
    # (block tables, seq_lens, compacted tables, distinct source pages)
    ([[7, 3, 5], [7, 3, 9], [7]], [12, 10, 3], [[0, 1, 2], [0, 1, 3], [0]], [7, 3, 5, 9]),
    ([[1, 2, 3]], [5], [[0, 1]], [1, 2]),  # the table is longer than the tokens need
    ([[4, 4, 2]], [12], [[0, 0, 1]], [4, 2]),  # aliasing inside one sequence
    ([[6], [6], [6]], [4, 2, 1], [[0], [0], [0]], [6]),
    ([[], [0]], [0, 4], [[], [0]], [0]),  # an empty sequence
    ([], [], [], []),  # an empty batch
]


@pytest.mark.parametrize("tables, lens, compacted, distinct", SCENARIOS)
def test_snapshot_scenarios(tables, lens, compacted, distinct) -> None:
    pool = filled_pool()
    snap = snapshot(pool, tables, lens)
    assert snap.block_tables == compacted
    assert snap.source_pages == distinct
    for lay in snap.layers:
        assert lay.num_pages == len(distinct)
        assert lay.block_table.tolist() == [p for t in compacted for p in t]
        for j, src in enumerate(distinct):
            assert torch.equal(lay.keys[j], pool.layers[lay.layer_index][0, src])
            assert torch.equal(lay.values[j], pool.layers[lay.layer_index][1, src])


RESTORES = [
    # (scenario index, seqs, num_pages, pre-allocated, new tables, refcounts of new pages)
    (0, None, None, 2, [[2, 3, 4], [2, 3, 5], [2]], {2: 3, 3: 2, 4: 1, 5: 1}),
    (0, [1], [2], 0, [[0, 1]], {0: 1, 1: 1}),
    (0, [2, 0], [1, 1], 1, [[1], [1]], {1: 2}),
    (2, None, None, 0, [[0, 0, 1]], {0: 1, 1: 1}),
    (3, [0, 2], None, 3, [[3], [3]], {3: 2}),
]


@pytest.mark.parametrize("sc, seqs, num_pages, pre, tables, refs", RESTORES)
def test_restore_scenarios(sc, seqs, num_pages, pre, tables, refs) -> None:
    src = filled_pool()
    snap = snapshot(src, SCENARIOS[sc][0], SCENARIOS[sc][1])
    dst = PagedKVPool(SPEC, 8)
    dst.allocate(pre)
    before = dst.num_free
    out = restore(snap, dst, seqs=seqs, num_pages=num_pages)
    assert out == tables
    assert {p: dst.refcount(p) for p in refs} == refs
    assert dst.num_free == before - len(refs)


def test_zero_unused_slots_respects_sharers() -> None:
    pool = filled_pool()
    original = [t.clone() for t in pool.layers]
    # page 0 is used 2 slots by seq 0 and 3 by seq 1; page 1 holds 1 valid slot of seq 2
    snap = snapshot(pool, [[0], [0], [5, 1]], [2, 3, 5], zero_unused_slots=True)
    for lay in snap.layers:
        src = pool.layers[lay.layer_index]
        assert torch.equal(lay.keys[0, :3], src[0, 0, :3]) and bool((lay.keys[0, 3] == 0).all())
        assert torch.equal(lay.values[2, :1], src[1, 1, :1]) and bool(
            (lay.values[2, 1:] == 0).all()
        )
        assert torch.equal(lay.keys[1], src[0, 5])  # a full page is untouched
    assert all(torch.equal(a, b) for a, b in zip(original, pool.layers, strict=True))


def test_snapshot_selected_layers() -> None:
    snap = snapshot(filled_pool(), [[1]], [4], layers=[1])
    assert [lay.layer_index for lay in snap.layers] == [1]


# --------------------------------------------------------------------------- errors


def test_short_block_table() -> None:
    with pytest.raises(PagingError, match="9 tokens need 3 pages of 4, its block table has 2"):
        snapshot(filled_pool(), [[0, 1]], [9])


def test_unknown_page_id() -> None:
    with pytest.raises(PagingError, match="unknown page id 10"):
        snapshot(filled_pool(), [[0, 10]], [8])


def test_pool_exhausted_leaks_nothing() -> None:
    snap = snapshot(filled_pool(), [[0, 1, 2], [0, 1, 3]], [12, 12])
    dst = PagedKVPool(SPEC, 4)
    dst.allocate(1)
    with pytest.raises(PoolExhaustedError):
        restore(snap, dst)
    assert dst.num_free == 3
    assert [dst.refcount(p) for p in range(4)] == [1, 0, 0, 0]


def test_restore_into_a_pool_of_another_shape() -> None:
    snap = snapshot(filled_pool(), [[0]], [4])
    other = PagedKVPool(KVSpec("m", 2, 2, 8, 8, torch.float32), 4)
    with pytest.raises(PagingError, match="page_size"):
        restore(snap, other)
    assert other.num_free == 4


def test_restore_bad_arguments() -> None:
    snap = snapshot(filled_pool(), [[0, 1]], [8])
    with pytest.raises(PagingError):
        restore(snap, PagedKVPool(SPEC, 4), seqs=[1])
    with pytest.raises(PagingError):
        restore(snap, PagedKVPool(SPEC, 4), num_pages=[3])


# --------------------------------------------------------------------------- properties


@st.composite
def batches(draw):
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    spec = KVSpec(
        "m",
        draw(st.integers(1, 3)),
        draw(st.integers(1, 3)),
        draw(st.sampled_from([1, 4, 8])),
        page_size,
        dtype,
    )
    num_blocks = draw(st.integers(1, 24))
    nseq = draw(st.integers(0, 6))
    tables, lens = [], []
    for _ in range(nseq):
        n_tok = draw(st.integers(0, 5 * page_size))
        need = -(-n_tok // page_size)
        extra = draw(st.integers(0, 1))
        tables.append(
            draw(
                st.lists(
                    st.integers(0, num_blocks - 1), min_size=need + extra, max_size=need + extra
                )
            )
        )
        lens.append(n_tok)
    return spec, num_blocks, tables, lens, draw(st.integers(0, 2**16)), draw(st.booleans())


def check_restored(src: PagedKVPool, tables, lens, dst: PagedKVPool, new_tables, layers) -> None:
    P = src.spec.page_size
    for s, n in enumerate(lens):
        for t in range(n):
            a, b = tables[s][t // P], new_tables[s][t // P]
            for li in layers:
                assert torch.equal(src.layers[li][:, a, t % P], dst.layers[li][:, b, t % P])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_restore_equals_original_for_every_valid_token(batch) -> None:
    spec, num_blocks, tables, lens, seed, through_codec = batch
    src = filled_pool(spec, num_blocks, seed)
    snap = snapshot(src, tables, lens, zero_unused_slots=bool(seed % 2))
    if through_codec:  # the same, through encode/decode of every layer
        snap = Snapshot(
            spec,
            [decode_layer(encode_layer(lay)) for lay in snap.layers],
            snap.seq_lens,
            snap.block_tables,
            snap.source_pages,
        )
    dst = PagedKVPool(spec, snap.num_pages + 3)
    dst.allocate(3)
    new_tables = restore(snap, dst)
    check_restored(src, tables, lens, dst, new_tables, range(spec.num_layers))
    # exact accounting: one new page per distinct stored page; holders counted per sequence
    assert dst.num_free == 0
    holders: dict[int, int] = {}
    for t in new_tables:
        for p in set(t):
            holders[p] = holders.get(p, 0) + 1
    for p in range(3, dst.num_pages):
        assert dst.refcount(p) == holders.get(p, 0) >= 1
    # sharing survives: entries that named one source page name one new page
    pairs = {
        (tables[s][i], new_tables[s][i])
        for s in range(len(tables))
        for i in range(len(new_tables[s]))
    }
    assert len({a for a, _ in pairs}) == len(pairs) == len({b for _, b in pairs})


def test_snapshot_into_a_staging_buffer() -> None:
    pool = filled_pool()
    staging = torch.zeros(2, 2, 5, 4, 2, 8)
    snap = snapshot(pool, [[7, 3], [7, 2]], [8, 6], out=staging)
    ref = snapshot(pool, [[7, 3], [7, 2]], [8, 6])
    for a, b in zip(snap.layers, ref.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert snap.layers[1].values.data_ptr() == staging[1, 1].data_ptr()
    with pytest.raises(PagingError, match="out must be"):
        snapshot(pool, [[0, 1, 2, 3, 4, 5]], [24], out=staging)
