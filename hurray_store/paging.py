"""Snapshot and re-page: batches out of a paged KV pool and back.

The engine side is laid out as vLLM lays it out: per layer one tensor
``[2, num_pages, page_size, num_kv_heads, head_dim]`` (index 0 keys, 1 values; an MLA
model's fused latent: ``[1, num_pages, page_size, 1, dim]``), and a block table per
sequence. ``snapshot`` gathers the pages a batch references, each
distinct page once; ``restore`` allocates one new page per distinct stored page the
chosen sequences need and copies into it, so sharing survives the round trip. Pages
move through ``page_io``, the path the store's objects take too.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hurray_store.errors import PagingError, PoolExhaustedError
from hurray_store.format import LayerKV
from hurray_store.page_io import gather_pages, scatter_pages
from hurray_store.spec import KVSpec


class PagedKVPool:
    """A paged KV pool with a reference-counted page allocator (an engine's block is a
    page: vLLM's block table is a list of page ids).

    ``layers[i]`` is ``[2, num_pages, page_size, num_kv_heads, head_dim]``. Pages come
    off a FIFO free list; ``free`` decrements and a page returns to the list at zero.
    """

    def __init__(self, spec: KVSpec, num_pages: int, device: str | torch.device = "cpu") -> None:
        if num_pages < 1:
            raise PagingError(f"num_pages must be >= 1, got {num_pages}")
        shape = (spec.roles, num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim)
        layers = [
            torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)
        ]
        self._init(spec, layers)

    @classmethod
    def from_tensors(cls, spec: KVSpec, layers: Sequence[torch.Tensor]) -> PagedKVPool:
        """Wrap an engine's own KV tensors (no copy). All pages start free."""
        if len(layers) != spec.num_layers:
            raise PagingError(f"expected {spec.num_layers} layer tensors, got {len(layers)}")
        num_pages = layers[0].shape[1] if layers[0].dim() == 5 else -1
        want = (spec.roles, num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim)
        for i, t in enumerate(layers):
            if tuple(t.shape) != want:
                raise PagingError(
                    f"layer {i}: expected [{spec.roles}, num_pages, {spec.page_size}, "
                    f"{spec.num_kv_heads}, {spec.head_dim}], "
                    f"got {tuple(t.shape)}"
                )
            if t.dtype != spec.dtype:
                raise PagingError(f"layer {i}: expected dtype {spec.dtype}, got {t.dtype}")
        pool = cls.__new__(cls)
        pool._init(spec, list(layers))
        return pool

    def _init(self, spec: KVSpec, layers: list[torch.Tensor]) -> None:
        self.spec = spec
        self.layers = layers
        self.num_pages = int(layers[0].shape[1])
        self.device = layers[0].device
        self._ref = np.zeros(self.num_pages, dtype=np.int64)
        self._free: deque[int] = deque(range(self.num_pages))

    @property
    def num_blocks(self) -> int:
        """``num_pages``, in an engine's word."""
        return self.num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, page: int) -> int:
        return int(self._ref[page])

    def allocate(self, n: int) -> list[int]:
        """``n`` free pages, each with reference count 1; all or nothing."""
        if n < 0:
            raise PagingError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise PoolExhaustedError(
                f"asked for {n} pages, {len(self._free)} of {self.num_pages} are free"
            )
        ids = [self._free.popleft() for _ in range(n)]
        self._ref[ids] = 1
        return ids

    def _check_allocated(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= self.num_pages):
            raise PagingError(f"page ids must be in [0, {self.num_pages}), got {arr.tolist()}")
        # Count repeats, so freeing one page twice in one call is checked against its count.
        uniq, counts = np.unique(arr, return_counts=True)
        short = uniq[self._ref[uniq] < counts]
        if short.size:
            raise PagingError(f"pages {short.tolist()} are not allocated (reference count too low)")
        return arr

    def incref(self, ids: Sequence[int]) -> None:
        arr = np.asarray(ids, dtype=np.int64)
        self._check_allocated(np.unique(arr))
        np.add.at(self._ref, arr, 1)

    def free(self, ids: Sequence[int]) -> None:
        """Decrement each page's count; pages reaching zero go back to the free list."""
        arr = self._check_allocated(ids)
        np.add.at(self._ref, arr, -1)
        for p in dict.fromkeys(arr.tolist()):
            if self._ref[p] == 0:
                self._free.append(p)


@dataclass(frozen=True, slots=True, eq=False)
class Snapshot:
    """A batch gathered out of a pool: per layer a LayerKV with each distinct page once.

    ``source_pages[j]`` is the pool page that compacted page ``j`` came from;
    ``block_tables[s]`` is sequence ``s``'s table in compacted ids.
    """

    spec: KVSpec
    layers: list[LayerKV]
    seq_lens: list[int]
    block_tables: list[list[int]]
    source_pages: list[int]

    @property
    def num_pages(self) -> int:
        return len(self.source_pages)


