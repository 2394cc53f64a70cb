"""Cutting a list of items into consecutive runs bounded in bytes (and count)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def batches(
    items: list[T], size: Callable[[T], int], max_bytes: int, max_count: int = 0
) -> list[list[T]]:
    """Consecutive runs of ``items`` of at most ``max_bytes`` (an item larger than that
    goes alone) and, when ``max_count`` is set, at most that many items."""
    out: list[list[T]] = []
    cur: list[T] = []
    nbytes = 0
    for it in items:
        n = size(it)
        if cur and ((max_count and len(cur) >= max_count) or nbytes + n > max_bytes):
            out.append(cur)
            cur, nbytes = [], 0
        cur.append(it)
        nbytes += n
    if cur:
        out.append(cur)
    return out
