"""Between a transformers causal LM and a paged pool.

```
spec = spec_for_model(model, page_size=16)                 # KVSpec from model.config
block_tables = to_paged(past_key_values, pool, seq_lens)   # cache -> pool pages
past = from_paged(pool, block_tables, seq_lens)            # pool pages -> a cache
logits, cache, reused = await prefill_with_cache(model, store, pool, token_ids)
```

What is supported:
- ``to_paged`` takes a batched cache, right padded (a sequence's tokens at positions
  ``0 .. n-1``, the default) or left padded (``padding_side="left"``: at ``T-n .. T-1``).
  With ``token_ids`` given, full pages whose whole token prefix is equal across the
  batch are stored once and shared (reference counts as in ``restore``). The caller
  vouches that the KV at those positions is what an unpadded prefill computes (true
  for right padding with a causal mask; for left padding only with position ids that
  start at each sequence's first real token).
- ``from_paged`` rebuilds a cache for sequences of equal length (batch 1 included);
  unequal lengths need padding and masks the caller owns, so they are refused.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache

from hurray_store.errors import PagingError, SpecError
from hurray_store.identity import model_identity, model_weights_id
from hurray_store.paging import PagedKVPool, allocate_shared, release_shared
from hurray_store.spec import KVSpec


def run_model(
    model: Any,
    input_ids: torch.Tensor,
    *,
    cache: Any = None,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Any]:
    """One forward pass continuing from ``cache``; returns (logits, the new cache).
    transformers 5 renamed ``past_key_values`` to ``cache``: this takes whichever the
    installed version's model accepts."""
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    args: dict[str, Any] = {"input_ids": input_ids.to(model.device), "use_cache": True, kw: cache}
    if attention_mask is not None:
        args["attention_mask"] = attention_mask.to(model.device)
    with torch.no_grad():
        out = model(**args)
    new = out["cache"] if "cache" in out else out["past_key_values"]
    return out.logits, new


def model_id(model: Any) -> str:
    """The model's identity as its weights (``identity.model_weights_id``) and the
    KV-shaping fields of its config (``identity.config_id``): for a model loaded from a
    folder of safetensors and unchanged since, the same identity vLLM's connector
    derives from that folder with the same config overrides; another as soon as one
    weight or one such field differs. Two models whose weights differ never share a
    page, whatever their names or paths; the same weights from another folder do."""
    return model_identity(model_weights_id(model), model.config)


def apply_hf_overrides(config: Any, overrides: dict[str, Any]) -> None:
    """Override fields of a transformers config in place as vLLM's ``hf_overrides``
    does: a mapping into a nested config updates it field by field; any other value (a
    mapping such as ``rope_parameters`` included) replaces the field. The same
    overrides give a model the config, and so the identity, vLLM serves it under."""
    for key, value in overrides.items():
        sub = getattr(config, key, None)
        if isinstance(value, dict) and hasattr(sub, "to_dict") and hasattr(sub, "update"):
            apply_hf_overrides(sub, value)
        else:
            setattr(config, key, value)


# Architectures whose cache is not one K and one V per layer of [kv_heads, tokens,
# head_dim]: state-space and convolution layers, linear attention, hybrids.
_UNSUPPORTED_TYPES = frozenset(
    {
        "bamba", "falcon_h1", "granitemoehybrid", "jamba", "lfm2", "lfm2_moe", "mamba", "mamba2",
        "minimax", "nemotron_h", "qwen3_next", "recurrent_gemma", "rwkv", "xlstm", "zamba",
        "zamba2",
    }
)  # fmt: skip
_PAGED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def check_supported(config: Any) -> None:
    """Refuse, at once and by name, a model whose KV cache this store cannot page:
    multi-head latent attention (MLA), KV shared across layers, and layers that are not
    attention (state-space, convolution, linear attention). SpecError says which."""
    model_type = str(getattr(config, "model_type", ""))
    why = ""
    if getattr(config, "kv_lora_rank", None):
        why = "multi-head latent attention (MLA: a compressed KV, not K and V per head)"
    elif getattr(config, "num_kv_shared_layers", 0):
        why = f"KV shared across layers ({config.num_kv_shared_layers} layers reuse others')"
    elif model_type in _UNSUPPORTED_TYPES:
        why = "layers that are not attention (state-space, convolution or linear attention)"
    else:
        kinds = set(getattr(config, "layer_types", None) or ()) - _PAGED_LAYER_TYPES
        if kinds:
            why = f"layers of kind {sorted(kinds)}, which keep no paged K and V"
    if why:
        raise SpecError(
            f"model type {model_type!r} is not supported: {why}. Supported are models whose "
            "layers all keep K and V per KV head (full or sliding-window attention)."
        )


