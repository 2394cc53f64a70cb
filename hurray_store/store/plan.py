"""Pure planning for puts and retrieves: no tiers, no pools, no I/O.

Put side:
- ``split_segments``: which sequences form which segment (sequences sharing a page to
  write stay together; segments are packed up to a byte budget).
- ``segment_id``: a segment's id from its sequences' last page hashes.

Retrieve side:
- ``read_plan``: from index matches and manifests, per sequence the local pages to fill
  and per segment the pages to read (as runs) and where each goes.
- ``cut_at_bad``: each sequence cut at its first page that no tier had good.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from hurray_store.format import Manifest

Run = tuple[int, int]  # half-open [first page, end page) of consecutive segment pages


# ---------------------------------------------------------------------- put


def split_segments(
    hashes: Sequence[Sequence[bytes]], firsts: Sequence[int], page_cost: int, max_bytes: int
) -> list[list[int]]:
    """Sequences with pages to write (``hashes[s][firsts[s]:]``), grouped into segments:
    sequences that share a page to write stay together (union-find over shared hashes);
    such groups are packed, in order, while their distinct pages cost at most
    ``max_bytes`` (``page_cost`` bytes each; a group larger than that is one segment)."""
    todo = [s for s in range(len(hashes)) if firsts[s] < len(hashes[s])]
    parent = {s: s for s in todo}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    owner: dict[bytes, int] = {}
    for s in todo:
        for h in hashes[s][firsts[s] :]:
            if h in owner:
                parent[find(s)] = find(owner[h])
            else:
                owner[h] = s
    comps: dict[int, list[int]] = {}
    for s in todo:
        comps.setdefault(find(s), []).append(s)
    out: list[list[int]] = []
    cur: list[int] = []
    cur_pages: set[bytes] = set()
    for comp in comps.values():
        pages = {h for s in comp for h in hashes[s][firsts[s] :]}
        if cur and len(cur_pages | pages) * page_cost > max_bytes:
            out.append(cur)
            cur, cur_pages = [], set()
        cur += comp
        cur_pages |= pages
    if cur:
        out.append(cur)
    return out


def segment_id(last_hashes: Sequence[bytes], firsts: Sequence[int]) -> bytes:
    """One sequence stored from its first page: the hash of its last stored page.
    Otherwise xxh3-128 over each sequence's last hash and first stored page."""
    if len(last_hashes) == 1 and firsts[0] == 0:
        return last_hashes[0]
    h = xxhash.xxh3_128()
    for lh, f in zip(last_hashes, firsts, strict=True):
        h.update(lh)
        h.update(f.to_bytes(8, "little"))
    return h.digest()


# ---------------------------------------------------------------------- retrieve


@dataclass(frozen=True, slots=True)
class Match:
    """Where the index found a sequence's leading pages: per position, its segment, the
    sequence inside that segment's manifest, and the page position in the sequence."""

    segment_ids: Sequence[bytes]
    seqs: Sequence[int]
    pages: Sequence[int]


@dataclass(slots=True)
class SegmentRead:
    """The pages one retrieve reads from one segment."""

    segment_id: bytes
    manifest: Manifest
    pages: list[int] = field(default_factory=list)  # segment page ids, sorted
    dest: list[int] = field(default_factory=list)  # local page of each of ``pages``
    runs: list[Run] = field(default_factory=list)

    @property
    def every_page(self) -> bool:
        return len(self.pages) == self.manifest.num_pages


@dataclass(frozen=True, slots=True)
class ReadPlan:
    tables: list[list[int]]  # per sequence, local page ids 0..num_pages-1
    num_pages: int  # distinct local pages: what the pool allocates
    segments: list[SegmentRead]  # those with pages to read, in order of first use
    rejected: dict[bytes, str]  # segments whose manifest disagrees with the request
    skipped: int = -1  # the local page the skipped positions name (-1: none)


# The local page every skipped position of a table names (``read_plan``'s ``skip``):
# allocated, never read.
SKIPPED = (b"", -1)


def read_plan(
    matches: Sequence[Match],
    manifests: Mapping[bytes, Manifest | None],
    tokens: Sequence[np.ndarray],
    page_size: int,
    skip: Sequence[int] | None = None,
) -> ReadPlan:
    """The pages to fill and to read. A sequence's match stops at a segment without a
    manifest, or at a page whose token ids differ from the request's (that segment is
    rejected, and every sequence's match stops at it). A stored page several sequences
    reach (a shared prefix) gets one local page. ``skip[s]``: sequence ``s``'s leading
    pages the caller does not want (the engine holds them): matched and checked as the
    others, never read; their table entries name one local page that is never filled."""
    P = page_size
    usable = {s: m for s, m in manifests.items() if m is not None}
    rejected: dict[bytes, str] = {}
    refs: list[list[tuple[bytes, int]]] = []
    for s, mt in enumerate(matches):
        row: list[tuple[bytes, int]] = []
        for seg, q, pos in zip(mt.segment_ids, mt.seqs, mt.pages, strict=True):
            m = usable.get(seg)
            if m is None:
                break
            ms = m.sequences[q]
            j = pos - ms.first_page
            if not 0 <= j < len(ms.block_table) or ms.token_ids[pos * P : (pos + 1) * P] != tuple(
                tokens[s][pos * P : (pos + 1) * P].tolist()
            ):
                rejected[seg] = "token ids differ from the request's"
                del usable[seg]
                break
            row.append((seg, ms.block_table[j]))
        refs.append(row)
    # A segment rejected after an earlier row used it: cut that row there too.
    refs = [
        row[: next((i for i, (seg, _) in enumerate(row) if seg not in usable), len(row))]
        for row in refs
    ]
    if skip is not None:  # the leading pages not wanted: matched and checked, not read
        refs = [
            [SKIPPED if i < n else r for i, r in enumerate(row)]
            for row, n in zip(refs, skip, strict=True)
        ]
    distinct: dict[tuple[bytes, int], int] = {}
    tables = [[distinct.setdefault(r, len(distinct)) for r in row] for row in refs]
    by_seg: dict[bytes, dict[int, int]] = {}
    for (seg, page), d in distinct.items():
        if (seg, page) != SKIPPED:
            by_seg.setdefault(seg, {})[page] = d
    reads = []
    for seg, dest in by_seg.items():
        pages = sorted(dest)
        reads.append(SegmentRead(seg, usable[seg], pages, [dest[p] for p in pages], runs(pages)))
    return ReadPlan(tables, len(distinct), reads, rejected, distinct.get(SKIPPED, -1))


def runs(pages: Sequence[int]) -> list[Run]:
    """Sorted page ids as half-open runs of consecutive ids."""
    out: list[Run] = []
    for p in pages:
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


def cut_at_bad(tables: Sequence[Sequence[int]], bad: set[int]) -> tuple[list[list[int]], list[int]]:
    """Each table cut before its first local page in ``bad``; and, once per table that
    lets go of it, each local page a table no longer holds (a page is counted once per
    holding table, as ``paging.allocate_shared`` counts references)."""
    cut: list[list[int]] = []
    lost: list[int] = []
    for t in tables:
        c = list(t[: next((i for i, d in enumerate(t) if d in bad), len(t))])
        lost += sorted(set(t[len(c) :]) - set(c))
        cut.append(c)
    return cut, lost
