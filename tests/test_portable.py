"""Portable pages (``engine/portable.py``): KV stored by ranks of one tensor-parallel
size, or at one page size, read by a reader of another, through the engine port's
prefix calls (``put_pages``, ``lookup_tokens``, ``load_pages``) on real tiers. Every
read is compared with the writer's bytes token by token."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from hurray_store import KVSpec, PagedKVPool
from hurray_store.engine import EnginePort
from hurray_store.engine.portable import head_pieces, sources
from hurray_store.errors import SpecError
from hurray_store.spec import rank_heads

H, D, L = 4, 8, 3  # the model's KV heads, head size, layers
FULL = KVSpec("portable-model", L, H, D, 16, torch.float32)


def rank_spec(tp: int, rank: int, page_size: int = 16) -> KVSpec:
    start, n = rank_heads(H, rank, tp)
    return replace(FULL, num_kv_heads=n, head_start=start, total_kv_heads=H, page_size=page_size)


def model_kv(n_tokens: int, seed: int = 0) -> torch.Tensor:
    """The whole model's K and V of one sequence: ``[layers, 2, tokens, H, D]``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, n_tokens, H, D, generator=g)


def pool_of(spec: KVSpec, kv: torch.Tensor) -> tuple[PagedKVPool, list[int]]:
    """A pool of ``spec`` holding ``kv``'s tokens (its heads), pages in a shuffled order."""
    P = spec.page_size
    n = kv.shape[2] // P
    pool = PagedKVPool(spec, n + 3)
    table = pool.allocate(n + 3)[3:][::-1]
    a, b = spec.heads
    for li in range(L):
        for j, page in enumerate(table):
            pool.layers[li][:, page] = kv[li, :, j * P : (j + 1) * P, a:b]
    return pool, table


