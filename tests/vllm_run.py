"""One vLLM instance of the connector tests (run as ``python -m tests.vllm_run`` in the
vLLM environment, each instance in its own process): it generates greedy tokens for
the prompts of a JSON file, one request at a time, and prints per prompt the tokens and
``num_cached_tokens`` as JSON."""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="JSON: a list of token id lists")
    ap.add_argument("--config", default=None, help="hurray_store config: the connector on")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-batched-tokens", type=int, default=None)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--stats", default="", help="where the connector's worker writes its counts")
    ap.add_argument(
        "--after-first-hit",
        default="",
        help="JSON: what tests/vllm_hooks.py's LosingConnector does after its first lookup hit",
    )
    a = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = None
    if a.config:
        extra = {"config": a.config, "stats_file": a.stats}
        connector = ("HurrayConnector", "hurray_store.adapters.vllm")
        if a.after_first_hit:
            extra["after_first_hit"] = json.loads(a.after_first_hit)
            connector = ("LosingConnector", "tests.vllm_hooks")
        kv = KVTransferConfig(
            kv_connector=connector[0],
            kv_connector_module_path=connector[1],
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
    chunking = {}
    if a.max_batched_tokens:
        chunking = {"max_num_batched_tokens": a.max_batched_tokens, "enable_chunked_prefill": True}
    llm = LLM(
        model=a.model,
        skip_tokenizer_init=True,
        dtype=a.dtype,
        max_model_len=1024,
        block_size=a.block_size,
        enforce_eager=True,
        enable_prefix_caching=not a.no_prefix_caching,
        max_num_seqs=4,
        seed=0,
        kv_cache_memory_bytes=64 << 20,
        kv_transfer_config=kv,
        **chunking,
    )
    sp = SamplingParams(
        temperature=0, ignore_eos=True, max_tokens=a.max_tokens, detokenize=False, logprobs=3
    )
    out = []
    with open(a.prompts) as f:
        prompts = json.load(f)
    for ids in prompts:
        (r,) = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
        first = (r.outputs[0].logprobs or [{}])[0]  # the first output token's top logprobs
        out.append(
            {
                "tokens": list(r.outputs[0].token_ids),
                "cached": r.num_cached_tokens or 0,
                "logprobs": {str(t): lp.logprob for t, lp in first.items()},
            }
        )
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