def spec_for_model(model: Any, *, page_size: int = 16, revision: str = "") -> KVSpec:
    """The KVSpec of ``model``'s cache, in the dtype the model runs in. An architecture
    the store cannot page is refused at once (``check_supported``), not after a forward
    pass."""
    cfg = model.config
    check_supported(cfg)
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    dtype = next(model.parameters()).dtype
    return KVSpec(
        model_id(model),
        int(cfg.num_hidden_layers),
        kv_heads,
        head_dim,
        page_size,
        dtype,
        revision,
    )


def _cache_layers(past: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer, each ``[batch, kv_heads, tokens, head_dim]``."""
    if hasattr(past, "layers"):
        return [(lay.keys, lay.values) for lay in past.layers]
    if isinstance(past, tuple | list):
        return [(k, v) for k, v in past]
    raise TypeError(
        f"expected a transformers cache or a tuple of (keys, values), got {type(past).__name__}"
    )


def to_paged(
    past: Any,
    pool: PagedKVPool,
    seq_lens: Sequence[int],
    *,
    token_ids: Sequence[Sequence[int]] | None = None,
    padding_side: str = "right",
    position_ids: Any = None,
) -> list[list[int]]:
    """Copy each sequence's first ``seq_lens[b]`` tokens of KV from a cache into newly
    allocated pages of ``pool``; returns the block tables. All or nothing: too few free
    pages raises PoolExhaustedError before anything is allocated.

    A left-padded batch (``padding_side="left"``) is stored only with the
    ``position_ids`` ``[batch, tokens]`` the model ran with, and only when each
    sequence's tokens were at positions ``0 .. n-1``: KV computed at the padded
    positions would be wrong for every later prompt that reuses it."""
    spec = pool.spec
    P = spec.page_size
    layers = _cache_layers(past)
    if len(layers) != spec.num_layers:
        raise PagingError(f"the cache has {len(layers)} layers, the pool {spec.num_layers}")
    k0 = layers[0][0]
    if k0.dim() != 4 or k0.shape[1] != spec.num_kv_heads or k0.shape[3] != spec.head_dim:
        raise PagingError(
            f"cache keys must be [batch, {spec.num_kv_heads}, tokens, {spec.head_dim}], "
            f"got {tuple(k0.shape)}"
        )
    B, T = int(k0.shape[0]), int(k0.shape[2])
    if len(seq_lens) != B:
        raise PagingError(f"the cache holds {B} sequences, {len(seq_lens)} seq_lens given")
    if padding_side not in ("left", "right"):
        raise PagingError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    for b, n in enumerate(seq_lens):
        if not 0 <= n <= T:
            raise PagingError(f"sequence {b}: seq_len {n} outside [0, {T}] cached tokens")
    if padding_side == "left":
        _check_left_positions(position_ids, seq_lens, B, T)
    for b, n in enumerate(seq_lens):
        if token_ids is not None and len(token_ids[b]) < n:
            raise PagingError(
                f"sequence {b}: {n} tokens cached but {len(token_ids[b])} token ids given"
            )
    # Plan pages: equal full-page prefixes (with token ids) map to one page.
    owner: dict[tuple[int, ...], int] = {}
    local: list[list[int]] = []
    copies: list[tuple[int, int, int]] = []  # (sequence, first token, local page) to fill
    count = 0
    for b, n in enumerate(seq_lens):
        row = []
        for i in range(-(-n // P)):
            full = (i + 1) * P <= n
            key = tuple(token_ids[b][: (i + 1) * P]) if token_ids is not None and full else None
            if key is not None and key in owner:
                row.append(owner[key])
                continue
            row.append(count)
            copies.append((b, i * P, count))
            if key is not None:
                owner[key] = count
            count += 1
        local.append(row)
    new_ids = allocate_shared(pool, local, count)
    try:
        src_b: list[int] = []
        src_t: list[int] = []
        dst: list[int] = []
        for b, t0, page in copies:
            n = min(P, seq_lens[b] - t0)
            base = (T - seq_lens[b]) if padding_side == "left" else 0
            src_b += [b] * n
            src_t += range(base + t0, base + t0 + n)
            dst += range(new_ids[page] * P, new_ids[page] * P + n)
        dev = pool.device
        ib = torch.tensor(src_b, dtype=torch.long, device=k0.device)
        it = torch.tensor(src_t, dtype=torch.long, device=k0.device)
        idst = torch.tensor(dst, dtype=torch.long, device=dev)
        for li, (k, v) in enumerate(layers):
            flat = pool.layers[li].view(2, pool.num_pages * P, spec.num_kv_heads, spec.head_dim)
            for role, t in ((0, k), (1, v)):
                rows = t[ib, :, it, :]  # [tokens, heads, dim]
                flat[role].index_copy_(0, idst, rows.to(device=dev, dtype=spec.dtype))
    except BaseException:
        release_shared(pool, new_ids, local)
        raise
    return [[new_ids[j] for j in row] for row in local]


def _check_left_positions(position_ids: Any, seq_lens: Sequence[int], B: int, T: int) -> None:
    if position_ids is None:
        raise PagingError(
            "a left-padded batch needs the position_ids the model ran with: without them "
            "its KV is at the padded positions, wrong for any prompt that reuses it"
        )
    pos = torch.as_tensor(position_ids)
    if tuple(pos.shape) != (B, T):
        raise PagingError(f"position_ids must be [{B}, {T}], got {tuple(pos.shape)}")
    for b, n in enumerate(seq_lens):
        got = pos[b, T - n :].tolist()
        if got != list(range(n)):
            raise PagingError(
                f"sequence {b}: its {n} tokens ran at positions {got[:3]}...; they must be "
                f"0..{n - 1} (run the batch with position_ids counting from each first token)"
            )


def from_paged(
    pool: PagedKVPool,
    block_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    *,
    device: Any = None,
) -> DynamicCache:
    """A transformers cache holding each sequence's first ``seq_lens[b]`` tokens from
    its pages, for ``model(..., past_key_values=cache)`` or ``generate`` to continue.
    Sequences must have equal lengths (see the module docstring)."""
    spec = pool.spec
    P = spec.page_size
    if len(block_tables) != len(seq_lens) or not seq_lens:
        raise PagingError(f"{len(block_tables)} block tables for {len(seq_lens)} seq_lens")
    if len(set(seq_lens)) != 1:
        raise PagingError(
            f"from_paged rebuilds sequences of equal length only, got {sorted(set(seq_lens))}: "
            "continue each sequence on its own, or pad and mask them yourself"
        )
    n = int(seq_lens[0])
    pages = -(-n // P)
    for b, t in enumerate(block_tables):
        if len(t) < pages:
            raise PagingError(
                f"sequence {b}: {n} tokens need {pages} pages, its block table has {len(t)}"
            )
    idx = torch.tensor(
        [list(t[:pages]) for t in block_tables], dtype=torch.long, device=pool.device
    )
    cache = DynamicCache()
    for li in range(spec.num_layers):
        kv = pool.layers[li]
        k, v = (
            kv[r][idx]
            .reshape(len(seq_lens), pages * P, spec.num_kv_heads, spec.head_dim)[:, :n]
            .transpose(1, 2)
            .contiguous()
            for r in (0, 1)
        )
        if device is not None:
            k, v = k.to(device), v.to(device)
        cache.update(k, v, li)
    return cache


async def prefill_with_cache(
    model: Any,
    store: Any,
    pool: PagedKVPool,
    token_ids: Sequence[int],
    *,
    store_result: bool = True,
) -> tuple[torch.Tensor, Any, int]:
    """Prefill one prompt on top of whatever full pages of it the store holds.

    Returns ``(logits, cache, tokens_reused)``: ``logits`` ``[1, len(token_ids) -
    tokens_reused, vocab]`` for the positions computed, ``cache`` to continue
    generation. At least the last token is always computed (as vLLM does), so a fully
    cached prompt still yields next-token logits. With ``store_result`` the prompt's
    new full pages are put into the store.
    """
    spec = pool.spec
    P = spec.page_size
    L = len(token_ids)
    if L == 0:
        raise ValueError("an empty prompt has nothing to prefill")
    reusable = ((L - 1) // P) * P
    n = 0
    past: Any = DynamicCache()
    if reusable:
        got = await store.retrieve(pool, [list(token_ids[:reusable])])
        n = got.num_tokens[0]
        if n:
            try:
                past = from_paged(pool, got.block_tables, [n], device=model.device)
            finally:
                pool.free(got.block_tables[0])
    logits, cache = run_model(
        model, torch.tensor([list(token_ids[n:])], dtype=torch.long), cache=past
    )
    if store_result and n // P < L // P:
        tables = to_paged(cache, pool, [L], token_ids=[list(token_ids)])
        try:
            await store.put(pool, [list(token_ids)], tables)
        finally:
            pool.free(tables[0])
    return logits, cache, n
