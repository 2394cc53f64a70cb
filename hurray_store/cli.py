"""The ``hurray-store`` command line."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hurray_store import FormatError
from hurray_store.format import Manifest, decode_layer, encode_layer, parse_layer
from hurray_store.format.manifest import MANIFEST_MAGIC


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
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
    return _inspect_layer(data)


def _inspect_layer(data: bytes) -> str:
    k, v = parse_layer(data)
    out = [f"layer object: {len(data)} bytes, 2 block-paged tensors"]
    for p in (k, v):
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
        print(f"error: {path}: cannot read: {e.strerror}", file=sys.stderr)
        return 2
    try:
        print(inspect_bytes(data))
    except FormatError as e:
        print(f"error: {path}: {e}", file=sys.stderr)
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
        _table(
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


# ---------------------------------------------------------------------------- model jobs


def _load_model(path: str, dtype: str | None) -> Any:
    from transformers import AutoModelForCausalLM

    from hurray_store.tiny_model import DTYPES

    # The dtype saved with the model unless told otherwise, so that the CLI and the
    # API (spec_for_model takes the model's own dtype) share one cache.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype] if dtype else "auto")
    return model.eval()


def _read_corpus(path: str, model: Any, strict: bool) -> list[list[int]] | None:
    from hurray_store.warmup import read_prompts

    prompts, bad = read_prompts(path, vocab_size=int(model.config.vocab_size))
    for e in bad:
        print(
            f"{path}:{e.line}: {e.reason}; {'aborting (--strict)' if strict else 'skipped'}",
            file=sys.stderr,
        )
    if bad and strict:
        return None
    return prompts


def _pool_for(spec: Any, prompts: Sequence[Sequence[int]], batch_size: int) -> Any:
    from hurray_store.paging import PagedKVPool

    longest = max((len(p) for p in prompts), default=1)
    pages = -(-longest // spec.page_size)
    return PagedKVPool(spec, pages * (2 * batch_size + 4))


async def _warmup(
    args: argparse.Namespace, model: Any, prompts: list[list[int]], store: Any
) -> Any:
    from tqdm import tqdm

    from hurray_store.adapters.transformers import spec_for_model
    from hurray_store.warmup import warmup

    spec = spec_for_model(model, page_size=args.page_size)
    pool = _pool_for(spec, prompts, args.batch_size)
    t0 = time.perf_counter()
    bar = tqdm(total=len(prompts), unit="prompt", desc="warmup", disable=args.quiet)

    def progress(done: int, tokens: int, r: Any) -> None:
        bar.n = done
        dt = max(time.perf_counter() - t0, 1e-9)
        bar.set_postfix_str(
            f"{tokens / dt:,.0f} tok/s, {sum(r.bytes_per_tier.values()) / 2**20:,.1f} MiB written"
        )
        bar.refresh()

    try:
        return await warmup(
            model, store, pool, prompts, batch_size=args.batch_size, progress=progress
        )
    finally:
        bar.close()


def _print_warmup(res: Any) -> None:
    rows = [
        ["prompts", res.prompts],
        ["tokens", res.tokens],
        ["tokens computed", res.tokens_computed],
        ["prompts skipped (all pages stored)", res.prompts_skipped],
        ["pages referenced", res.pages_referenced],
        ["pages written", res.pages_written],
        ["pages already stored", res.pages_already_stored],
        *([[f"bytes to tier {k}", f"{v / 2**20:.1f} MiB"] for k, v in res.bytes_per_tier.items()]),
        ["time", f"{res.seconds:.1f} s"],
    ]
    print(_table(["warmup", "value"], rows))
    if res.pages_written == 0:
        print("nothing new to write: every page of the corpus was already stored")


def cmd_warmup(args: argparse.Namespace) -> int:
    import asyncio

    from hurray_store.store import open_store

    model = _load_model(args.model, args.dtype)
    prompts = _read_corpus(args.prompts, model, args.strict)
    if prompts is None:
        return 2

    async def run() -> Any:
        async with await open_store(args.config) as store:
            return await _warmup(args, model, prompts, store)

    try:
        res = asyncio.run(run())
    except KeyboardInterrupt:
        print(
            "interrupted: the cache holds the segments committed so far; run warmup again to go on",
            file=sys.stderr,
        )
        return 130
    _print_warmup(res)
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    import asyncio
    import statistics

    from hurray_store.adapters.transformers import spec_for_model
    from hurray_store.store import open_store
    from hurray_store.warmup import replay

    model = _load_model(args.model, args.dtype)
    warm = _read_corpus(args.warmup_prompts, model, args.strict) if args.warmup_prompts else []
    requests = _read_corpus(args.prompts, model, args.strict)
    if warm is None or requests is None:
        return 2
    spec = spec_for_model(model, page_size=args.page_size)

    async def run() -> tuple[Any, Any, dict[str, Any]]:
        async with await open_store(args.config) as store:
            res = await _warmup(args, model, warm, store) if warm else None
            rows = await replay(model, store, _pool_for(spec, requests, 1), requests)
            return res, rows, store.stats()

    res, rows, stats = asyncio.run(run())
    if res is not None:
        _print_warmup(res)
        print()
    tokens = sum(r.tokens for r in rows)
    reused = sum(r.reused for r in rows)
    hits = sum(1 for r in rows if r.reused)
    cold = statistics.median(r.ttft_cold_s for r in rows)
    hot = statistics.median(r.ttft_warm_s for r in rows)
    stored = max(t["bytes"] for t in stats["tiers"].values())
    per_seq = sum(len(p) // spec.page_size for p in warm) * spec.page_bytes * 2 * spec.num_layers
    out: list[list[object]] = [
        ["requests", len(rows)],
        ["requests with a prefix hit", f"{hits} ({hits / max(len(rows), 1):.0%})"],
        ["prefix hit rate (tokens reused / prompt tokens)", f"{reused / max(tokens, 1):.1%}"],
        ["prefill tokens skipped", f"{reused} of {tokens}"],
        ["time to first token, median, without the cache", f"{cold * 1e3:.1f} ms"],
        [
            "time to first token, median, with the cache",
            f"{hot * 1e3:.1f} ms ({cold / hot:.1f}x faster)",
        ],
        ["largest next-token logit difference", f"{max(r.max_abs_diff for r in rows):.2e}"],
        ["bytes stored (largest tier)", f"{stored / 2**20:.1f} MiB"],
    ]
    if per_seq:
        out.append(
            [
                "bytes a per-sequence store would need",
                f"{per_seq / 2**20:.1f} MiB ({per_seq / max(stored, 1):.1f}x)",
            ]
        )
    print(_table(["replay", "value"], out))
    return 0


# ---------------------------------------------------------------------------- serve


def cmd_serve(args: argparse.Namespace) -> int:
    """The cache server on a config's tiers, until SIGTERM or SIGINT (then exit 0)."""
    import asyncio
    import logging

    from hurray_store.config import load_config
    from hurray_store.errors import ConfigError
    from hurray_store.server import serve
    from hurray_store.store import TieredStore

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        cfg = load_config(args.config)
        store = TieredStore(cfg)
    except ConfigError as e:
        print(f"hurray-store serve: {e}", file=sys.stderr)
        return 2
    metrics_port = (
        -1 if args.metrics_port is None else (None if args.metrics_port < 0 else args.metrics_port)
    )
    try:
        asyncio.run(
            serve(store, cfg.server, host=args.host, port=args.port, metrics_port=metrics_port)
        )
    except OSError as e:  # the port is taken, the address is not ours
        print(f"hurray-store serve: cannot listen: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    """A running server's stats (its store's tiers, connections, staged segments)."""
    import asyncio
    import json

    from hurray_store.config import RemoteTierConfig
    from hurray_store.tiers.remote import RemoteTier

    async def get() -> dict[str, Any] | None:
        t = RemoteTier(
            RemoteTierConfig(
                url=args.url, name="remote", token=args.token or "", backoff_initial_s=0.0
            )
        )
        try:
            return await t.server_stats()
        finally:
            await t.close()

    stats = asyncio.run(get())
    if stats is None:
        print(f"hurray-store stats: no answer from {args.url}", file=sys.stderr)
        return 1
    print(json.dumps(stats, indent=2, sort_keys=True))
    return 0


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", default=None, help="store config (YAML); default: the embedded default"
    )
    p.add_argument("--model", required=True, help="a model directory (save_pretrained)")
    p.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default=None,
        help="default: the model's own",
    )
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--strict", action="store_true", help="abort on a bad corpus line instead of skipping it"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hurray-store", description="KV-cache storage on Hurray block-paged descriptors"
    )
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("warmup", help="prefill a prompt corpus with a model and fill the cache")
    _model_args(w)
    w.add_argument(
        "--prompts", required=True, help='JSONL: {"text": ...} or {"token_ids": [...]} per line'
    )
    w.set_defaults(func=cmd_warmup)
    r = sub.add_parser(
        "replay", help="replay requests against the cache: hit rate and time to first token"
    )
    _model_args(r)
    r.add_argument("--prompts", required=True, help="JSONL requests to replay")
    r.add_argument(
        "--warmup-prompts", default=None, help="JSONL corpus to warm the cache with first"
    )
    r.set_defaults(func=cmd_replay)
    d = sub.add_parser(
        "codec-demo", help="encode, decode and check a synthetic batch with shared prefixes"
    )
    d.add_argument("--layers", type=int, default=4)
    d.add_argument("--seqs", type=int, default=16)
    d.add_argument("--tokens", type=int, default=2048)
    d.add_argument("--heads", type=int, default=8)
    d.add_argument("--dim", type=int, default=128)
    d.add_argument("--page-size", type=int, default=16)
    d.set_defaults(func=cmd_demo)
    sv = sub.add_parser(
        "serve", help="run the cache server (Hurray network transport) on a config's tiers"
    )
    sv.add_argument(
        "--config",
        default=None,
        help="store config with a server: section (default: the embedded default)",
    )
    sv.add_argument("--host", default=None, help="address to listen on (default: server.host)")
    sv.add_argument(
        "--port", type=int, default=None, help="port (default: server.port; 0 picks a free one)"
    )
    sv.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="HTTP port for /metrics and health (default: server.metrics_port; -1: none)",
    )
    sv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sv.set_defaults(func=cmd_serve)
    st = sub.add_parser("stats", help="print a running cache server's stats as JSON")
    st.add_argument("--url", default="hurray://127.0.0.1:9470")
    st.add_argument("--token", default=None, help="the server's token, if it asks for one")
    st.set_defaults(func=cmd_stats)
    i = sub.add_parser(
        "inspect", help="print every descriptor field of a layer object or a manifest"
    )
    i.add_argument("path")
    i.set_defaults(func=cmd_inspect)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