def read_back(port: EnginePort, spec: KVSpec, toks: list[int]) -> tuple[int, torch.Tensor]:
    """Load ``toks`` into a fresh pool of ``spec``: the tokens served and their K/V
    ``[layers, 2, served, heads, D]``."""
    P = spec.page_size
    pool = PagedKVPool(spec, len(toks) // P + 2)

    async def run() -> Any:
        last = None
        async for layer in port.load_pages(pool, [toks], [None]):
            last = layer
        return last

    last = port.call(run())
    n = last.num_tokens[0]
    table = last.block_tables[0]
    assert len(table) == n // P
    out = torch.stack(
        [
            torch.cat([pool.layers[li][:, p] for p in table], dim=1)
            if table
            else torch.empty(spec.roles, 0, spec.num_kv_heads, spec.head_dim)
            for li in range(L)
        ]
    )
    return n, out


@pytest.fixture
def port(tmp_path: Path) -> Iterator[EnginePort]:
    cfg = {
        "namespace": "t",
        "tiers": [{"type": "disk", "path": str(tmp_path / "d"), "capacity_bytes": 64 << 20}],
        "engine": {"page_sizes": [8, 16, 32, 64]},
    }
    p = EnginePort(cfg)
    yield p
    p.close()


def save(port: EnginePort, spec: KVSpec, kv: torch.Tensor, toks: list[int]) -> None:
    pool, table = pool_of(spec, kv)
    r = port.call(port.put_pages(pool, [toks], [table], [None]))
    assert r.pages_written == len(toks) // spec.page_size


def test_a_ranks_heads_are_named_by_their_range_not_its_rank() -> None:
    assert [rank_heads(4, r, 2) for r in range(2)] == [(0, 2), (2, 2)]
    assert [rank_heads(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert rank_heads(8, 0, 1) == (0, 8)
    with pytest.raises(SpecError, match="do not split"):
        rank_heads(4, 0, 3)
    with pytest.raises(SpecError, match="within the model"):
        KVSpec("m", 1, 2, 8, 16, torch.float32, head_start=3, total_kv_heads=4)
    # ranks 0 and 1 of TP=8 over 4 heads hold the same head: the same spec, one key
    assert rank_spec(8, 0) == rank_spec(8, 1) != rank_spec(8, 2)
    assert rank_spec(1, 0).fingerprint() == replace(FULL, total_kv_heads=H).fingerprint()


def test_the_sources_of_a_reader_start_with_its_own_layout() -> None:
    reader = rank_spec(2, 1)  # heads [2, 4)
    srcs = sources(reader, [8, 16, 24])
    assert srcs[0].exact and srcs[0].pieces[0].spec == reader
    # at its page size: width 1 (two pieces), width 4 (a slice of the whole); no width 2
    same = [s for s in srcs[1:] if s.pieces[0].spec.page_size == 16]
    assert sorted(len(s.pieces) for s in same) == [1, 2]
    wide = next(s for s in same if len(s.pieces) == 1).pieces[0]
    assert wide.spec.heads == (0, 4) and wide.take == (2, 4) and wide.put == 0
    # 24 neither divides 16 nor is divided by it
    assert {s.pieces[0].spec.page_size for s in srcs} == {8, 16}
    assert head_pieces(rank_spec(2, 1), 3, 16) is None


@pytest.mark.parametrize(
    "writer_tp, reader_tp",
    [(2, 1), (1, 2), (4, 1), (1, 4), (2, 4), (4, 2)],
)
def test_pages_written_at_one_tp_size_load_bit_exact_at_another(
    port: EnginePort, writer_tp: int, reader_tp: int
) -> None:
    toks = list(range(1000, 1064))  # 4 pages of 16
    kv = model_kv(64)
    for r in range(writer_tp):
        save(port, rank_spec(writer_tp, r), kv, toks)
    specs = [rank_spec(reader_tp, r) for r in range(reader_tp)]
    assert port.lookup_tokens(specs, toks, None) == 64
    for spec in specs:
        n, got = read_back(port, spec, toks)
        a, b = spec.heads
        assert n == 64
        assert torch.equal(got, kv[:, :, :64, a:b])


def test_replicated_heads_are_stored_once_by_the_ranks_that_share_them(port: EnginePort) -> None:
    toks = list(range(64))
    kv = model_kv(64)
    written = 0
    for r in range(8):  # TP=8 over 4 heads: every head on two ranks
        pool, table = pool_of(rank_spec(8, r), kv)
        res = port.call(port.put_pages(pool, [toks], [table], [None]))
        written += res.pages_written
    assert written == 4 * 4  # 4 head ranges x 4 pages, each once
    n, got = read_back(port, rank_spec(1, 0), toks)
    assert n == 64 and torch.equal(got, kv)


def test_a_head_range_nobody_wrote_is_a_miss_never_a_half_filled_page(port: EnginePort) -> None:
    toks = list(range(64))
    kv = model_kv(64)
    save(port, rank_spec(2, 0), kv, toks)  # rank 1 of 2 never wrote
    whole = rank_spec(1, 0)
    assert port.lookup_tokens([whole], toks, None) == 0
    n, _ = read_back(port, whole, toks)
    assert n == 0
    # the heads that were written are there for a reader of just them
    n, got = read_back(port, rank_spec(4, 1), toks)
    assert n == 64 and torch.equal(got, kv[:, :, :, 1:2])


def test_a_piece_shorter_than_the_others_serves_the_shortest(port: EnginePort) -> None:
    toks = list(range(64))
    kv = model_kv(64)
    save(port, rank_spec(2, 0), kv, toks)
    save(port, rank_spec(2, 1), kv[:, :, :32], toks[:32])
    whole = rank_spec(1, 0)
    assert port.lookup_tokens([whole], toks, None) == 32
    n, got = read_back(port, whole, toks)
    assert n == 32 and torch.equal(got, kv[:, :, :32])


@pytest.mark.parametrize("writer, reader", [(32, 16), (16, 32), (8, 32), (64, 16)])
def test_pages_of_another_page_size_are_re_paged_into_the_readers(
    port: EnginePort, writer: int, reader: int
) -> None:
    toks = list(range(500, 600))  # 100 tokens
    kv = model_kv(100)
    w = rank_spec(1, 0, writer)
    save(port, w, kv[:, :, : 100 // writer * writer], toks[: 100 // writer * writer])
    r = rank_spec(1, 0, reader)
    # only whole reader pages inside the stored prefix are served
    want = (100 // writer * writer) // reader * reader
    assert port.lookup_tokens([r], toks, None) == want
    n, got = read_back(port, r, toks)
    assert n == want and torch.equal(got, kv[:, :, :want])


def test_another_tp_size_and_page_size_at_once(port: EnginePort) -> None:
    toks = list(range(128))
    kv = model_kv(128)
    for r in range(2):
        save(port, rank_spec(2, r, 32), kv, toks)
    spec = rank_spec(4, 3, 16)
    n, got = read_back(port, spec, toks)
    assert n == 128 and torch.equal(got, kv[:, :, :, 3:4])


def test_a_page_size_the_config_does_not_name_is_not_read(tmp_path: Path) -> None:
    cfg = {
        "namespace": "t",
        "tiers": [{"type": "disk", "path": str(tmp_path / "d"), "capacity_bytes": 64 << 20}],
        "engine": {"page_sizes": []},
    }
    p = EnginePort(cfg)
    try:
        toks = list(range(64))
        kv = model_kv(64)
        save(p, rank_spec(1, 0, 32), kv, toks)
        assert p.lookup_tokens([rank_spec(1, 0, 16)], toks, None) == 0
        # heads are always portable
        assert p.lookup_tokens([rank_spec(2, 1, 32)], toks, None) == 64
    finally:
        p.close()


def test_a_corrupt_piece_is_a_miss_from_its_bad_page_on(tmp_path: Path) -> None:
    cfg = {
        "namespace": "t",
        "tiers": [{"type": "disk", "path": str(tmp_path / "d"), "capacity_bytes": 64 << 20}],
    }
    toks = list(range(64))
    kv = model_kv(64)
    p = EnginePort(cfg)
    try:
        save(p, rank_spec(2, 0), kv, toks)
        p.flush()
        before = {f for f in (tmp_path / "d").rglob("*") if f.is_file()}
        save(p, rank_spec(2, 1), kv, toks)
        p.flush()
    finally:
        p.close()
    # one byte flipped in the last page of every layer object of rank 1's segment
    files = [
        f
        for f in (tmp_path / "d").rglob("*")
        if f.is_file() and f not in before and f.stat().st_size > 4096
    ]
    assert len(files) == L
    for f in files:
        b = bytearray(f.read_bytes())
        b[len(b) * 7 // 8] ^= 0xFF
        f.write_bytes(bytes(b))
    p = EnginePort(cfg)
    try:
        n, got = read_back(p, rank_spec(1, 0), toks)
        assert n < 64  # a miss from the bad page of the corrupt piece on (here: its object)
        assert torch.equal(got, kv[:, :, :n])
        n, got = read_back(p, rank_spec(2, 0), toks)  # the sound range is whole
        assert n == 64 and torch.equal(got, kv[:, :, :, :2])
    finally:
        p.close()


def test_the_own_layout_wins_when_it_holds_every_page(port: EnginePort) -> None:
    toks = list(range(64))
    kv = model_kv(64)
    save(port, rank_spec(1, 0), kv, toks)
    other = kv + 1  # another layout holding other bytes (never read when the own holds all)
    for r in range(2):
        save(port, rank_spec(2, r), other, toks)
    n, got = read_back(port, rank_spec(1, 0), toks)
    assert n == 64 and torch.equal(got, kv)


MLA = KVSpec("mla-model", L, 1, 40, 16, torch.float32, fused=True)


def test_an_mla_latent_is_stored_once_as_fused_layer_objects_and_read_back(
    port: EnginePort, tmp_path: Path
) -> None:
    """A fused spec (an MLA latent, one tensor per layer): the same spec on every TP
    rank, so one write serves them all; each layer object is one fused block-paged
    descriptor, which pyhurray and ``hurray-store inspect`` read."""
    import hurray

    from hurray_store.cli.format_cmds import inspect_bytes

    assert MLA.roles == 1 and MLA.role_names == ("fused",)
    assert MLA.fingerprint() != replace(MLA, fused=False).fingerprint()
    with pytest.raises(SpecError, match="one head"):
        KVSpec("m", 1, 2, 8, 16, torch.float32, fused=True)
    toks = list(range(64))
    g = torch.Generator().manual_seed(3)
    latent = torch.randn(L, 1, 64, 1, 40, generator=g)
    pool = PagedKVPool(MLA, 6)
    assert pool.layers[0].shape == (1, 6, 16, 1, 40)
    table = pool.allocate(6)[2:][::-1]
    for li in range(L):
        for j, page in enumerate(table):
            pool.layers[li][:, page] = latent[li, :, j * 16 : (j + 1) * 16]
    r = port.call(port.put_pages(pool, [toks], [table], [None]))
    assert r.pages_written == 4
    assert port.call(port.put_pages(pool, [toks], [table], [None])).pages_written == 0
    assert port.lookup_tokens([MLA], toks, None) == 64
    n, got = read_back(port, MLA, toks)
    assert n == 64 and torch.equal(got, latent)
    port.flush()
    objs = [f for f in (tmp_path / "d").rglob("*") if f.is_file() and f.stat().st_size > 4096]
    assert len(objs) == L
    tensors = list(hurray.StreamReader(objs[0].read_bytes()))
    assert [t.layout.kv_role for t in tensors] == ["fused"]
    assert "1 block-paged tensors" in inspect_bytes(objs[0].read_bytes())
    # and a reader of another page size re-pages the latent
    n, got = read_back(port, replace(MLA, page_size=32), toks)
    assert n == 64 and torch.equal(got, latent)
