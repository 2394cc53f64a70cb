"""Helpers the tiers share: buffer views and sizes, timeouts by size, and a run split
over helper threads. No tier state."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from hurray_store.tiers.types import Blob, Buffer, Range

# The slowest transfer rate an operation's timeout allows for: a timeout grows by one
# second per 50 MB moved.
TRANSFER_BYTES_PER_S = 50e6


def transfer_timeout_s(base_s: float, nbytes: int) -> float:
    return base_s + nbytes / TRANSFER_BYTES_PER_S


def blob_nbytes(b: Blob) -> int:
    if isinstance(b, torch.Tensor):
        return b.numel() * b.element_size()
    return memoryview(b).nbytes


def shared_run(run: Callable[[], None], pool: ThreadPoolExecutor | None, helpers: int) -> None:
    """``run`` on the calling thread and on up to ``helpers`` threads of ``pool`` at once
    (each call takes work items until none is left, so a busy pool never holds the
    caller up); returns once every call that started has ended."""
    started: list[Future[None]] = []
    if pool is not None:
        with contextlib.suppress(RuntimeError):  # shut down: the tier is closing
            for _ in range(helpers):
                started.append(pool.submit(run))
    try:
        run()
    finally:
        for h in started:  # not started yet: nothing left for it; else wait for it
            if not h.cancel():
                h.result()


def check_into(key: str, ranges: Sequence[Range], buffers: Sequence[memoryview]) -> None:
    """ValueError unless ``buffers`` are one per range, each of its range's length."""
    if len(buffers) != len(ranges) or any(
        len(b) != ln for b, (_, ln) in zip(buffers, ranges, strict=True)
    ):
        raise ValueError(f"{key}: buffers of other sizes than its ranges")


def one_buffer(buffers: Sequence[Buffer]) -> Buffer:
    """One buffer of the concatenation of ``buffers``: the only one without a copy
    (redis-py and obstore send a memoryview as it is), else joined."""
    return buffers[0] if len(buffers) == 1 else b"".join(buffers)


def host_view(b: Blob) -> memoryview:
    """A byte view of a blob: zero-copy for host memory (a CPU tensor included); a
    device tensor is copied to the host first."""
    if isinstance(b, torch.Tensor):
        arr: Any = b.cpu().contiguous().view(torch.uint8).numpy()
        return memoryview(arr).cast("B")
    if isinstance(b, memoryview) and b.format == "B" and b.ndim == 1:
        return b  # the caller's own view: a reader that fills it is seen to have
    mv = memoryview(b)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
