#!/usr/bin/env python
"""Benchmark of portable pages (issue T): loading a stored prefix at the writer's
tensor-parallel size and page size against loading it at another, in the same run,
through the engine port's prefix calls (what the vLLM connector's worker runs).

A model of 8 KV heads x 128, fp16, 4 layers; 8 sequences x 2048 tokens (256 MiB of
KV). Each row loads every sequence whole into a fresh pool of the reader's layout and
gives GB/s of the reader's KV delivered, with its ratio to the same-layout load of the
same reader (aim: 0.8x):

- TP=1 page 16 reading pages stored by TP=2 (two head ranges, each read and copied
  into its half of the heads);
- a TP=2 rank (4 heads) reading pages stored by TP=1 (a slice of each page);
- TP=1 page 16 reading pages stored at page 32, and page 32 reading page 16 (re-paged).

Then what a lookup costs: a hit in the reader's own layout against a miss that asks
every other layout (two head widths x four page sizes).

    .venv/bin/python tools/bench_portable.py [--tier cpu|disk] [--repeat 3]

The disk tier reads from the page cache (no root to drop it).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _bench import gbps, table, timeit  # noqa: E402

from hurray_store import KVSpec, PagedKVPool  # noqa: E402
from hurray_store.engine import EnginePort  # noqa: E402
from hurray_store.spec import rank_heads  # noqa: E402

H, D, L = 8, 128, 4


def spec(tp: int, rank: int, page: int) -> KVSpec:
    start, n = rank_heads(H, rank, tp)
    return KVSpec("bench-portable", L, n, D, page, torch.float16, "", start, H)


def prompts(tag: int, seqs: int, tokens: int) -> list[list[int]]:
    return [[tag * 1_000_000 + s * 10_000 + i for i in range(tokens)] for s in range(seqs)]


def store(port: EnginePort, sp: KVSpec, toks: list[list[int]]) -> None:
    """The model's KV of ``toks`` (random, the writer's heads) put in ``sp``'s layout."""
    P = sp.page_size
    n = sum(len(t) // P for t in toks)
    pool = PagedKVPool(sp, n)
    for t in pool.layers:
        t.normal_()
    tables = [pool.allocate(len(t) // P) for t in toks]
    port.call(port.put_pages(pool, toks, tables, [None] * len(toks)))


def load(port: EnginePort, sp: KVSpec, toks: list[list[int]]) -> int:
    """Every sequence loaded into a fresh pool of ``sp``: the tokens delivered."""
    pool = PagedKVPool(sp, sum(len(t) // sp.page_size for t in toks))

    async def run() -> Any:
        last = None
        async for layer in port.load_pages(pool, toks, [None] * len(toks)):
            last = layer
        return last

    last = port.call(run())
    return sum(last.num_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tier", choices=["cpu", "disk"], default="cpu")
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tier: dict[str, Any] = {"type": a.tier, "capacity_bytes": 8 << 30}
        if a.tier == "disk":
            tier["path"] = d
        port = EnginePort({"namespace": "b", "tiers": [tier], "engine": {"page_sizes": [16, 32]}})
        try:
            rows = run(port, a)
        finally:
            port.close()
    print(f"tier {a.tier}, {a.seqs} x {a.tokens} tokens, {L} layers x {H} heads x {D}, fp16\n")
    print(table(["load", "layout stored", "GB/s", "same-layout GB/s", "ratio"], rows[0]))
    print()
    print(table(["lookup", "us per call", "ratio to a same-layout hit"], rows[1]))


def run(port: EnginePort, a: argparse.Namespace) -> tuple[list[list[Any]], list[list[Any]]]:
    n = a.seqs * a.tokens
    sets = {k: prompts(i + 1, a.seqs, a.tokens) for i, k in enumerate("ABCDE")}
    # A: TP=1 page 16; B: TP=2 page 16; C: TP=1 page 32; D: TP=2 rank 0 page 16 (only)
    store(port, spec(1, 0, 16), sets["A"])
    for r in range(2):
        store(port, spec(2, r, 16), sets["B"])
    store(port, spec(1, 0, 32), sets["C"])
    store(port, spec(2, 0, 16), sets["D"])
    store(port, spec(1, 0, 16), sets["E"])  # E: for the 16 -> 32 row's same layout
    store(port, spec(1, 0, 32), sets["E"])
    cases = [
        # (name, reader, its prompts, what they were stored as, same-layout prompts)
        ("TP=1, page 16", spec(1, 0, 16), "B", "TP=2, page 16", "A"),
        ("TP=2 rank 0, page 16", spec(2, 0, 16), "A", "TP=1, page 16", "D"),
        ("TP=1, page 16", spec(1, 0, 16), "C", "TP=1, page 32", "A"),
        ("TP=1, page 32", spec(1, 0, 32), "A", "TP=1, page 16", "C"),
    ]
    loads = []
    for name, sp, cross, stored, same in cases:
        nbytes = n * 2 * sp.num_kv_heads * D * 2 * L
        assert load(port, sp, sets[cross]) == n and load(port, sp, sets[same]) == n
        t_cross = timeit(lambda sp=sp, k=cross: load(port, sp, sets[k]), repeat=a.repeat)
        t_same = timeit(lambda sp=sp, k=same: load(port, sp, sets[k]), repeat=a.repeat)
        g, gs = gbps(nbytes, t_cross), gbps(nbytes, t_same)
        loads.append([name, stored, f"{g:.2f}", f"{gs:.2f}", f"{g / gs:.2f}x"])
    toks = sets["A"][0]
    miss = list(range(7_000_000, 7_000_000 + a.tokens))
    reader = [spec(1, 0, 16)]
    calls = 200

    def lookups(t: list[int]) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            port.lookup_tokens(reader, t, None)
        return (time.perf_counter() - t0) / calls * 1e6

    assert port.lookup_tokens(reader, toks, None) == a.tokens
    assert port.lookup_tokens(reader, miss, None) == 0
    hit, cost = lookups(toks), lookups(miss)
    assisted = lookups(sets["B"][0])
    lk = [
        [f"hit, own layout ({a.tokens} tokens)", f"{hit:.0f}", "1.00x"],
        ["hit through TP=2's pages", f"{assisted:.0f}", f"{assisted / hit:.2f}x"],
        ["miss: every other layout asked", f"{cost:.0f}", f"{cost / hit:.2f}x"],
    ]
    return loads, lk


if __name__ == "__main__":
    main()
