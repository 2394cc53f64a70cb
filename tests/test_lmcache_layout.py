"""The LMCache chunk layout alone (``adapters/lmcache/layout.py``, no LMCache, no I/O):
where the pools of each layer lie in a chunk object of each page count, what a get
reads, and the page count of an object from its size."""

from __future__ import annotations

import torch

from hurray_store.adapters.lmcache.layout import ChunkLayout
from hurray_store.format.records import chunk_record_bytes

LAYERS, HEADS, DIM, CHUNK, PAGE = 3, 2, 8, 40, 16  # chunks of 40 tokens: 3 pages, the last partial


def _layout() -> ChunkLayout:
    return ChunkLayout(LAYERS, HEADS, DIM, CHUNK, torch.float16, False, PAGE)


def test_pools_lie_in_order_inside_the_object_and_the_record_ends_it() -> None:
    lay = _layout()
    page_bytes = PAGE * HEADS * DIM * 2
    for pages in (1, 2, 3):
        pools, size = lay.layout(pages)
        assert len(pools) == LAYERS
        flat = [off for pair in pools for off in pair]
        assert flat == sorted(flat) and len(set(flat)) == len(flat)
        for k, v in pools:
            assert v - k >= pages * page_bytes, "a key pool holds every page before the value"
        last_value = pools[-1][1]
        assert last_value + pages * page_bytes <= size - chunk_record_bytes(LAYERS)


def test_a_get_reads_each_pool_s_tokens_then_the_record() -> None:
    lay = _layout()
    for pages, tokens in ((1, 16), (2, 32), (3, CHUNK)):
        ranges = lay.ranges_of(pages)
        pools, size = lay.layout(pages)
        assert len(ranges) == 2 * LAYERS + 1
        assert [off for off, _ in ranges[:-1]] == [off for pair in pools for off in pair]
        assert {n for _, n in ranges[:-1]} == {lay.token_bytes(tokens)}
        assert ranges[-1] == (size - lay.record_bytes, lay.record_bytes)


def test_an_object_s_size_names_its_page_count_and_no_other_size_does() -> None:
    lay = _layout()
    sizes = {lay.layout(p)[1]: p for p in (1, 2, 3)}
    assert len(sizes) == 3
    for size, pages in sizes.items():
        assert lay.pages_of(size) == pages
        assert lay.pages_of(size + 1) is None and lay.pages_of(size - 1) is None


def test_the_fingerprint_tells_layouts_apart() -> None:
    base = _layout().fingerprint
    others = [
        ChunkLayout(LAYERS + 1, HEADS, DIM, CHUNK, torch.float16, False, PAGE),
        ChunkLayout(LAYERS, HEADS, DIM, CHUNK, torch.bfloat16, False, PAGE),
        ChunkLayout(LAYERS, HEADS, DIM, CHUNK, torch.float16, True, PAGE),
        ChunkLayout(LAYERS, HEADS, DIM, CHUNK, torch.float16, False, 8),
    ]
    assert len({base, *(o.fingerprint for o in others)}) == 5
