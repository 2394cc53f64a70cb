#!/usr/bin/env python
"""Benchmark of the layer codec.

One layer of a realistic batch: 32 sequences x 2048 tokens, 8 kv heads x 128 dims,
fp16, page_size 16, the first half of every sequence's pages shared by all sequences.
Encode and decode GB/s of the layer object beside references measured in the same run
on the same number of bytes: a copy into a freshly allocated buffer, and a copy into a
preallocated one (memcpy).

    .venv/bin/python tools/bench_format.py [--seqs 32] [--tokens 2048] [--repeat 7]
"""

from __future__ import annotations

import argparse
import os
import sys

import hurray
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _bench import gbps, table, timeit  # noqa: E402

from hurray_store.format import decode_layer, encode_layer, encode_layer_buffers  # noqa: E402
from hurray_store.synthetic import shared_prefix_layer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(1)  # the references (memcpy) are single-threaded too
    layer = shared_prefix_layer(
        seqs=a.seqs, tokens=a.tokens, heads=a.heads, dim=a.dim, page_size=a.page
    )
    obj = encode_layer(layer)
    n = len(obj)
    src = np.frombuffer(obj, dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = 1  # fault the pages in: memcpy into a preallocated, resident buffer

    mv = memoryview(obj)
    t_fresh = timeit(lambda: bytes(mv), repeat=a.repeat)
    t_memcpy = timeit(lambda: np.copyto(dst, src), repeat=a.repeat)
    t_enc = timeit(lambda: encode_layer(layer), repeat=a.repeat)
    t_vec = timeit(lambda: encode_layer_buffers(layer), repeat=a.repeat)

    def vec_into_prealloc() -> None:
        pos = 0
        for b in encode_layer_buffers(layer).buffers:
            m = memoryview(b).cast("B")
            dst[pos : pos + m.nbytes] = m
            pos += m.nbytes

    t_vec_copy = timeit(vec_into_prealloc, repeat=a.repeat)
    t_dec = timeit(lambda: decode_layer(obj), repeat=a.repeat)
    t_dec_touch = timeit(lambda: decode_layer(obj).keys.sum(), repeat=a.repeat)
    t_sum = timeit(lambda: layer.keys.sum(), repeat=a.repeat)

    def hurray_writer() -> bytes:
        with hurray.StreamWriter() as w:
            for t in hurray.StreamReader(obj):
                w.write(t)
        return w.getvalue()

    t_hw = timeit(hurray_writer, repeat=3)
    t_q = timeit(lambda: encode_layer(layer, quantization="int8"), repeat=3)
    qobj = encode_layer(layer, quantization="int8")
    t_dq = timeit(lambda: decode_layer(qobj), repeat=3)

    ref_fresh, ref_mem = gbps(n, t_fresh), gbps(n, t_memcpy)
    rows = [
        ["copy into a fresh buffer (reference)", f"{ref_fresh:.2f}", "1.00", "-"],
        ["memcpy into a preallocated buffer (reference)", f"{ref_mem:.2f}", "-", "1.00"],
        [
            "encode_layer -> bytes",
            f"{gbps(n, t_enc):.2f}",
            f"{t_fresh / t_enc:.2f}",
            f"{t_memcpy / t_enc:.2f}",
        ],
        [
            "encode_layer_buffers (descriptors + views)",
            f"{gbps(n, t_vec):.1f}",
            f"{t_fresh / t_vec:.1f}",
            f"{t_memcpy / t_vec:.1f}",
        ],
        [
            "encode_layer_buffers + copy into a preallocated buffer",
            f"{gbps(n, t_vec_copy):.2f}",
            f"{t_fresh / t_vec_copy:.2f}",
            f"{t_memcpy / t_vec_copy:.2f}",
        ],
        [
            "decode_layer (validated, zero-copy views)",
            f"{gbps(n, t_dec):.1f}",
            f"{t_fresh / t_dec:.1f}",
            f"{t_memcpy / t_dec:.1f}",
        ],
        [
            "decode_layer + read every key byte (sum)",
            f"{gbps(n, t_dec_touch):.2f}",
            "-",
            f"{t_sum / t_dec_touch:.2f} of the same sum",
        ],
        [
            "pyhurray StreamReader + in-memory StreamWriter",
            f"{gbps(n, t_hw):.2f}",
            f"{t_fresh / t_hw:.2f}",
            f"{t_memcpy / t_hw:.2f}",
        ],
        [
            "encode_layer int8 (quantize + encode)",
            f"{gbps(n, t_q):.2f}",
            f"{t_fresh / t_q:.2f}",
            f"{t_memcpy / t_q:.2f}",
        ],
        [
            "decode_layer int8 (validate + dequantize)",
            f"{gbps(n, t_dq):.2f}",
            f"{t_fresh / t_dq:.2f}",
            f"{t_memcpy / t_dq:.2f}",
        ],
    ]
    pages = int(layer.block_table.numel())
    print(
        f"layer object: {a.seqs} seqs x {a.tokens} tokens, {a.heads}x{a.dim} fp16, page {a.page}: "
        f"{pages} pages referenced, {layer.num_pages} distinct stored, {n / 2**20:.1f} MiB "
        f"(int8: {len(qobj) / 2**20:.1f} MiB); median of {a.repeat}"
    )
    print(table(["path", "GB/s", "x fresh copy", "x memcpy"], rows))


if __name__ == "__main__":
    main()
