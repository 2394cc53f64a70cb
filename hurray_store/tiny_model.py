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
