"""The cpu tier's arena allocator and the pool of resident buffers."""

from __future__ import annotations

import random

from hurray_store.buffers import Arena, BufferPool


def test_arena_first_fit_alignment_and_coalescing() -> None:
    a = Arena(1024)
    x = a.alloc(100)
    y = a.alloc(64)
    z = a.alloc(1)
    assert (x, y, z) == (0, 128, 192)  # 64-aligned
    assert a.alloc(1024) is None  # does not fit beside them
    a.release(y, 64)
    assert a.alloc(60) == 128  # first fit reuses the hole
    a.release(128, 60)
    a.release(x, 100)
    a.release(z, 1)
    assert a.used == 0 and a._free == [[0, 1024]]  # everything coalesced back
    assert a.alloc(1024) == 0


def test_arena_random_alloc_release_never_overlaps() -> None:
    rng = random.Random(0)
    a = Arena(1 << 20)
    live: dict[int, int] = {}
    for _ in range(2000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            a.release(off, live.pop(off))
        else:
            n = rng.randrange(1, 20000)
            off = a.alloc(n)
            if off is not None:
                live[off] = n
        spans = sorted((o, o + (-(-n // 64) * 64)) for o, n in live.items())
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:], strict=False))
        assert a.used == sum(e - s for s, e in spans)
    for off, n in list(live.items()):
        a.release(off, n)
    assert a._free == [[0, 1 << 20]]


def test_arena_views_write_through_to_the_mapping() -> None:
    a = Arena(4096, populate=True)
    off = a.alloc(10)
    assert off is not None
    a.view[off : off + 3] = b"abc"
    assert bytes(a.view[off : off + 3]) == b"abc"


def test_buffer_pool_reuses_a_released_buffer_of_a_fitting_size() -> None:
    p = BufferPool(max_cached_bytes=8 << 20)
    b1 = p.acquire(1000)
    assert len(b1) >= 1000
    p.release(b1)
    assert p.acquire(900) is b1  # reused
    big = p.acquire(3 << 20)
    p.release(big)
    small = p.acquire(10)
    assert small is not big  # a buffer far larger than asked is not handed out
    p.release(small)
    p.release(p.acquire(16 << 20))  # over the cache cap: dropped, not kept
    assert p._cached <= 8 << 20
