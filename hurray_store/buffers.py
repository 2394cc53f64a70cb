"""Reusable host buffers.

Memory touched for the first time costs a page fault per 4 KiB, several times the copy
of those bytes into memory already resident (docs/benchmarks.md: snapshot into fresh
memory against a resident staging buffer). The hot paths (gathering a segment for a
put, reading pages for a retrieve, assembling a Redis value) therefore borrow resident
buffers from a pool and give them back, instead of allocating per call.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import threading

_ROUND = 1 << 20


class BufferPool:
    """Best-fit pool of bytearrays. ``acquire(n)`` returns one of at least ``n`` bytes
    (a new one when none fits); ``release`` keeps it for reuse while the pool holds at
    most ``max_cached_bytes``. Thread-safe (tier I/O runs in worker threads)."""

    def __init__(self, max_cached_bytes: int = 1 << 30) -> None:
        self.max_cached_bytes = max_cached_bytes
        self._free: list[tuple[int, int, bytearray]] = []  # (size, id, buffer), sorted
        self._cached = 0
        self._lock = threading.Lock()

    def acquire(self, n: int) -> bytearray:
        with self._lock:
            i = bisect.bisect_left(self._free, (n, -1))
            if i < len(self._free) and self._free[i][0] <= max(2 * n, n + _ROUND):
                size, _, buf = self._free.pop(i)
                self._cached -= size
                return buf
        # An anonymous mapping, not bytearray(n): no memset of fresh memory (it faults
        # in on first write instead, once, and stays resident while pooled).
        return mmap.mmap(-1, -(-max(n, 1) // _ROUND) * _ROUND)  # type: ignore[return-value]

    def release(self, buf: bytearray) -> None:
        with self._lock:
            if self._cached + len(buf) > self.max_cached_bytes:
                return
            bisect.insort(self._free, (len(buf), id(buf), buf))
            self._cached += len(buf)


class Arena:
    """First-fit allocator over one anonymous mapping of ``size`` bytes.

    The mapping is reserved, not committed (``MAP_NORESERVE``): pages fault in on first
    use and stay resident afterwards, so freed space is refilled at memcpy speed.
    ``populate`` faults everything in at once (what an operator wants for a dedicated
    cache: the cost is paid at start, not on the first puts). Offsets are 64-aligned.
    Not thread-safe: the owning tier calls it from its event loop only.
    """

    ALIGN = 64

    def __init__(self, size: int, *, populate: bool = False) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
        if populate:
            flags |= getattr(mmap, "MAP_POPULATE", 0)
        self.size = size
        try:
            self._mm = mmap.mmap(-1, size, flags=flags)
        except (OSError, OverflowError) as e:  # beyond the address space or the limits
            raise OSError(
                f"cannot reserve {size} bytes of host memory for an arena (capacity_bytes "
                f"too large for this machine?): {e}"
            ) from None
        if hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):  # fewer faults where THP is allowed
                self._mm.madvise(mmap.MADV_HUGEPAGE)
        self.view = memoryview(self._mm)
        self._free: list[list[int]] = [[0, size]]  # [offset, length], sorted by offset
        self.used = 0

    def alloc(self, n: int) -> int | None:
        n = -(-max(n, 1) // self.ALIGN) * self.ALIGN
        for i, (off, ln) in enumerate(self._free):
            if ln >= n:
                if ln == n:
                    self._free.pop(i)
                else:
                    self._free[i] = [off + n, ln - n]
                self.used += n
                return off
        return None

    def release(self, off: int, n: int) -> None:
        n = -(-max(n, 1) // self.ALIGN) * self.ALIGN
        self.used -= n
        i = bisect.bisect_left(self._free, [off, 0])
        self._free.insert(i, [off, n])
        # Coalesce with the neighbours.
        if i + 1 < len(self._free) and self._free[i][0] + self._free[i][1] == self._free[i + 1][0]:
            self._free[i][1] += self._free.pop(i + 1)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == self._free[i][0]:
            self._free[i - 1][1] += self._free.pop(i)[1]
