"""The value types of the tier contract (``tiers/base.py``): what tiers take and give."""

from __future__ import annotations

from collections.abc import Callable

import torch

Buffer = bytes | bytearray | memoryview
Blob = bytes | bytearray | memoryview | torch.Tensor
Range = tuple[int, int]  # (offset, length)
# Where ``get_ranges`` may read to: one buffer of at least the ranges' total size, or one
# writable view per range.
ReadInto = bytearray | memoryview | list[memoryview] | None


# ``each(j, i, sum)`` of a ``read_into_now``: range ``i`` of read ``j`` is in, and ``sum``
# is the ``checksum`` of its bytes, taken as they came in.
RangeIn = Callable[[int, int, int], None]
