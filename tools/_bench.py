"""Shared helpers for the benchmark scripts in tools/ (timing, table printing, loopback
ports of the servers they start)."""

from __future__ import annotations

import socket
import statistics
import subprocess
import time
from collections.abc import Callable


def timeit(fn: Callable[[], object], *, repeat: int = 7, warmup: int = 1) -> float:
    """Median wall time of ``fn`` in seconds over ``repeat`` runs after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def table(headers: list[str], rows: list[list[object]]) -> str:
    """A GitHub-flavoured markdown table (pasted as is into docs/benchmarks.md)."""
    cells = [[str(c) for c in r] for r in [headers, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def free_port(below: int = 65536) -> int:
    """A free loopback TCP port under ``below`` (a Redis Cluster node needs its port +
    10000 free too)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = int(s.getsockname()[1])
        if p < below:
            return p


def wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 60) -> None:
    """Wait until ``proc`` listens on ``port``; RuntimeError when it exits or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port}")
