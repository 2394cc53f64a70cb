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
registered (``learn_packing``: a probe block whose elements hold their own
coordinates), then converts on save and back on load. A layout it cannot learn (a GPU
backend, a packing that is not a permutation) is refused with one log line, and vLLM
serves without the cache.

What a page is keyed by (docs/vllm.md, "What the key includes"): its tokens, chained
from the request's first; the model's identity (``identity.model_identity``: the
checkpoint's weights, not the folder's name, and the KV-shaping fields of the config as
vLLM runs it, after ``--hf-overrides``); the KV cache's geometry and dtype as vLLM
allocated it; the model's KV heads the worker holds (their range, not the rank: an
instance of another TP size or block size loads them, ``engine/portable.py``); and per
request its
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

import json
import logging
import os
import threading
from concurrent import futures
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from hurray_store.adapters.vllm.events import WorkerEvents
from hurray_store.adapters.vllm.layout import LayoutError
from hurray_store.adapters.vllm.probe import check_views
from hurray_store.adapters.vllm.scheduler import TIMEOUT_S, HurrayMetadata, SchedulerSide
from hurray_store.adapters.vllm.spec import (
    CacheGroup,
    cache_groups,
    first_holder,
    hit_source,
    is_hybrid,
    rank_specs,
    unkeyable,
)
from hurray_store.adapters.vllm.transfer import BlockTransfers, Loading, Transfer
from hurray_store.engine import EnginePort
from hurray_store.engine.extra import check_keys
from hurray_store.engine.identity import WeightsIdentity
from hurray_store.keys import check_salt
from hurray_store.spec import KVSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class HurrayConnector(KVConnectorBase_V1, SupportsHMA):
    # What kv_connector_extra_config takes (a subclass adds its own).
    extra_keys: tuple[str, ...] = ("config", "salt", "save_backlog_mb", "stats_file")

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        check_keys(extra, self.extra_keys, type(self).__name__, "kv_connector_extra_config")
        if "config" not in extra:
            raise ValueError(
                'HurrayConnector: kv_connector_extra_config needs "config": the path of a '
                "hurray_store YAML config"
            )
        self.block_size = int(vllm_config.cache_config.block_size)
        # Refused at start, in both halves (the scheduler then promises no load): an
        # instance whose pages the key cannot tell apart.
        self.disabled = unkeyable(vllm_config, kv_cache_config)
        rank = 0
        if role == KVConnectorRole.WORKER and not self.disabled:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = int(get_tensor_model_parallel_rank())
        if self.disabled:
            off = KVSpec("unkeyable", 1, 1, 1, self.block_size, torch.float32)
            self.groups = [CacheGroup(0, (), 0, off)]
        else:
            # One per KV cache group vLLM pages (one but for a hybrid model).
            self.groups = cache_groups(vllm_config, kv_cache_config, rank)
        self.spec = self.groups[0].spec
        # A hybrid model (several groups, or a sliding window): each group's blocks
        # loaded asynchronously, every group or none (docs/vllm.md, "Hybrid and
        # sliding-window models").
        self.hybrid = not self.disabled and is_hybrid(kv_cache_config)
        tp = int(vllm_config.parallel_config.tensor_parallel_size)
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
            "loads_abandoned": 0,  # a layer not in within engine.wait_s: blocks recomputed
        }
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "") != "recompute":
            # A cache that cannot deliver a block is a miss: vLLM recomputes it (its
            # default for load failures is to fail the request). The scheduler reads the
            # policy after it built this connector.
            object.__setattr__(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
            if role == KVConnectorRole.SCHEDULER:
                log.info("HurrayConnector: kv_load_failure_policy set to recompute")
        # The host memory saves copied out of vLLM's KV may hold while the store writes
        # them (past it the oldest are dropped, counted in saves_dropped): the port's
        # save backlog, one step written at a time, oldest first.
        self.backlog_bytes = int(float(extra.get("save_backlog_mb", 1024)) * (1 << 20))
        self.port = EnginePort(
            extra["config"],
            name=f"hurray-{role.name.lower()}",
            save_backlog_bytes=self.backlog_bytes,
            saves_in_flight=1,
        )
        self.st = self.port.thread  # the segments' way to the store, until they are on the port
        # The page salt of a request with nothing of its own: the connector's salt, else
        # the store config's; a request's cache_salt and adapter are mixed into it.
        base = str(extra.get("salt", "")) or self.st.store.config.salt
        check_salt(base)
        self._cache_hit_source = hit_source(self.st.store.config)
        if self.disabled:
            log.warning("HurrayConnector: serving without the cache: %s", self.disabled)
        kvt = self._kv_transfer_config
        # vLLM publishes KV events (--kv-events-config): the connector reports the blocks
        # it stores and loses among them, keyed by vLLM's block hashes (docs/events.md).
        kve = getattr(vllm_config, "kv_events_config", None)
        self.kv_events = bool(kve is not None and getattr(kve, "enable_kv_cache_events", False))
        if self.kv_events and self.hybrid:
            self.kv_events = False
            log.warning("HurrayConnector: no KV events for a hybrid model's groups")
        # Pages are named by the KV heads they hold: of ranks holding the same heads
        # (more ranks than KV heads) the first saves them; the others save only where
        # vLLM's KV events need every worker to report its blocks.
        self.saves_heads = self.kv_events or first_holder(self.spec, rank, tp)
        self.scheduler = SchedulerSide(
            self.port,
            # The scheduler serves a prefix only when every rank can deliver it: it
            # looks it up under each rank's spec and takes the shortest.
            [r for g in self.groups for r in rank_specs(g.spec, vllm_config, self.disabled)],
            self.block_size,
            # kv_role: kv_both loads and saves; kv_consumer only loads (a read-only
            # instance); kv_producer only saves.
            loads=bool(kvt.is_kv_consumer),
            saves=bool(kvt.is_kv_producer),
            disabled=self.disabled,
            base_salt=base.encode(),
            events=self.kv_events,
            weights=_weights(vllm_config, role, self.disabled),
            windows=[g.window for g in self.groups],
            hybrid=self.hybrid,
        )
        # worker
        self.xfers: list[BlockTransfers] = []  # the data path per KV cache group, once registered
        self._async_loads: list[list[Loading]] = []  # hybrid: loads vLLM waits for
        self._asleep: list[BlockTransfers] = []  # vLLM 0.33's sleep mode: KV released
        self._layer_index: dict[str, int] = {}
        self._loading: Loading | None = None  # this step's loads, while they run
        self._load_errors: set[int] = set()
        self._stats_lock = threading.Lock()

    @property
    def xfer(self) -> BlockTransfers | None:
        """The first KV cache group's data path (a model's only one but a hybrid's), or
        None before the KV is registered, while asleep or when the cache is off."""
        return self.xfers[0] if self.xfers else None

    # ================================================================== scheduler

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a save dropped by a preemption is a future miss."""
        return False

    def on_new_request(self, request: Request) -> None:
        self.scheduler.salt_of(request)

    def may_load_async(self, request: Request) -> bool:
        """vLLM 0.34: never; a hit loads within the step that computes the rest of the
        prompt (``get_num_new_matched_tokens`` returns ``load_kv_async=False``)."""
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """vLLM 0.34: the workers reach the KV cache with torch copies in this process
        only (``IN_PROCESS``): any allocation of it works."""
        from vllm.config.kv_transfer import KVCacheAccess  # 0.34 on; 0.32 never asks

        return KVCacheAccess.IN_PROCESS

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.34: no. Pages are keyed by their own tokens; with EAGLE's block drop a
        block's drafter KV reads tokens past it, which no key here names, so vLLM keeps
        lookahead hashing off while this connector runs."""
        return False

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.update_connector_output(connector_output)

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)`` (a weight update, or
        ``pause_generation(clear_cache=True)``): the KV stored so far is no longer found
        by this instance (docs/vllm.md, "When the weights change"). Nothing is deleted:
        another instance on the old weights may still use it; eviction takes it."""
        self.scheduler.reset_cache()
        return True

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid KV cache manager (``SupportsHMA``): the request's blocks of
        every group are freed at once; saves were copied out in their step."""
        return self.scheduler.request_finished(request, list(block_ids[0]))

    def take_events(self) -> Any:
        """The blocks the workers stored in the store's tiers and the tiers lost, as
        vLLM's events, for vLLM's publisher."""
        return self.scheduler.take_events()

    # ================================================================== worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        layers = sorted(kv_caches.items(), key=lambda kv: extract_layer_index(kv[0]))
        layout = self._layout()
        for g in self.groups if not self.disabled else []:
            mine = [(n, t) for n, t in layers if n in g.layers] if self.hybrid else layers
            xfer = self._transfers(g.spec, mine, layout)
            if isinstance(xfer, str):
                self.disabled = xfer
                break
            self.xfers.append(xfer)
        if self.disabled:
            self.xfers = []
            if not unkeyable(self._vllm_config, self._kv_cache_config):  # not said yet
                log.warning("HurrayConnector: serving without the cache: %s", self.disabled)
            self._dump_counts()
            return
        self._layer_index = {name: i for i, (name, _) in enumerate(layers)}
        log.info(
            "HurrayConnector: %d KV layers in %d group(s) on %s in layout %s; a save "
            "backlog of %d MiB",
            len(layers),
            len(self.xfers),
            layers[0][1].device,
            layout,
            self.backlog_bytes >> 20,
        )

    def _transfers(
        self, spec: KVSpec, layers: list[tuple[str, torch.Tensor]], layout: str
    ) -> BlockTransfers | str:
        """The data path of one KV cache group's views, or why there is none."""
        got = check_views(self._vllm_config, spec, layers, layout)
        if isinstance(got, str):
            return got
        try:  # it checks the layer count and each view's strides against layout
            return BlockTransfers(
                self.port,
                spec,
                [t for _, t in layers],
                layout,
                packing=got,
                counts=self.counts,
                on_written=self._dump_counts,
                events=WorkerEvents(self.port, spec) if self.kv_events else None,
            )
        except (ValueError, LayoutError) as e:
            return str(e)

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
        futures.wait([ld.future for b in self._async_loads for ld in b if ld.future], TIMEOUT_S)
        if not self.xfer.drain(TIMEOUT_S):
            log.warning("HurrayConnector: saves still queued when the KV caches went away")
        self._asleep, self.xfers = self.xfers, []

    def restore_kv_caches(self) -> None:
        """vLLM 0.33, after wake-up: sleep mode maps the KV memory back at the same
        addresses, so the registered views are valid again (their contents are not:
        vLLM recomputes or reloads them). Idempotent."""
        if self._asleep:
            self.xfers, self._asleep = self._asleep, []

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start this step's loads on the store's thread, one retrieve for all of them:
        each layer is written into vLLM's blocks as it arrives, and
        ``wait_for_layer_load`` holds each attention layer until its own KV is there, so
        the first layers compute while the later ones are still read."""
        meta = self._connector_metadata
        loads = meta.loads if isinstance(meta, HurrayMetadata) else []
        if not loads:
            return
        if self.hybrid:
            self._start_async(loads)
            return
        if self.xfer is None:
            for tr in loads:
                self._load_errors.update(self._blocks_of(tr, len(tr.token_ids)))
            return
        self._loading = self.xfer.start_load(loads)

    def _start_async(self, loads: list[Transfer]) -> None:
        """A hybrid model's loads: each group's on the store's thread, while vLLM holds
        their requests back (``get_transfer_results`` says when each is in, or failed)."""
        if not self.xfers:  # asleep: failed at the next report
            self._async_loads.append([Loading(loads, [], [])])
            return
        by_group: list[list[Transfer]] = [[] for _ in self.xfers]
        for tr in loads:
            by_group[tr.group].append(tr)
        self._async_loads.append(
            [self.xfers[g].start_load(trs) for g, trs in enumerate(by_group) if trs]
        )

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """A hybrid model's loads that ended since the last step: a request is in when
        every group delivered its whole hit, else it failed and vLLM computes it from its
        own hit (all groups or none: no group is left half restored)."""
        done: set[str] = set()
        failed: set[str] = set()
        blocks: dict[str, int] = {}  # req -> blocks its groups loaded
        pending = []
        for batch in self._async_loads:
            if not all(ld.future.done() for ld in batch if ld.future is not None):
                pending.append(batch)  # a group still reading (none when asleep: failed)
                continue
            for ld in batch:
                for tr, n in zip(ld.loads, self._delivered(ld), strict=True):
                    done.add(tr.req_id)
                    if n < len(tr.token_ids):
                        failed.add(tr.req_id)
                    got = len(tr.token_ids) // self.block_size - tr.first_block
                    blocks[tr.req_id] = blocks.get(tr.req_id, 0) + got
        for rid, n in blocks.items():
            if rid not in failed:  # a failed request's blocks are computed again
                self.counts["blocks_loaded"] += n
        self._async_loads = pending
        if failed:
            self.counts["load_errors"] += len(failed)
            log.warning("HurrayConnector: %d loads failed; computed instead", len(failed))
        if done:
            self._dump_counts()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def _delivered(self, loading: Loading) -> list[int]:
        """Tokens each of a finished load's requests got (none: it failed)."""
        if loading.future is None:
            return [0] * len(loading.loads)
        try:
            return list(loading.future.result(0))
        except Exception as e:
            log.warning("HurrayConnector: load failed (%s)", e)
            return [0] * len(loading.loads)

    def _finish_load(self) -> None:
        """Wait for this step's loads; report every block they did not fill."""
        loading, self._loading = self._loading, None
        if loading is None or self.xfer is None:
            return
        assert loading.future is not None
        if loading.abandoned:  # a layer came past the bound: lookups miss until it ends
            self.port.bound.went_late(loading.future)
        try:
            got = self.xfer.finish_load(loading, self._load_wait(loading))
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
        loading = self._loading  # None for a hybrid model: its loads are asynchronous
        li = self._layer_index.get(layer_name)
        if loading is None or li is None or self.xfer is None:
            return
        self.counts["layer_waits"] += 1
        if loading.abandoned:
            return
        wait = self._load_wait(loading)
        if not self.xfer.wait_layer(loading, li, wait):
            self.counts["loads_abandoned"] += 1
            log.warning(
                "HurrayConnector: layer %s not loaded in %.2f s; the step's loads are "
                "abandoned and their blocks recomputed",
                layer_name,
                wait,
            )

    def _load_wait(self, loading: Loading) -> float:
        """How long the forward waits for one layer of ``loading``: the engine port's
        bound for what a layer moves (``engine.wait_s`` on a store with a tier that can
        hang; else the connector's long timeout)."""
        if self.port.bound.wait_s is None:
            return TIMEOUT_S
        return self.port.bound.limit(loading.layer_bytes)

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
        if not self.saves_heads:  # another rank holding these heads saves them
            return
        for g, xfer in enumerate(self.xfers):  # one group but for a hybrid model
            if saves := [tr for tr in meta.saves if tr.group == g]:
                xfer.save(saves)

    def get_kv_connector_kv_cache_events(self) -> Any:
        """This worker's events since the last step (None: none)."""
        if self.xfer is None or self.xfer.events is None:
            return None
        events = self.xfer.events.take()
        if not events:
            return None
        from hurray_store.adapters.vllm.kv_events import HurrayKVEvents

        out = HurrayKVEvents(num_workers=1)
        out.add_events(events)
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_load()
        out, self._load_errors = self._load_errors, set()
        return out

    def _dump_counts(self) -> None:
        if not self.stats_file or self._role != KVConnectorRole.WORKER:
            return
        xfer = self.xfer or (self._asleep[0] if self._asleep else None)
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
        if self.xfer is not None and not self.xfer.drain(TIMEOUT_S):
            lost = self.xfer.pending_bytes()
            log.warning("HurrayConnector: %d bytes of saves lost at shutdown", lost)
        self._dump_counts()
        self.port.close()


def _weights(vllm_config: VllmConfig, role: KVConnectorRole, disabled: str) -> Any:
    """The scheduler's ``WeightsIdentity`` of the model folder vLLM serves (None on a
    worker, or when the cache is off): its changes and resets enter the request salts."""
    if role != KVConnectorRole.SCHEDULER or disabled:
        return None
    return WeightsIdentity(None, str(vllm_config.model_config.model), "HurrayConnector")
