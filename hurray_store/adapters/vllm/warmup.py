"""Offline warmup through vLLM itself: prompts prefilled by vLLM with HurrayConnector,
so the cache holds them in the layout and under the identity vLLM serving reads."""

from __future__ import annotations

import os
import time
from typing import Any


def warm_with_vllm(
    model: str,
    config: str | None,
    prompts: list[list[int]],
    *,
    dtype: str = "auto",
    block_size: int = 32,
    batch_size: int = 8,
    hf_overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Prefill ``prompts`` with vLLM and HurrayConnector on ``config`` (a path; None:
    the embedded default), one output token each, ``batch_size`` at a time: every full
    prompt block is saved, in the layout and under the identity vLLM serving reads.
    Returns counts for a summary."""

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    if block_size % 32:
        raise ValueError(f"--page-size {block_size}: vLLM's CPU backend needs a multiple of 32")
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    longest = max((len(p) for p in prompts), default=1)
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype=dtype,
        max_model_len=max(1024, longest + 1),
        block_size=block_size,
        enforce_eager=True,
        enable_prefix_caching=True,
        max_num_seqs=batch_size,
        seed=0,
        hf_overrides=hf_overrides or {},
        kv_cache_memory_bytes=max(256 << 20, 2 * batch_size * longest * 4096),
        kv_transfer_config=KVTransferConfig(
            kv_connector="HurrayConnector",
            kv_connector_module_path="hurray_store.adapters.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"config": config},
        ),
    )
    sp = SamplingParams(temperature=0, max_tokens=1, detokenize=False)
    t0 = time.perf_counter()
    loaded = 0
    for a in range(0, len(prompts), batch_size):
        batch = [{"prompt_token_ids": p} for p in prompts[a : a + batch_size]]
        for r in llm.generate(batch, sp, use_tqdm=False):
            loaded += r.num_cached_tokens or 0
    return {
        "prompts": len(prompts),
        "tokens": sum(len(p) for p in prompts),
        "tokens not computed (cached)": loaded,
        "time": f"{time.perf_counter() - t0:.1f} s",
    }
