"""``hurray-store inspect`` and ``codec-demo``: the format, from the command line."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from hurray_store import FormatError
from hurray_store.errors import TensorCountError
from hurray_store.format import Manifest, decode_layer, encode_layer, parse_chunk, parse_layer
from hurray_store.format.manifest import MANIFEST_MAGIC
from hurray_store.format.records import (
    STATE_MAGIC,
    STATE_RECORD_BYTES,
    describe_chunk_record,
    describe_state_object,
)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in r] for r in [headers, *rows]]
    w = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def fmt(r: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(wi) if i else c.ljust(wi) for i, (c, wi) in enumerate(zip(r, w, strict=True))
        )

    return "\n".join([fmt(cells[0]), fmt(["-" * x for x in w]), *(fmt(r) for r in cells[1:])])


# ---------------------------------------------------------------------------- inspect


def inspect_bytes(data: bytes) -> str:
    """A readable account of a layer object or a manifest; raises FormatError if bad."""
    if data[:4] == MANIFEST_MAGIC:
        return _inspect_manifest(Manifest.from_bytes(data))
    if data[-STATE_RECORD_BYTES:][:4] == STATE_MAGIC:
        r = describe_state_object(data)
        return (
            f"state object: {len(data)} bytes, a page of {r['bytes']} bytes (a uint8 "
            f"tensor), then its record HSST v{r['version']}: fingerprint "
            f"{r['fingerprint'][:16]}..., check {r['check']}"
        )
    try:
        return _inspect_layer(data)
    except TensorCountError:
        return _inspect_chunk(data)  # more than a layer: a chunk object, or an error


def _inspect_chunk(data: bytes) -> str:
    """A chunk object: an LMCache chunk or an SGLang page (docs/format.md)."""
    layers, rec = parse_chunk(data)
    k0 = layers[0][0].descriptor
    fused = layers[0][0] is layers[0][1]
    form = "one fused (MLA latent)" if fused else "a key and a value"
    out = [
        f"chunk object: {len(data)} bytes, {len(layers)} layers of {form} "
        f"block-paged tensor, then a {len(rec)}-byte record",
        f"  dtype {k0.dtype.name}, shape {list(k0.shape)}, page_size {k0.layout.page_size}, "
        f"num_pages {k0.layout.num_pages}",
    ]
    for k, v in layers:
        where = (
            f"latent pool at {k.buffer_offsets[0]} ({k.buffer_sizes[0]} bytes)"
            if fused
            else f"key pool at {k.buffer_offsets[0]}, value pool at {v.buffer_offsets[0]} "
            f"({k.buffer_sizes[0]} bytes each)"
        )
        out.append(f"    layer {k.descriptor.layout.layer_index}: {where}")
    r = describe_chunk_record(rec)
    out.append(
        f"  record {r['magic']} v{r['version']}: {r['tokens']} tokens, {r['layers']} layers, "
        f"object size {r['object_size']}, fingerprint {r['fingerprint'][:16]}..., "
        f"record checksum {'ok' if r['checksum_ok'] else 'WRONG'}"
    )
    return "\n".join(out)


def _inspect_layer(data: bytes) -> str:
    k, v = parse_layer(data)
    tensors = (k,) if k is v else (k, v)  # one: a fused (MLA latent) layer
    out = [f"layer object: {len(data)} bytes, {len(tensors)} block-paged tensors"]
    for p in tensors:
        d, lay = p.descriptor, p.descriptor.layout
        q = d.quantization
        out += [
            f"  tensor at offset {p.offset} (descriptor {p.descriptor_len} bytes)",
            f"    layout tag     0x{lay.tag:02X} (block-paged)",
            f"    kv_role        {lay.kv_role}",
            f"    layer          {lay.layer_index}",
            f"    dtype          {d.dtype.name}",
            f"    shape          {list(d.shape)}",
            f"    page_size      {lay.page_size}",
            f"    num_pages      {lay.num_pages}",
            f"    num_seqs       {lay.num_seqs}",
            f"    index type     {lay.block_table_index_type}",
            f"    quantization   {q if q is not None else 'none'}",
            f"    buffers        {list(p.buffer_sizes)} bytes",
        ]
    layer = decode_layer(data)
    distinct = int(torch.unique(layer.block_table).numel())
    entries = int(layer.block_table.numel())
    out.append(
        f"  sharing: {entries} block-table entries over {distinct} distinct pages "
        f"({layer.num_pages} stored; {entries - distinct} entries alias a page already named)"
    )
    return "\n".join(out)


def _inspect_manifest(m: Manifest) -> str:
    out = [
        "segment manifest",
        f"  segment id     {m.segment_id.hex()}",
        f"  fingerprint    {m.fingerprint.hex()}",
        f"  quantization   {m.quantization or 'none'}",
        f"  page_size      {m.page_size}",
        f"  num_pages      {m.num_pages} (stored, {m.page_bytes} bytes per page per role)",
        f"  sequences      {len(m.sequences)}",
    ]
    for i, s in enumerate(m.sequences):
        out.append(
            f"    seq {i}: {s.seq_len} tokens, stores pages "
            f"{s.first_page}..{s.first_page + len(s.block_table) - 1}"
            f" as segment pages {list(s.block_table)[:8]}{'...' if len(s.block_table) > 8 else ''}"
        )
    out.append(f"  layers         {len(m.layers)}")
    for lay in m.layers:
        out.append(
            f"    layer {lay.layer_index}: key {lay.key!r}, {lay.object_size} bytes, "
            f"checksum {lay.object_checksum:016x}"
        )
    return "\n".join(out)


def cmd_inspect(args: argparse.Namespace) -> int:
    path = Path(args.path)
    try:
        data = path.read_bytes()
    except OSError as e:
        print(f"hurray-store inspect: error: {path}: cannot read: {e.strerror}", file=sys.stderr)
        return 2
    try:
        print(inspect_bytes(data))
    except FormatError as e:
        print(f"hurray-store inspect: error: {path}: {e}", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------- demo


def cmd_demo(args: argparse.Namespace) -> int:
    from hurray_store.synthetic import shared_prefix_layer

    rows = []
    total_bytes = 0
    t_enc = t_dec = 0.0
    for li in range(args.layers):
        layer = shared_prefix_layer(
            seqs=args.seqs,
            tokens=args.tokens,
            heads=args.heads,
            dim=args.dim,
            page_size=args.page_size,
            layer_index=li,
        )
        t0 = time.perf_counter()
        obj = encode_layer(layer)
        t1 = time.perf_counter()
        back = decode_layer(obj)
        t2 = time.perf_counter()
        ok = (
            torch.equal(back.keys, layer.keys)
            and torch.equal(back.values, layer.values)
            and torch.equal(back.block_table, layer.block_table)
            and torch.equal(back.seq_ptr, layer.seq_ptr)
        )
        if not ok:
            print(f"error: layer {li} did not round-trip", file=sys.stderr)
            return 1
        t_enc += t1 - t0
        t_dec += t2 - t1
        total_bytes += len(obj)
        rows.append(
            [
                li,
                layer.num_seqs,
                int(layer.block_table.numel()),
                layer.num_pages,
                f"{len(obj) / 2**20:.1f}",
                f"{len(obj) / (t1 - t0) / 1e9:.2f}",
                f"{len(obj) / (t2 - t1) / 1e9:.1f}",
                "ok",
            ]
        )
    print(
        f"hurray_store demo: {args.layers} layers, {args.seqs} sequences x {args.tokens} tokens, "
        f"half of every sequence's pages shared\n"
    )
    print(
        table(
            [
                "layer",
                "sequences",
                "pages referenced",
                "distinct pages stored",
                "MiB",
                "encode GB/s",
                "decode GB/s",
                "check",
            ],
            rows,
        )
    )
    per_seq = (
        args.seqs
        * (-(-args.tokens // args.page_size))
        * args.page_size
        * args.heads
        * args.dim
        * 2
        * 2
        * args.layers
    )
    print(
        f"\nstored {total_bytes / 2**20:.1f} MiB; a per-sequence copy would take "
        f"{per_seq / 2**20:.1f} MiB "
        f"({per_seq / total_bytes:.2f}x); encode {total_bytes / t_enc / 1e9:.2f} GB/s, "
        f"decode {total_bytes / t_dec / 1e9:.1f} GB/s"
    )
    return 0
