#!/usr/bin/env python
"""Benchmark of snapshot / restore and of the prefix index.

The batch of bench_format (32 sequences x 2048 tokens, 8 kv heads x 128, fp16, page 16,
the first half of every sequence's pages shared) over 4 layers, scattered across a
larger pool. Snapshot and restore GB/s beside `index_select(out=)` and `index_copy_` of
the same pages in the same run; stored bytes vs a per-sequence copy; `longest_prefix`
for a 32k-token prompt against an index of 1M pages, and the index's bytes per page.

    .venv/bin/python tools/bench_paging.py [--layers 4] [--index-pages 1000000]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _bench import gbps, table, timeit  # noqa: E402

from hurray_store import KVSpec, PagedKVPool, PrefixIndex, restore, snapshot  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--index-pages", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    spec = KVSpec("bench", a.layers, 8, 128, 16, torch.float16)
    per_seq = a.tokens // spec.page_size
    shared = per_seq // 2
    distinct = shared + a.seqs * (per_seq - shared)
    num_blocks = distinct * 2
    rng = np.random.default_rng(0)
    phys = rng.permutation(num_blocks)[:distinct].tolist()  # scattered source pages
    tables = [
        phys[:shared]
        + phys[shared + s * (per_seq - shared) : shared + (s + 1) * (per_seq - shared)]
        for s in range(a.seqs)
    ]
    lens = [a.tokens] * a.seqs
    src = PagedKVPool(spec, num_blocks)
    for t in src.layers:
        t.normal_()
    dst = PagedKVPool(spec, num_blocks)
    for t in dst.layers:
        t.zero_()  # fault the destination in, as an engine's pool is resident

    nbytes = distinct * spec.page_bytes * 2 * a.layers
    idx = torch.tensor(snapshot(src, tables, lens, layers=[0]).source_pages)
    outs = [torch.empty(2, distinct, 16, 8, 128, dtype=spec.dtype) for _ in range(a.layers)]

    def ref_gather() -> None:
        for li in range(a.layers):
            for r in range(2):
                torch.index_select(src.layers[li][r], 0, idx, out=outs[li][r])

    snap = snapshot(src, tables, lens)
    dst_ids = torch.arange(distinct)

    def ref_scatter() -> None:
        for li in range(a.layers):
            for r in range(2):
                dst.layers[li][r].index_copy_(0, dst_ids, outs[li][r])

    def do_restore() -> None:
        ids = restore(snap, dst)
        dst.free([p for t in ids for p in set(t)])

    t_ref_g = timeit(ref_gather, repeat=a.repeat)
    t_snap = timeit(lambda: snapshot(src, tables, lens), repeat=a.repeat)
    staging = torch.zeros(a.layers, 2, distinct, 16, 8, 128, dtype=spec.dtype)
    t_snap_out = timeit(lambda: snapshot(src, tables, lens, out=staging), repeat=a.repeat)
    t_ref_s = timeit(ref_scatter, repeat=a.repeat)
    t_rest = timeit(do_restore, repeat=a.repeat)
    per_seq_bytes = a.seqs * per_seq * spec.page_bytes * 2 * a.layers

    # ---- index
    index = PrefixIndex(capacity=a.index_pages)
    raw = rng.bytes(16 * a.index_pages)
    hashes = [raw[i * 16 : (i + 1) * 16] for i in range(a.index_pages)]
    t0 = time.perf_counter()
    chunk = 2048
    for s in range(0, a.index_pages, chunk):
        index.insert(s.to_bytes(8, "little"), 0, 0, hashes[s : s + chunk])
    t_build = time.perf_counter() - t0
    prompt = hashes[4096 : 4096 + 2048]  # a 32k-token prompt: 2048 pages, all indexed
    assert index.longest_prefix(prompt).num_pages == 2048
    t_lp = timeit(lambda: index.longest_prefix(prompt), repeat=21)
    miss = prompt[:1024] + [b"\0" * 16] * 1024
    t_lp_half = timeit(lambda: index.longest_prefix(miss), repeat=21)

    print(
        f"{a.layers} layers, {a.seqs} seqs x {a.tokens} tokens, fp16 8x128, page 16: "
        f"{a.seqs * per_seq} pages referenced, {distinct} distinct; {nbytes / 2**20:.0f} "
        f"MiB moved; median of {a.repeat}\n"
    )
    print(
        table(
            ["operation", "GB/s", "x reference"],
            [
                [
                    "index_select(out=) of the distinct pages (reference)",
                    f"{gbps(nbytes, t_ref_g):.2f}",
                    "1.00",
                ],
                [
                    "snapshot(out=staging) (dedup + gather into a resident buffer)",
                    f"{gbps(nbytes, t_snap_out):.2f}",
                    f"{t_ref_g / t_snap_out:.2f}",
                ],
                [
                    "snapshot (dedup + gather into fresh memory)",
                    f"{gbps(nbytes, t_snap):.2f}",
                    f"{t_ref_g / t_snap:.2f}",
                ],
                [
                    "index_copy_ of the distinct pages (reference)",
                    f"{gbps(nbytes, t_ref_s):.2f}",
                    "1.00",
                ],
                [
                    "restore (allocate + scatter + refcounts)",
                    f"{gbps(nbytes, t_rest):.2f}",
                    f"{t_ref_s / t_rest:.2f}",
                ],
            ],
        )
    )
    print()
    print(
        table(
            ["quantity", "value"],
            [
                ["bytes stored (distinct pages)", f"{nbytes / 2**20:.0f} MiB"],
                [
                    "bytes of a per-sequence copy",
                    f"{per_seq_bytes / 2**20:.0f} MiB ({per_seq_bytes / nbytes:.2f}x)",
                ],
                [
                    f"index of {len(index):,} pages: bytes per page",
                    f"{index.nbytes / len(index):.1f}",
                ],
                ["index build (inserts of 2048)", f"{t_build:.1f} s"],
                ["longest_prefix, 32k-token prompt, all 2048 pages hit", f"{t_lp * 1e3:.3f} ms"],
                ["longest_prefix, 32k-token prompt, miss after 1024", f"{t_lp_half * 1e3:.3f} ms"],
            ],
        )
    )


if __name__ == "__main__":
    main()
