"""How much int8 pages change a model's output, in the terms users care about.

Models: small random-weight Llama, Qwen2, Mistral and Gemma2 built locally from a config
(4 layers, 2 KV heads of 64, vocab 2048), with ``initializer_range`` 0.08 so their logits
reach about 6 (sharper than the repository's tiny model, whose logits stay near 1). Per
model and dtype (float32, bfloat16), 8 prompts: a 256-token prefix is stored, then the
prefix plus 64 more tokens is prefilled on top of the retrieved prefix, and the 64
positions' logits are compared with a full recompute of the whole prompt (the
reference, in the same run):

- ``max |dlogit|``: the largest logit difference;
- ``top-1``: the share of positions whose next-token argmax is the recompute's;
- ``KL``: mean KL(recompute || reused) per position, in nats.

Rows ``none`` (exact pages) give the floor of the comparison itself: in bfloat16 a
prefill on top of a cache rounds differently from a full prefill even with exact KV.
Rows ``int8`` store pages as the store does (``quantization: int8``, one scale per page
slot). With ``--schemes`` it also prints what other scale groupings would give,
simulated by quantizing and dequantizing the cache in memory (nothing stored): ``slot``
(the store's: one scale per token over all heads), ``slot_head`` (one per token and
head), ``kivi`` (keys per channel over each page, values per token and head).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

import torch

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    DynamicCache,
    Gemma2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

from hurray_store import PagedKVPool  # noqa: E402
from hurray_store.adapters.transformers import (  # noqa: E402
    prefill_with_cache,
    run_model,
    spec_for_model,
)
from hurray_store.store import open_store  # noqa: E402

CONFIGS = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "mistral": MistralConfig,
    "gemma2": Gemma2Config,
}
PREFIX, TAIL, VOCAB = 256, 64, 2048


def build(kind: str, init: float, dtype: torch.dtype) -> Any:
    cfg = CONFIGS[kind](
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        initializer_range=init,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


def prompts(n: int) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, VOCAB, (PREFIX,), generator=g).tolist(),
            torch.randint(0, VOCAB, (TAIL,), generator=g).tolist(),
        )
        for _ in range(n)
    ]


class Score:
    def __init__(self) -> None:
        self.agree = self.total = 0
        self.maxd = self.kl = self.scale = 0.0

    def add(self, got: torch.Tensor, ref: torch.Tensor) -> None:
        a, b = got.float(), ref.float()
        self.maxd = max(self.maxd, (a - b).abs().max().item())
        self.scale = max(self.scale, b.abs().max().item())
        self.agree += int((a.argmax(-1) == b.argmax(-1)).sum().item())
        self.total += a.shape[0]
        self.kl += torch.nn.functional.kl_div(
            a.log_softmax(-1), b.log_softmax(-1), log_target=True, reduction="sum"
        ).item()

    def row(self, *head: str) -> str:
        cells = [*head, f"{self.scale:.1f}", f"{self.maxd:.3f}", f"{self.agree / self.total:.2%}"]
        return "| " + " | ".join(cells + [f"{self.kl / self.total:.1e}"]) + " |"


async def stored(model: Any, quant: str, cases: list[tuple[list[int], list[int]]]) -> Score:
    """Reuse through a store of ``quant`` pages against a full recompute."""
    spec = spec_for_model(model, page_size=16)
    s = Score()
    cfg = {"tiers": [{"type": "cpu", "capacity_bytes": 1 << 30}], "quantization": quant}
    async with await open_store(cfg) as store:
        for prefix, tail in cases:
            pool = PagedKVPool(spec, 64)
            await prefill_with_cache(model, store, pool, prefix)
            logits, _, n = await prefill_with_cache(
                model, store, pool, prefix + tail, store_result=False
            )
            assert n == PREFIX, n
            full, _ = run_model(model, torch.tensor([prefix + tail]))
            s.add(logits[0], full[0, PREFIX:])
    return s


def qdq(x: torch.Tensor, group: str) -> torch.Tensor:
    """Quantize and dequantize ``x`` ``[batch, heads, tokens, dim]`` to int8 with one
    absmax scale per group."""
    x = x.float()
    if group == "chan_page":
        b, h, t, d = x.shape
        xx = x.reshape(b, h, t // 16, 16, d)
        s = (xx.abs().amax(dim=3, keepdim=True) / 127).clamp_min(1e-30)
        return (torch.round(xx / s).clamp(-127, 127) * s).reshape(b, h, t, d)
    dims = (1, 3) if group == "slot" else (3,)
    s = (x.abs().amax(dim=dims, keepdim=True) / 127).clamp_min(1e-30)
    return torch.round(x / s).clamp(-127, 127) * s


def simulated(model: Any, scheme: str, cases: list[tuple[list[int], list[int]]]) -> Score:
    s = Score()
    for prefix, tail in cases:
        full, _ = run_model(model, torch.tensor([prefix + tail]))
        _, cache = run_model(model, torch.tensor([prefix]))
        c2 = DynamicCache()
        for li, layer in enumerate(cache.layers):
            k, v = layer.keys, layer.values
            if scheme == "kivi":
                k2, v2 = qdq(k, "chan_page"), qdq(v, "slot_head")
            else:
                k2, v2 = qdq(k, scheme), qdq(v, scheme)
            c2.update(k2.to(k.dtype), v2.to(v.dtype), li)
        logits, _ = run_model(model, torch.tensor([tail]), cache=c2)
        s.add(logits[0], full[0, PREFIX:])
    return s


async def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", default="llama,qwen2,mistral,gemma2")
    ap.add_argument("--init", type=float, default=0.08, help="initializer_range of the models")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--schemes", action="store_true", help="also simulate other scale groupings")
    a = ap.parse_args()
    cases = prompts(a.prompts)
    print(f"\n{a.prompts} prompts x {TAIL} positions per row; reference: a full recompute\n")
    print("| model | dtype | pages | max logit | max dlogit | top-1 | KL (nats) |")
    print("|---|---|---|---|---|---|---|")
    for kind in a.models.split(","):
        for dt in (torch.float32, torch.bfloat16):
            model = build(kind, a.init, dt)
            name = str(dt).split(".")[-1]
            for quant in ("none", "int8"):
                print((await stored(model, quant, cases)).row(kind, name, quant), flush=True)
            if a.schemes:
                for scheme in ("slot", "slot_head", "kivi"):
                    sim = simulated(model, scheme, cases)
                    print(sim.row(kind, name, f"{scheme} (simulated)"), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
