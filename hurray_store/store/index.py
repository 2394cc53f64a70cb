"""PrefixIndex: page hash -> where the page is stored.

An open-addressing hash table in numpy arrays, because a Python dict of 16-byte keys
costs ~200 bytes per entry and this index holds millions of pages. Per slot: the
16-byte hash (two uint64), a segment number, a sequence and a page position (int32
each) and a state byte; the table is kept at most half full, so about 70 bytes per
indexed page (docs/benchmarks.md gives the figure). Lookups of a whole prompt's hash
chain run vectorized, a probe round at a time.

Ownership: not thread-safe. The store owns one index on its event loop; every call
runs to completion without awaiting, so readers on that loop never see a half insert.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hurray_store.keys import HASH_LEN

_EMPTY, _USED, _TOMB = 0, 1, 2
_MAX_LOAD = 0.5


@dataclass(frozen=True, slots=True)
class PageLocation:
    segment_id: bytes
    seq: int  # sequence inside the segment's manifest
    page: int  # page position inside that sequence


@dataclass(frozen=True, slots=True, eq=False)
class PrefixMatch:
    """The leading ``num_pages`` pages present, and where each lies (as arrays, so a
    32k-token lookup builds no per-page Python objects unless asked)."""

    num_pages: int
    segment_ids: list[bytes]  # per matched page
    seqs: np.ndarray  # int32, per matched page: sequence inside the segment
    pages: np.ndarray  # int32, per matched page: page position in that sequence

    @property
    def locations(self) -> list[PageLocation]:
        return [
            PageLocation(a, b, c)
            for a, b, c in zip(
                self.segment_ids, self.seqs.tolist(), self.pages.tolist(), strict=True
            )
        ]


def _keys(hashes: Sequence[bytes]) -> np.ndarray:
    if any(len(h) != HASH_LEN for h in hashes):
        raise ValueError(f"page hashes must be {HASH_LEN} bytes")
    if not hashes:
        return np.zeros((0, 2), dtype=np.uint64)
    return np.frombuffer(b"".join(hashes), dtype="<u8").reshape(-1, 2)


class PrefixIndex:
    def __init__(self, capacity: int = 1024) -> None:
        cap = 1 << max(4, int(capacity * 2 - 1).bit_length())
        self._alloc(cap)
        self._seg_ids: list[bytes | None] = []  # segment number -> id
        self._seg_num: dict[bytes, int] = {}  # id -> segment number
        self._seg_slots: dict[int, list[np.ndarray]] = {}
        self._free_nums: list[int] = []
        self._count = 0
        self._tombs = 0

    def _alloc(self, cap: int) -> None:
        self._cap = cap
        self._mask = cap - 1
        self._hk = np.zeros((cap, 2), dtype=np.uint64)
        self._state = np.zeros(cap, dtype=np.uint8)
        self._seg = np.zeros(cap, dtype=np.int32)
        self._sq = np.zeros(cap, dtype=np.int32)
        self._pg = np.zeros(cap, dtype=np.int32)

    def __len__(self) -> int:
        return self._count

    def __contains__(self, h: bytes) -> bool:
        return self._find(_keys([h]))[0] >= 0

    def contains_many(self, hashes: Sequence[bytes]) -> np.ndarray:
        """Membership of each hash, in one vectorized probe (bool array)."""
        return self._find(_keys(hashes)) >= 0

    @property
    def nbytes(self) -> int:
        """Memory held by the table arrays."""
        return sum(a.nbytes for a in (self._hk, self._state, self._seg, self._sq, self._pg)) + sum(
            a.nbytes for v in self._seg_slots.values() for a in v
        )

    # ------------------------------------------------------------------ probing

    def _find(self, q: np.ndarray) -> np.ndarray:
        """Placeholder of each query key, or -1."""
        n = q.shape[0]
        out = np.full(n, -1, dtype=np.int64)
        pos = (q[:, 0] & np.uint64(self._mask)).astype(np.int64)
        live = np.arange(n)
        for _ in range(self._cap):
            if not live.size:
                break
            p = pos[live]
            st = self._state[p]
            hit = (st == _USED) & (self._hk[p, 0] == q[live, 0]) & (self._hk[p, 1] == q[live, 1])
            out[live[hit]] = p[hit]
            cont = ~hit & (st != _EMPTY)
            live = live[cont]
            pos[live] = (p[cont] + 1) & self._mask
        return out

    def insert(self, segment_id: bytes, seq: int, first_page: int, hashes: Sequence[bytes]) -> int:
        """Index ``hashes`` as pages ``first_page, first_page+1, ...`` of sequence ``seq``
        of segment ``segment_id``. A hash already indexed keeps its location (the first
        writer wins). Returns the number of new entries."""
        return self.insert_many([(segment_id, seq, first_page, hashes)])

    def insert_many(self, entries: Sequence[tuple[bytes, int, int, Sequence[bytes]]]) -> int:
        """``insert`` for many ``(segment_id, seq, first_page, hashes)`` at once, in one
        vectorized pass (a restart indexes every manifest in one call). Earlier entries
        win over later ones, as successive inserts would."""
        entries = [e for e in entries if len(e[3])]
        if not entries:
            return 0
        q = _keys([h for e in entries for h in e[3]])
        lens = np.array([len(e[3]) for e in entries], dtype=np.int64)
        if (self._count + self._tombs + q.shape[0]) > self._cap * _MAX_LOAD:
            self._rehash(max(self._cap, int((self._count + q.shape[0]) / _MAX_LOAD) + 1))
        nums = np.repeat(
            np.array([self._segment_number(e[0]) for e in entries], dtype=np.int64), lens
        )
        seqs = np.repeat(np.array([e[1] for e in entries], dtype=np.int64), lens)
        starts = np.repeat(np.cumsum(lens) - lens, lens)
        pages = (
            np.repeat(np.array([e[2] for e in entries], dtype=np.int64), lens)
            + np.arange(q.shape[0])
            - starts
        )
        present = self._find(q) >= 0
        # Duplicates inside the batch: keep the first.
        _, first_idx = np.unique(q, axis=0, return_index=True)
        todo = np.zeros(q.shape[0], dtype=bool)
        todo[first_idx] = True
        todo &= ~present
        idx = np.flatnonzero(todo)
        slots = self._place(q[idx])
        self._hk[slots] = q[idx]
        self._seg[slots] = nums[idx]
        self._sq[slots] = seqs[idx]
        self._pg[slots] = pages[idx]
        if slots.size:
            sn = nums[idx]
            order = np.argsort(sn, kind="stable")
            sn, sl = sn[order], slots[order]
            bounds = np.flatnonzero(np.diff(sn)) + 1
            for part_slots, part_seg in zip(
                np.split(sl, bounds), np.split(sn, bounds), strict=True
            ):
                self._seg_slots.setdefault(int(part_seg[0]), []).append(part_slots)
        self._count += int(idx.size)
        return int(idx.size)

    def _place(self, keys: np.ndarray) -> np.ndarray:
        """Claim an empty slot for each key (linear probing); returns the slots."""
        final = np.empty(keys.shape[0], dtype=np.int64)
        idx = np.arange(keys.shape[0])
        pos = (keys[:, 0] & np.uint64(self._mask)).astype(np.int64)
        while idx.size:
            cand = np.flatnonzero(self._state[pos] == _EMPTY)
            # Of several keys aiming at one empty slot, the first takes it.
            _, win = np.unique(pos[cand], return_index=True)
            won = cand[win]
            self._state[pos[won]] = _USED
            final[idx[won]] = pos[won]
            keep = np.ones(idx.size, dtype=bool)
            keep[won] = False
            idx, pos = idx[keep], (pos[keep] + 1) & self._mask
        return final

    def _segment_number(self, segment_id: bytes) -> int:
        num = self._seg_num.get(segment_id)
        if num is None:
            if self._free_nums:
                num = self._free_nums.pop()
                self._seg_ids[num] = segment_id
            else:
                num = len(self._seg_ids)
                self._seg_ids.append(segment_id)
            self._seg_num[segment_id] = num
        return num

    def remove_segment(self, segment_id: bytes) -> int:
        """Forget every page located in ``segment_id``; returns how many."""
        num = self._seg_num.pop(segment_id, None)
        if num is None:
            return 0
        slots = self._seg_slots.pop(num, [])
        n = 0
        for s in slots:
            live = s[(self._state[s] == _USED) & (self._seg[s] == num)]
            self._state[live] = _TOMB
            n += int(live.size)
        self._seg_ids[num] = None
        self._free_nums.append(num)
        self._count -= n
        self._tombs += n
        return n

    def _rehash(self, want: int) -> None:
        used = np.flatnonzero(self._state == _USED)
        keys = self._hk[used].copy()
        seg, sq, pg = self._seg[used].copy(), self._sq[used].copy(), self._pg[used].copy()
        cap = 1 << max(4, int(want * 2 - 1).bit_length()) if want > self._cap else self._cap
        self._alloc(cap)
        self._tombs = 0
        self._count = 0
        self._seg_slots = {}
        order = np.argsort(seg, kind="stable")
        keys, seg, sq, pg = keys[order], seg[order], sq[order], pg[order]
        final = self._place(keys)
        self._hk[final], self._seg[final], self._sq[final], self._pg[final] = keys, seg, sq, pg
        self._count = int(final.size)
        if final.size:
            bounds = np.flatnonzero(np.diff(seg)) + 1
            for part_slots, part_seg in zip(
                np.split(final, bounds), np.split(seg, bounds), strict=True
            ):
                self._seg_slots[int(part_seg[0])] = [part_slots]

    # ------------------------------------------------------------------ lookup

    def longest_prefix(self, hashes: Sequence[bytes]) -> PrefixMatch:
        """How many leading ``hashes`` are indexed, and where each of those pages is."""
        slots = self._find(_keys(hashes))
        miss = np.flatnonzero(slots < 0)
        n = int(miss[0]) if miss.size else len(hashes)
        s = slots[:n]
        ids = self._seg_ids
        segment_ids = [ids[a] or b"" for a in self._seg[s].tolist()]
        return PrefixMatch(n, segment_ids, self._sq[s], self._pg[s])

    def segments(self) -> list[bytes]:
        return list(self._seg_num)
