"""Portable pages: KV stored at one tensor-parallel size or page size, read at another
(docs/store.md, "Portable pages").

A page's key names the model's KV heads it holds (``KVSpec.head_start``,
``num_kv_heads``, ``total_kv_heads``) and its page size, never a rank. A reader that
needs heads ``[c, d)`` at page size ``P`` asks first for exactly that (the same layout:
the store's own retrieve, untouched); where that falls short it asks for the other
layouts that can deliver the same heads and tokens, and takes, per sequence, the one
that delivers the most:

- **heads**: every range of a width that divides the model's heads, aligned to it, as a
  TP size that divides them splits them: a wider stored range that contains the
  reader's (a slice of it), or the narrower ones that tile it (one object each, all of
  them needed: a page counts only where every piece has it);
- **page sizes**: each of ``page_sizes`` that divides ``P`` or that ``P`` divides
  (``engine.page_sizes``); the stored tokens are re-paged into the reader's pages, and
  a reader page that the stored prefix does not fill is not served.

Every stored piece is read by the store's retrieve into a staging pool of its own
layout (so checked as every read is: its manifest's fingerprint names exactly that
layout, its pages their checksums), then copied token by token into the reader's
pages. Nothing of a piece that failed reaches the reader: a sequence is served up to
the shortest of its pieces.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from hurray_store.paging import PagedKVPool
from hurray_store.spec import KVSpec
from hurray_store.store import RetrievedLayer, TieredStore


@dataclass(frozen=True, slots=True)
class Piece:
    """One stored layout read for a reader: its spec, the heads ``take`` of it (local
    to the piece) and where they go among the reader's heads (``put``, local)."""

    spec: KVSpec
    take: tuple[int, int]
    put: int


@dataclass(frozen=True, slots=True)
class Source:
    """A way to deliver a reader's heads at its page size: the pieces, all needed;
    ``exact``: the reader's own layout (one piece, its own spec)."""

    pieces: tuple[Piece, ...]
    exact: bool = False

    @property
    def page_size(self) -> int:
        return self.pieces[0].spec.page_size


def divisors(n: int) -> list[int]:
    return [w for w in range(1, n + 1) if n % w == 0]


def tiles(
    heads: tuple[int, int], total: int, width: int
) -> list[tuple[int, tuple[int, int], int]] | None:
    """How stored ranges ``width`` heads wide (aligned to it) of a model's ``total``
    heads hold the heads ``[c, d)``: per range its first head, the heads taken of it
    (local to it) and where they go (local to ``[c, d)``); None when they cannot."""
    c, d = heads
    W = d - c
    if width >= W:
        s = c // width * width
        if s + width < d or s + width > total:
            return None
        return [(s, (c - s, d - s), 0)]
    if W % width or c % width:
        return None
    return [(c + j, (0, width), j) for j in range(0, W, width)]


def head_pieces(spec: KVSpec, width: int, page_size: int) -> tuple[Piece, ...] | None:
    """The pieces of stored ranges ``width`` heads wide (aligned to it) that hold the
    heads of ``spec``; None when that width cannot tile them."""
    got = tiles(spec.heads, spec.total_kv_heads, width)
    if got is None:
        return None
    return tuple(
        Piece(replace(spec, page_size=page_size, num_kv_heads=width, head_start=s), take, put)
        for s, take, put in got
    )