def _pages_needed(seq_len: int, page_size: int) -> int:
    return -(-seq_len // page_size)


def compact(tables: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[list[int]], torch.Tensor]:
    """Renumber pages in order of first appearance.

    Returns ``(distinct, compacted_tables, inverse)``: ``distinct[j]`` is the original id of
    compacted page ``j``; ``inverse`` maps each flat entry to its compacted id.
    """
    lens = [len(t) for t in tables]
    flat = torch.tensor([p for t in tables for p in t], dtype=torch.long)
    if flat.numel() == 0:
        return flat, [[] for _ in tables], flat
    uniq, inv = torch.unique(flat, return_inverse=True)
    pos = torch.arange(flat.numel())
    first = torch.full((uniq.numel(),), flat.numel(), dtype=torch.long).scatter_reduce_(
        0, inv, pos, "amin"
    )
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    inverse = rank[inv]
    out, i = [], 0
    flat_c = inverse.tolist()
    for n in lens:
        out.append(flat_c[i : i + n])
        i += n
    return uniq[order], out, inverse


def check_tables(
    pool: PagedKVPool,
    block_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    *,
    full_pages: bool,
) -> list[list[int]]:
    """Each sequence's pages, after checking them: ``seq_lens[s]`` tokens need
    ``ceil(n / page_size)`` pages (only ``n // page_size`` with ``full_pages``), the
    block table has at least that many, each a page id of ``pool``. PagingError names
    the first thing wrong. The one check of a batch against a pool (snapshot, put)."""
    P = pool.spec.page_size
    if len(block_tables) != len(seq_lens):
        raise PagingError(f"{len(block_tables)} block tables but {len(seq_lens)} seq_lens")
    tables = []
    for s, (t, n) in enumerate(zip(block_tables, seq_lens, strict=True)):
        if n < 0:
            raise PagingError(f"sequence {s}: seq_len must be >= 0, got {n}")
        need = n // P if full_pages else _pages_needed(n, P)
        if len(t) < need:
            raise PagingError(
                f"sequence {s}: {n} tokens need {need} pages of {P}, its block table has {len(t)}"
            )
        tables.append([int(p) for p in t[:need]])
    bad = next((p for t in tables for p in t if not 0 <= p < pool.num_pages), None)
    if bad is not None:
        raise PagingError(f"unknown page id {bad}: the pool has pages [0, {pool.num_pages})")
    return tables


def snapshot(
    pool: PagedKVPool,
    block_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    *,
    layers: Sequence[int] | None = None,
    zero_unused_slots: bool = False,
    out: torch.Tensor | None = None,
) -> Snapshot:
    """Gather a batch: each distinct page the batch references, once, per layer.

    Sequence ``s`` contributes its first ``ceil(seq_lens[s] / page_size)`` pages (a block
    table may be longer; extra pages hold no valid token). With ``zero_unused_slots``,
    slots past the last valid token of a trailing page are zero in the snapshot unless a
    sequence sharing the page uses them; the pool is untouched.

    ``out``: an optional staging tensor ``[len(layers), 2, capacity, page_size, heads,
    head_dim]`` (resident, reused across calls) that the pages are gathered into; the
    snapshot's tensors are then views of it, valid until the next reuse. Without it each
    call gathers into freshly allocated memory, whose page faults cost about 3x the copy.
    """
    spec = pool.spec
    P = spec.page_size
    if spec.fused:
        raise PagingError("snapshot takes key/value pools; a fused (MLA) pool goes by the store")
    tables = check_tables(pool, block_tables, seq_lens, full_pages=False)
    layer_ids = list(range(spec.num_layers)) if layers is None else list(layers)
    for li in layer_ids:
        if not 0 <= li < spec.num_layers:
            raise PagingError(f"layer {li} outside [0, {spec.num_layers})")
    distinct, compacted, inverse = compact(tables)
    seq_ptr = torch.tensor(np.cumsum([0] + [len(t) for t in tables]), dtype=torch.long)
    block_table = inverse.clone()
    idx = distinct.to(pool.device)

    partial: list[tuple[int, int]] = []
    if zero_unused_slots and distinct.numel():
        # Valid slots each reference needs; a page keeps the most any sharer uses.
        valid = torch.full((inverse.numel(),), P, dtype=torch.long)
        ends = seq_ptr[1:] - 1
        for s, n in enumerate(seq_lens):
            if n % P and len(tables[s]):
                valid[ends[s]] = n % P
        used = torch.zeros(distinct.numel(), dtype=torch.long).scatter_reduce_(
            0, inverse, valid, "amax"
        )
        partial = [(int(j), int(used[j])) for j in torch.nonzero(used < P).flatten()]

    n = int(distinct.numel())
    if out is not None:
        want = (len(layer_ids), 2, n, P, spec.num_kv_heads, spec.head_dim)
        if (
            out.dim() != 6
            or out.shape[:2] != want[:2]
            or out.shape[2] < n
            or out.shape[3:] != want[3:]
            or out.dtype != spec.dtype
        ):
            raise PagingError(
                f"out must be [{want[0]}, 2, >= {n}, {P}, {want[4]}, {want[5]}] "
                f"{spec.dtype}, got {tuple(out.shape)} {out.dtype}"
            )
    out_layers = []
    for i, li in enumerate(layer_ids):
        kv = pool.layers[li]
        if out is None:
            keys = kv.new_empty((n, *kv.shape[2:]))
            values = kv.new_empty((n, *kv.shape[2:]))
        else:
            keys, values = out[i, 0, :n], out[i, 1, :n]
        gather_pages(kv[0], idx, keys)
        gather_pages(kv[1], idx, values)
        for j, u in partial:
            keys[j, u:] = 0
            values[j, u:] = 0
        out_layers.append(LayerKV(li, keys.cpu(), values.cpu(), block_table, seq_ptr))
    return Snapshot(spec, out_layers, list(seq_lens), compacted, distinct.tolist())


def _check_pool_matches(snap: Snapshot, pool: PagedKVPool) -> None:
    a, b = snap.spec, pool.spec
    for f in ("page_size", "num_kv_heads", "head_dim", "dtype"):
        if getattr(a, f) != getattr(b, f):
            raise PagingError(
                f"snapshot and pool disagree on {f}: snapshot {getattr(a, f)}, pool {getattr(b, f)}"
            )
    for lay in snap.layers:
        if lay.layer_index >= b.num_layers:
            raise PagingError(
                f"snapshot layer {lay.layer_index} does not exist in a pool of "
                f"{b.num_layers} layers"
            )


def restore(
    snap: Snapshot,
    pool: PagedKVPool,
    *,
    seqs: Sequence[int] | None = None,
    num_pages: Sequence[int] | None = None,
) -> list[list[int]]:
    """Re-page sequences of ``snap`` into ``pool``; returns their new block tables.

    Allocates one page per distinct stored page the selected sequences need (their first
    ``num_pages[i]`` pages, default all); a page shared by k selected sequences gets
    reference count k. Too few free pages: PoolExhaustedError and nothing allocated.
    """
    _check_pool_matches(snap, pool)
    sel = list(range(len(snap.block_tables))) if seqs is None else list(seqs)
    for s in sel:
        if not 0 <= s < len(snap.block_tables):
            raise PagingError(f"sequence {s} outside [0, {len(snap.block_tables)})")
    if num_pages is None:
        counts = [len(snap.block_tables[s]) for s in sel]
    else:
        if len(num_pages) != len(sel):
            raise PagingError(f"{len(sel)} sequences but {len(num_pages)} num_pages")
        counts = list(num_pages)
        for s, c in zip(sel, counts, strict=True):
            if not 0 <= c <= len(snap.block_tables[s]):
                raise PagingError(
                    f"sequence {s}: num_pages must be in [0, {len(snap.block_tables[s])}], got {c}"
                )
    wanted = [snap.block_tables[s][:c] for s, c in zip(sel, counts, strict=True)]
    needed, local_tables, _ = compact(wanted)
    n = int(needed.numel())
    new_ids = allocate_shared(pool, local_tables, n)  # raises before anything is allocated
    try:
        if n:
            dst = torch.tensor(new_ids, dtype=torch.long, device=pool.device)
            whole = n == snap.num_pages and bool(torch.equal(needed, torch.arange(n)))
            for lay in snap.layers:
                kv = pool.layers[lay.layer_index]
                for role, src in ((0, lay.keys), (1, lay.values)):
                    scatter_pages(kv[role], dst, src if whole else src.index_select(0, needed))
    except BaseException:
        release_shared(pool, new_ids, local_tables)
        raise
    return [[new_ids[j] for j in t] for t in local_tables]


def allocate_shared(pool: PagedKVPool, local_tables: Sequence[Sequence[int]], n: int) -> list[int]:
    """Allocate ``n`` pages for tables over local ids ``0..n-1``; a page held by k
    distinct tables gets reference count k (as vLLM counts holders). All or nothing."""
    new_ids = pool.allocate(n)
    holders = np.zeros(n, dtype=np.int64)
    for t in local_tables:
        if len(t):
            holders[np.unique(np.asarray(t, dtype=np.int64))] += 1
    extra = np.repeat(np.asarray(new_ids, dtype=np.int64), np.maximum(holders - 1, 0))
    if extra.size:
        pool.incref(extra.tolist())
    return new_ids


def release_shared(
    pool: PagedKVPool, new_ids: Sequence[int], local_tables: Sequence[Sequence[int]]
) -> None:
    """Undo ``allocate_shared``: drop every holder's reference."""
    refs = [new_ids[j] for t in local_tables for j in set(t)]
    unheld = set(range(len(new_ids))) - {j for t in local_tables for j in t}
    pool.free(refs + [new_ids[j] for j in unheld])
