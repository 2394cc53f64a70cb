"""What the store's prefix level returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PutResult:
    pages_referenced: int  # full pages over all sequences (a shared page once per sequence)
    pages_written: int  # distinct pages this put wrote
    pages_already_stored: int  # full pages the store held before this put
    segments: int
    bytes_per_tier: dict[str, int]
    # pages not written because an earlier page of theirs was neither stored nor in
    # the pool (``put``'s ``from_page``): they could not be reached by a lookup
    pages_unreachable: int = 0
    # pages this put meant to write that no tier took (every tier down, full, refusing)
    pages_not_stored: int = 0


@dataclass(frozen=True, slots=True)
class RetrieveResult:
    block_tables: list[list[int]]  # per sequence, the pool pages holding its delivered tokens
    num_tokens: list[int]  # per sequence, tokens delivered (whole pages)
    bytes_read: int = 0  # from the tiers
    bytes_delivered: int = 0  # into the pool


@dataclass(frozen=True, slots=True)
class RetrievedLayer:
    """One layer is in the pool. ``block_tables``/``num_tokens`` are as known now; a
    verification failure in a later layer can still shorten them, so the last item
    yielded is the final word."""

    layer_index: int
    block_tables: list[list[int]]
    num_tokens: list[int]
