"""PrefixIndex: exact behaviour, and a hypothesis run next to a dict model."""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from hurray_store import PageLocation, PrefixIndex


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()[:16]


def test_longest_prefix_stops_at_first_miss() -> None:
    idx = PrefixIndex()
    assert idx.insert(b"seg-a", 0, 0, [h(0), h(1), h(2)]) == 3
    assert idx.insert(b"seg-b", 1, 5, [h(10)]) == 1
    m = idx.longest_prefix([h(0), h(1), h(99), h(2)])
    assert m.num_pages == 2
    assert m.locations == [PageLocation(b"seg-a", 0, 0), PageLocation(b"seg-a", 0, 1)]
    m = idx.longest_prefix([h(10)])
    assert m.locations == [PageLocation(b"seg-b", 1, 5)]
    assert idx.longest_prefix([]).num_pages == 0
    assert len(idx) == 4 and h(2) in idx and h(3) not in idx


def test_first_writer_wins_and_duplicates_in_a_batch() -> None:
    idx = PrefixIndex()
    idx.insert(b"a", 0, 0, [h(1)])
    assert idx.insert(b"b", 2, 7, [h(1), h(2), h(2)]) == 1
    assert idx.longest_prefix([h(1), h(2)]).locations == [
        PageLocation(b"a", 0, 0),
        PageLocation(b"b", 2, 8),
    ]


def test_remove_segment_and_reinsert() -> None:
    idx = PrefixIndex()
    idx.insert(b"a", 0, 0, [h(i) for i in range(10)])
    idx.insert(b"b", 0, 10, [h(i) for i in range(10, 15)])
    assert idx.remove_segment(b"a") == 10
    assert idx.remove_segment(b"a") == 0
    assert len(idx) == 5 and idx.longest_prefix([h(0)]).num_pages == 0
    assert idx.longest_prefix([h(10), h(11)]).num_pages == 2  # probing passes tombstones
    idx.insert(b"c", 0, 0, [h(0)])
    assert idx.longest_prefix([h(0)]).locations == [PageLocation(b"c", 0, 0)]
    assert idx.segments() == [b"b", b"c"]


def test_growth_keeps_every_entry() -> None:
    idx = PrefixIndex(capacity=4)
    for s in range(50):
        idx.insert(f"s{s}".encode(), s, 0, [h(s * 100 + i) for i in range(40)])
    assert len(idx) == 2000
    for s in (0, 17, 49):
        m = idx.longest_prefix([h(s * 100 + i) for i in range(40)])
        assert m.num_pages == 40 and m.locations[39] == PageLocation(f"s{s}".encode(), s, 39)
    assert idx.remove_segment(b"s17") == 40
    assert idx.longest_prefix([h(1700)]).num_pages == 0


def test_memory_per_page_is_compact() -> None:
    idx = PrefixIndex(capacity=100_000)
    idx.insert(b"s", 0, 0, [h(i) for i in range(100_000)])
    assert idx.nbytes / len(idx) <= 100


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("insert"),
            st.integers(0, 5),
            st.integers(0, 3),
            st.lists(st.integers(0, 60), max_size=12),
        ),
        st.tuples(st.just("remove"), st.integers(0, 5)),
    ),
    max_size=40,
)


@settings(max_examples=100, deadline=None)
@given(ops, st.lists(st.integers(0, 60), max_size=15))
def test_matches_a_dict_model(program, query) -> None:
    idx = PrefixIndex(capacity=2)
    model: dict[bytes, PageLocation] = {}
    for op in program:
        if op[0] == "insert":
            _, seg, seq, keys = op
            sid = f"seg{seg}".encode()
            for i, k in enumerate(keys):
                model.setdefault(h(k), PageLocation(sid, seq, i))
            idx.insert(sid, seq, 0, [h(k) for k in keys])
        else:
            sid = f"seg{op[1]}".encode()
            n = idx.remove_segment(sid)
            gone = [k for k, v in model.items() if v.segment_id == sid]
            assert n == len(gone)
            for k in gone:
                del model[k]
        assert len(idx) == len(model)
    hashes = [h(k) for k in query]
    expect = []
    for x in hashes:
        if x not in model:
            break
        expect.append(model[x])
    m = idx.longest_prefix(hashes)
    assert m.num_pages == len(expect) and m.locations == expect
