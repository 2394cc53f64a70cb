"""Whether the connector can read and write a vLLM instance's KV views, and how vLLM's
CPU attention kernels pack a block, learned from the kernel itself (``learn_packing``:
a probe block whose elements hold their own coordinates)."""

from __future__ import annotations

from typing import Any

import torch

from hurray_store.adapters.vllm.layout import LAYOUTS, Packing
from hurray_store.spec import KVSpec


def check_views(
    vllm_config: Any, spec: KVSpec, layers: list[tuple[str, torch.Tensor]], layout: str
) -> Packing | None | str:
    """Whether the connector can read and write these KV views: the CPU backend's packing
    (learned from its kernel), None for a GPU backend's plain C, or why not."""
    views = [t for _, t in layers]
    v0 = views[0]
    if layout not in LAYOUTS:
        return f"a KV cache layout this connector does not know ({layout or 'none given'})"
    if v0.dtype != spec.dtype:
        return f"KV cache of dtype {v0.dtype}, the key says {spec.dtype}"
    if spec.fused:  # an MLA latent: [blocks, 1, tokens, C], the latent row per token
        if v0.dim() != 4 or (v0.shape[1], v0.shape[3]) != (1, spec.head_dim):
            return (
                f"MLA KV cache views of shape {tuple(v0.shape)}, expected [blocks, 1, "
                f"tokens, {spec.head_dim}]"
            )
        if spec.page_size % v0.shape[2]:
            return f"MLA kernel blocks of {v0.shape[2]} tokens in blocks of {spec.page_size}"
        if v0.device.type not in ("cpu", "cuda"):
            return f"KV caches on {v0.device.type}: only CPU and CUDA are supported"
        return None  # the latent is stored as it is: no packing
    want = (spec.num_kv_heads, 2 * spec.head_dim)
    if v0.dim() != 4 or (v0.shape[1], v0.shape[3]) != want or spec.page_size % v0.shape[2]:
        return (
            f"KV cache views of shape {tuple(v0.shape)}, expected [blocks, "
            f"{spec.num_kv_heads}, a divisor of {spec.page_size}, {2 * spec.head_dim}]"
        )
    if v0.device.type == "cuda":
        return None  # GPU backends keep C plain: K then V per token
    if v0.device.type != "cpu":
        return f"KV caches on {v0.device.type}: only CPU and CUDA are supported"
    ctx = vllm_config.compilation_config.static_forward_context
    isa = {getattr(ctx.get(name), "isa", None) for name, _ in layers}
    if len(isa) != 1 or None in isa or v0.shape[2] != spec.page_size:
        kernels = sorted(map(str, isa))
        return f"a KV packing this connector does not know (CPU attention kernel {kernels})"
    return learn_packing(str(next(iter(isa))), v0.dtype, spec)


def learn_packing(
    isa: str, dtype: torch.dtype, spec: KVSpec
) -> tuple[torch.Tensor, torch.Tensor] | str:
    """How vLLM's CPU attention kernel ``isa`` packs a block, learned from the kernel
    itself: it writes a probe block whose every element holds its own coordinates
    (token, dimension: 4 bits per pass, exact in any float dtype), and the result is
    read back. Returns ``(packed_of, logical_of)``, each ``[2, block_size *
    head_dim]`` (K, V): position ``p`` of a packed region holds element
    ``packed_of[r, p]`` (``token * head_dim + dim``), and ``logical_of`` is its
    inverse. A string: why it is not a permutation the connector can use."""
    from vllm import _custom_ops as ops

    bs, heads, hd = spec.page_size, spec.num_kv_heads, spec.head_dim
    n = bs * hd
    block = torch.zeros(1, heads, bs, 2 * hd, dtype=dtype)
    k_cache, v_cache = block.view(1, heads, 2 * bs, hd).chunk(2, dim=2)
    code = torch.arange(n).view(bs, 1, hd).expand(bs, heads, hd)
    found = torch.zeros(heads, 2, n, dtype=torch.long)
    try:
        for shift in range(0, max(n - 1, 1).bit_length(), 4):
            digit = ((code >> shift) & 15).to(dtype).contiguous()
            block.zero_()
            ops.cpu_attn_reshape_and_cache(
                digit, (15 - digit).contiguous(), k_cache, v_cache, torch.arange(bs), isa
            )
            got = block.view(heads, 2, n).to(torch.long)
            found[:, 0] += got[:, 0] << shift
            found[:, 1] += (15 - got[:, 1]) << shift
    except Exception as e:  # an ISA or dtype the kernel refuses
        return f"the CPU attention kernel {isa!r} packs no probe block ({e})"
    packed_of = found[0]
    if not (found == packed_of).all() or not all(
        torch.equal(torch.sort(p).values, torch.arange(n)) for p in packed_of
    ):
        return f"a KV packing this connector does not know (CPU attention kernel {isa!r})"
    return packed_of, torch.argsort(packed_of, dim=-1)