def sources(spec: KVSpec, page_sizes: Sequence[int] = ()) -> list[Source]:
    """The layouts a reader of ``spec`` can load from, its own first: other head
    widths at its page size, then each other page size of ``page_sizes`` that divides
    its own or that its own divides (nearest first), every head width."""
    P = spec.page_size
    own = Source((Piece(spec, (0, spec.num_kv_heads), 0),), exact=True)
    out = [own]
    widths = divisors(spec.total_kv_heads)
    others = sorted(
        {q for q in page_sizes if q != P and q > 0 and (q % P == 0 or P % q == 0)},
        key=lambda q: (max(q, P) // min(q, P), q),
    )
    for q in [P, *others]:
        for w in widths:
            if q == P and w == spec.num_kv_heads:
                continue
            pieces = head_pieces(spec, w, q)
            if pieces is not None:
                out.append(Source(pieces))
    return out


async def _held(
    store: TieredStore, source: Source, seqs: Sequence[Sequence[int]], salts: Sequence[Any], P: int
) -> list[int]:
    """Per sequence, the leading tokens every piece of ``source`` delivers, in whole
    pages of ``P``."""
    got = await asyncio.gather(
        *(store.lookup(p.spec, seqs, salt=list(salts)) for p in source.pieces)
    )
    return [min(col) // P * P for col in zip(*got, strict=True)]


async def _probe(
    store: TieredStore, source: Source, seqs: Sequence[Sequence[int]], salts: Sequence[Any]
) -> bool:
    """Whether every piece of ``source`` holds the first page of some sequence (one
    page hashed per piece, the pieces asked one after another up to the first that
    holds none)."""
    firsts = [list(t[: source.page_size]) for t in seqs]
    held = [True] * len(seqs)
    for p in source.pieces:
        got = await store.lookup(p.spec, firsts, salt=list(salts))
        held = [h and n > 0 for h, n in zip(held, got, strict=True)]
        if not any(held):
            return False
    return True


async def choose(
    store: TieredStore,
    spec: KVSpec,
    seqs: Sequence[Sequence[int]],
    salts: Sequence[Any],
    page_sizes: Sequence[int] = (),
) -> list[tuple[int, Source]]:
    """Per sequence, the tokens (whole pages of ``spec.page_size``) a load can deliver
    and the source it reads them from: the reader's own layout when it holds every
    page asked (no other is asked), else the one that delivers the most (the own
    layout on a tie). Another layout is first asked for each sequence's first page
    alone (one page hashed): only one that holds it is asked for the rest."""
    P = spec.page_size
    cands = sources(spec, page_sizes)
    own = await _held(store, cands[0], seqs, salts, P)
    want = [len(t) // P * P for t in seqs]
    if len(cands) == 1 or own == want:
        return [(n, cands[0]) for n in own]
    others = cands[1:]
    probes = await asyncio.gather(*(_probe(store, s, seqs, salts) for s in others))
    live = [s for s, ok in zip(others, probes, strict=True) if ok]
    alts = await asyncio.gather(*(_held(store, s, seqs, salts, P) for s in live))
    out = []
    for i, n in enumerate(own):
        best, src = n, cands[0]
        for s, got in zip(live, alts, strict=True):
            if got[i] > best:
                best, src = got[i], s
        out.append((best, src))
    return out


async def tokens_held(
    store: TieredStore,
    specs: Sequence[KVSpec],
    toks: Sequence[int],
    salt: Any,
    page_sizes: Sequence[int] = (),
) -> int:
    """How many leading tokens of ``toks`` every one of ``specs`` (an engine's ranks)
    can load, each from its best source."""
    uniq = list(dict.fromkeys(specs))  # ranks holding the same heads ask once
    got = await asyncio.gather(*(choose(store, s, [toks], [salt], page_sizes) for s in uniq))
    return min(c[0][0] for c in got)


def unit_index(pages: Sequence[int], page_size: int, unit: int, n: int) -> np.ndarray:
    """The indices of the ``unit``-token runs holding tokens ``[0, n)`` of a sequence
    whose pages are ``pages``, in a pool viewed as runs of ``unit`` tokens (``unit``
    divides ``page_size`` and ``n``)."""
    per = page_size // unit
    k = np.arange(n // unit)
    return np.asarray(pages, dtype=np.int64)[k // per] * per + k % per


def copy_units(
    dst: torch.Tensor, di: np.ndarray, src: torch.Tensor, si: np.ndarray, piece: Piece, unit: int
) -> None:
    """Runs ``si`` of ``src`` (one layer of a staging pool, ``[2, pages, P', w, D]``)
    heads ``piece.take`` into runs ``di`` of ``dst`` (the reader's layer, ``[2, pages,
    P, H, D]``) heads from ``piece.put``, a run being ``unit`` tokens. Consecutive runs
    on both sides are copied as one slice (pages are mostly handed out in order: a
    copy per sequence or fewer, at memory speed, where an indexed copy of heads ran at
    a fifth of it)."""
    a, b = piece.take
    R = dst.shape[0]  # roles: 2, or 1 for a fused latent
    d = dst.view(R, -1, unit, dst.shape[3], dst.shape[4])[:, :, :, piece.put : piece.put + b - a]
    s = src.view(R, -1, unit, src.shape[3], src.shape[4])[:, :, :, a:b]
    if not len(di):
        return
    cut = np.flatnonzero((np.diff(di) != 1) | (np.diff(si) != 1)) + 1
    for x, y in zip(np.r_[0, cut].tolist(), np.r_[cut, len(di)].tolist(), strict=True):
        p, q = int(di[x]), int(si[x])
        d[:, p : p + y - x].copy_(s[:, q : q + y - x])


def _staging(spec: KVSpec, pages: int) -> PagedKVPool:
    """A pool of ``pages`` pages of ``spec`` left unset (the store writes every page it
    delivers; no other is read)."""
    shape = (spec.roles, pages, spec.page_size, spec.num_kv_heads, spec.head_dim)
    return PagedKVPool.from_tensors(
        spec, [torch.empty(shape, dtype=spec.dtype) for _ in range(spec.num_layers)]
    )


async def load_layers(
    store: TieredStore,
    pool: PagedKVPool,
    seqs: Sequence[Sequence[int]],
    salts: Sequence[Any],
    page_sizes: Sequence[int] = (),
    skip: Sequence[int] | None = None,
) -> AsyncGenerator[RetrievedLayer, None]:
    """The longest prefix of each sequence a source delivers, into ``pool`` a layer at
    a time (``TieredStore.retrieve_layers``'s contract: the last item is the final
    word; closing early gives the pages back). Sequences whose best source is the
    pool's own layout are retrieved straight into it, as ever; ``skip``: their leading
    pages the caller holds, not read (another layout's pieces are read whole)."""
    spec = pool.spec
    P = spec.page_size
    chosen = await choose(store, spec, seqs, salts, page_sizes)
    if all(src.exact for _, src in chosen):
        stream = store.retrieve_layers(pool, seqs, salt=list(salts), skip=skip)
        try:
            async for layer in stream:
                yield layer
        finally:
            await stream.aclose()
        return
    own = [i for i, (_, src) in enumerate(chosen) if src.exact]
    groups: dict[Source, list[int]] = {}
    for i, (n, src) in enumerate(chosen):
        if not src.exact and n > 0:
            groups.setdefault(src, []).append(i)
    streams: list[Any] = []
    plans: list[tuple[Source, list[int], list[list[int]], list[Any]]] = []
    mine: list[int] = []  # pages of ``pool`` this took for the other layouts
    try:
        if own:
            streams.append(
                store.retrieve_layers(
                    pool,
                    [seqs[i] for i in own],
                    salt=[salts[i] for i in own],
                    skip=None if skip is None else [skip[i] for i in own],
                )
            )
        for src, idx in groups.items():
            toks = [list(seqs[i][: chosen[i][0]]) for i in idx]
            dst = [pool.allocate(len(t) // P) for t in toks]
            mine += [p for d in dst for p in d]
            piece_streams = []
            for piece in src.pieces:
                q = piece.spec.page_size
                staging = _staging(piece.spec, max(1, sum(len(t) // q for t in toks)))
                piece_streams.append(
                    (staging, store.retrieve_layers(staging, toks, salt=[salts[i] for i in idx]))
                )
            streams += [s for _, s in piece_streams]
            plans.append((src, idx, dst, piece_streams))
        short = [len(t) // P * P for t in seqs]  # per sequence: served so far (non-rising)
        tables: list[list[int]] = [[] for _ in seqs]
        for li in range(spec.num_layers):
            got = await asyncio.gather(*(s.__anext__() for s in streams))
            at = 0
            if own:
                layer = got[0]
                for j, i in enumerate(own):
                    short[i] = min(short[i], layer.num_tokens[j])
                    tables[i] = layer.block_tables[j]
                at = 1
            for src, idx, dst, piece_streams in plans:
                layers = got[at : at + len(piece_streams)]
                at += len(piece_streams)
                for j, i in enumerate(idx):
                    n = min([short[i], chosen[i][0], *(g.num_tokens[j] for g in layers)])
                    short[i] = n // P * P
                    tables[i] = dst[j][: n // P]
                for (staging, _), piece, g in zip(piece_streams, src.pieces, layers, strict=True):
                    q = piece.spec.page_size
                    u = min(P, q)
                    di = [unit_index(dst[j], P, u, short[i]) for j, i in enumerate(idx)]
                    si = [unit_index(g.block_tables[j], q, u, short[i]) for j, i in enumerate(idx)]
                    copy_units(
                        pool.layers[li],
                        np.concatenate(di),
                        staging.layers[li],
                        np.concatenate(si),
                        piece,
                        u,
                    )
            yield RetrievedLayer(
                li, [list(t[: short[i] // P]) for i, t in enumerate(tables)], list(short)
            )
        used = {p for t in tables for p in t}
        spare = [p for p in mine if p not in used]
        mine = []
        if spare:
            pool.free(spare)
    finally:
        for s in streams:
            await s.aclose()
        if mine:
            pool.free(mine)
