"""``hurray-store warmup`` and ``replay``: jobs that run a model over the cache."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from hurray_store.cli.format_cmds import table

# ---------------------------------------------------------------------------- model jobs


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    import json

    raw = getattr(args, "hf_overrides", None)
    if not raw:
        return {}
    try:
        out = json.loads(raw)
    except ValueError as e:
        raise SystemExit(f"--hf-overrides: not JSON ({e})") from None
    if not isinstance(out, dict):
        raise SystemExit("--hf-overrides: a JSON object of config fields")
    return out


def _check_first(args: argparse.Namespace) -> None:
    """What can be checked before a model is loaded (minutes with a real one): the
    store config, and that the model is a local folder (nothing here downloads)."""
    from pathlib import Path

    from hurray_store.config import load_config

    load_config(args.config)  # a ConfigError naming the dotted key, now
    m = Path(args.model)
    if not m.is_dir():
        raise ValueError(f"--model {args.model}: no such model folder (nothing is downloaded)")
    if not (m / "config.json").is_file():
        raise ValueError(f"--model {args.model}: no config.json (not a save_pretrained folder)")


def _load_model(path: str, dtype: str | None, overrides: dict[str, Any] | None = None) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    from hurray_store.adapters.transformers import apply_hf_overrides
    from hurray_store.tiny_model import DTYPES

    config = AutoConfig.from_pretrained(path)
    apply_hf_overrides(config, overrides or {})
    # The dtype saved with the model unless told otherwise, so that the CLI and the
    # API (spec_for_model takes the model's own dtype) share one cache.
    model = AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=DTYPES[dtype] if dtype else "auto"
    )
    return model.eval()


def _read_corpus(path: str, vocab_size: int, strict: bool) -> list[list[int]] | None:
    """The corpus's prompts, each bad line reported as ``file:line: reason``; None when
    one is bad and ``strict``."""
    from hurray_store.warmup import read_prompts

    prompts, bad = read_prompts(path, vocab_size=vocab_size)
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
    from hurray_store.warmup import pool_pages

    pages = pool_pages(prompts, spec.page_size, batch_size)
    try:
        return PagedKVPool(spec, pages)
    except (MemoryError, RuntimeError) as e:  # torch reports a failed allocation so
        nbytes = pages * spec.page_bytes * 2 * spec.num_layers
        raise ValueError(
            f"cannot allocate the KV pool: {pages} pages of {spec.page_size} tokens "
            f"({nbytes / 2**30:.1f} GiB); use a smaller --page-size or --batch-size "
            f"({str(e).splitlines()[0][:200]})"
        ) from None


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
    print(table(["warmup", "value"], rows))
    if res.pages_written == 0:
        print("nothing new to write: every page of the corpus was already stored")


def _warmup_vllm(args: argparse.Namespace) -> int:
    """Warm the cache vLLM serving reads: vLLM prefills the corpus with HurrayConnector
    (one output token per prompt), and the connector saves every full prompt block."""
    from transformers import AutoConfig

    from hurray_store.adapters.vllm.warmup import warm_with_vllm

    vocab = int(AutoConfig.from_pretrained(args.model).vocab_size)
    prompts = _read_corpus(args.prompts, vocab, args.strict)
    if prompts is None:
        return 2
    res = warm_with_vllm(
        args.model,
        args.config,
        prompts,
        dtype=args.dtype or "auto",
        block_size=args.page_size,
        batch_size=args.batch_size,
        hf_overrides=_overrides(args),
    )
    print(table(["warmup (vLLM)", "value"], [[k, v] for k, v in res.items()]))
    return 0


def cmd_warmup(args: argparse.Namespace) -> int:
    import asyncio

    from hurray_store.store import open_store

    vllm = getattr(args, "engine", "transformers") == "vllm"
    _check_first(args)
    if args.page_size is None:
        args.page_size = 32 if vllm else 16
    if vllm:
        return _warmup_vllm(args)
    model = _load_model(args.model, args.dtype, _overrides(args))
    prompts = _read_corpus(args.prompts, int(model.config.vocab_size), args.strict)
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

    _check_first(args)
    if args.page_size is None:
        args.page_size = 16
    model = _load_model(args.model, args.dtype, _overrides(args))
    warm = (
        _read_corpus(args.warmup_prompts, int(model.config.vocab_size), args.strict)
        if args.warmup_prompts
        else []
    )
    requests = _read_corpus(args.prompts, int(model.config.vocab_size), args.strict)
    if warm is None or requests is None:
        return 2
    spec = spec_for_model(model, page_size=args.page_size)

    from tqdm import tqdm

    async def run() -> tuple[Any, Any, dict[str, Any]]:
        async with await open_store(args.config) as store:
            res = await _warmup(args, model, warm, store) if warm else None
            with tqdm(
                total=len(requests), unit="request", desc="replay", disable=args.quiet
            ) as bar:
                rows = await replay(
                    model, store, _pool_for(spec, requests, 1), requests, bar.update
                )
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
    print(table(["replay", "value"], out))
    return 0


# ---------------------------------------------------------------------------- serve
