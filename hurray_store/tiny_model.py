"""A tiny Llama-architecture causal LM with random weights, built locally:
the model of the demo, the warmup tests and the reuse benchmark. Nothing is downloaded.

4 layers, hidden 256, 4 attention heads, 2 KV heads (grouped-query attention), the
byte-level vocabulary of ``hurray_store.tokenizer``; a fixed seed makes the weights the
same on every machine.
"""

from __future__ import annotations

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
