#!/usr/bin/env python
"""Benchmark of prefix reuse on the tiny model.

For the cpu, disk and redis configs: warm the cache from configs/sample_prompts.jsonl
(warmup tokens/s), reopen the store (disk and Redis then serve from the tier, not from
memory), and replay configs/sample_replay.jsonl: time to first token and prefill tokens
computed, without the cache (a full prefill) and with it, in the same run.

    .venv/bin/python tools/bench_reuse.py [--model models/tiny-llama]

A redis-server is started on a free loopback port; the model is built if absent.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _bench import table  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from hurray_store import PagedKVPool  # noqa: E402
from hurray_store.adapters.transformers import spec_for_model  # noqa: E402
from hurray_store.store import open_store  # noqa: E402
from hurray_store.testing.services import RedisProc  # noqa: E402
from hurray_store.tiny_model import build_tiny_model  # noqa: E402
from hurray_store.tokenizer import VOCAB_SIZE  # noqa: E402
from hurray_store.warmup import read_prompts, replay, warmup  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=str(ROOT / "models/tiny-llama"))
    ap.add_argument("--batch-size", type=int, default=8)
    a = ap.parse_args()
    if not Path(a.model, "config.json").exists():
        build_tiny_model(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model).eval()
    spec = spec_for_model(model, page_size=16)
    corpus, _ = read_prompts(ROOT / "configs/sample_prompts.jsonl", vocab_size=VOCAB_SIZE)
    requests, _ = read_prompts(ROOT / "configs/sample_replay.jsonl", vocab_size=VOCAB_SIZE)
    longest = max(len(p) for p in corpus + requests)
    work = Path(tempfile.mkdtemp(prefix="bench-reuse-"))
    redis = RedisProc(work / "redis").start()
    port = redis.port
    configs = {
        "cpu": [{"type": "cpu", "capacity_bytes": 1 << 30}],
        "disk": [{"type": "disk", "path": str(work / "disk"), "capacity_bytes": 1 << 32}],
        "redis": [{"type": "redis", "url": f"redis://127.0.0.1:{port}/0"}],
    }
    rows = []
    try:
        for name, tiers in configs.items():
            cfg = {"tiers": tiers, "policy": {"promote_on_hit": False}}

            async def run(cfg: dict = cfg, name: str = name) -> tuple:
                store = await open_store(cfg)
                pool = PagedKVPool(spec, (-(-longest // 16)) * (2 * a.batch_size + 4))
                w = await warmup(model, store, pool, corpus, batch_size=a.batch_size)
                if name != "cpu":  # serve from the tier itself
                    await store.close()
                    store = await open_store(cfg)
                reps = await replay(model, store, pool, requests)
                await store.close()
                return w, reps

            w, reps = asyncio.run(run())
            cold = statistics.median(r.ttft_cold_s for r in reps)
            hot = statistics.median(r.ttft_warm_s for r in reps)
            toks = sum(r.tokens for r in reps)
            computed = toks - sum(r.reused for r in reps)
            rows.append(
                [
                    name,
                    f"{w.tokens / w.seconds:,.0f}",
                    f"{w.tokens_computed:,}",
                    f"{cold * 1e3:.1f}",
                    f"{hot * 1e3:.1f}",
                    f"{cold / hot:.1f}x",
                    f"{toks:,}",
                    f"{computed:,}",
                    f"{max(r.max_abs_diff for r in reps):.1e}",
                ]
            )
    finally:
        redis.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"\ntiny Llama ({spec.num_layers} layers, {spec.num_kv_heads} kv heads x "
        f"{spec.head_dim}, {spec.dtype}), page 16; "
        f"warmup {len(corpus)} prompts, replay {len(requests)} requests\n"
    )
    print(
        table(
            [
                "config",
                "warmup prompt tok/s",
                "warmup tokens computed",
                "TTFT no cache ms",
                "TTFT cache ms",
                "speed-up",
                "replay prompt tokens",
                "replay tokens computed (cache)",
                "max logit diff",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
