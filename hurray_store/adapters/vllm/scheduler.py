"""The scheduler half of ``HurrayConnector`` (vLLM's engine core): which prompt tokens
the store can deliver, which blocks to load, and which newly full prompt blocks to save,
handed to the worker as ``HurrayMetadata`` each step."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from hurray_store.adapters.vllm.events import block_infos
from hurray_store.adapters.vllm.transfer import Transfer
from hurray_store.engine import EnginePort
from hurray_store.engine.identity import WeightsIdentity
from hurray_store.identity import adapter_id
from hurray_store.keys import request_salt
from hurray_store.spec import KVSpec

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
TIMEOUT_S = 120.0
# vLLM's null block: the first block of its pool, never a request's; a sliding-window
# group's table holds it where the blocks before the window were freed.
NULL_BLOCK = 0


@dataclass
class HurrayMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


@dataclass(slots=True)
class _Tracked:
    """A request the scheduler follows until its prompt's full blocks are saved."""

    prompt: list[int]
    block_ids: list[list[int]]  # per KV cache group
    saved: int  # prompt tokens (whole blocks) already handed to the worker to save
    salt: bytes
    request: Any = None  # vLLM's request, while KV events are on (its block hashes)


class SchedulerSide:
    """The scheduler's state: per request its page salt, the tokens it loads, and the
    prompt blocks saved so far. ``disabled``: why the instance serves without the cache
    ("" when it does not)."""

    def __init__(
        self,
        port: EnginePort,
        rank_specs: list[KVSpec],
        block_size: int,
        *,
        loads: bool,
        saves: bool,
        disabled: str,
        base_salt: bytes,
        events: bool = False,
        weights: WeightsIdentity | None = None,
        windows: list[int] | None = None,
        hybrid: bool = False,
    ) -> None:
        self.port, self.rank_specs, self.block_size = port, rank_specs, block_size
        # Per KV cache group its sliding window (0: full attention). A hybrid model's
        # hits load asynchronously, every group or none: vLLM recomputes a request whose
        # load failed from its own hit (``failed_recving``), never from a block.
        self.windows = windows or [0]
        self.hybrid = hybrid
        self._local: dict[str, int] = {}  # req -> vLLM's own hit at its lookup (hybrid)
        # req -> a load to hand the worker, and the request's blocks per group (hybrid)
        self._async: dict[str, tuple[Transfer, list[list[int]]]] = {}
        self._failed: set[str] = set()  # reqs whose load failed: not looked up again
        self.loads, self.saves, self.disabled, self.base_salt = loads, saves, disabled, base_salt
        self._loads: dict[str, int] = {}  # req -> tokens to load (past vLLM's own hit)
        # req -> its page salt, or None: a request the key cannot describe (not cached)
        self._salts: dict[str, bytes | None] = {}
        # req -> prompt tokens the store held at its lookup: its saves start there (the
        # blocks before are stored; vLLM's own hit past them is copied out and saved).
        self._stored: dict[str, int] = {}
        self._refused: set[str] = set()  # the kinds of request refused, each logged once
        self._tracked: dict[str, _Tracked] = {}
        self._unconfirmed: set[str] = set()  # loads planned, their outcome not yet reported
        # vLLM's KV events are on: saves carry their blocks' vLLM keys, and the workers'
        # events (the blocks stored and removed) wait here for ``take_events``.
        self.events = events
        self._requests: dict[str, Request] = {}
        self._kv_events: Any = None
        # The weights' identity, kept up: a change (files replaced, a cache reset after
        # a weight sync) enters every request's salt from then on.
        self.weights = weights
        self._first_weights = self._last_weights = weights.value if weights is not None else ""

    def reset_cache(self) -> None:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``, which a weight update
        (a sync in memory, a reload) and ``pause_generation(clear_cache=True)`` call: no
        request from now on finds or saves KV under the old weights' keys."""
        if self.weights is not None:
            self.weights.reset()
        self._salts.clear()
        self._stored.clear()

    def _weights_salt(self) -> str | None:
        """What the request salt holds of the weights: nothing while they are those
        the instance started with, else their identity now."""
        if self.weights is None:
            return None
        now = self.weights.current()
        if now != self._last_weights:  # the salts made so far were of other weights
            self._last_weights = now
            self._salts.clear()
        return None if now == self._first_weights else now

    def salt_of(self, request: Request) -> bytes | None:
        """The request's page salt, made once per request: everything vLLM's own block
        hash keys by besides the tokens, or None when the key cannot say it (the
        request is then neither looked up nor saved)."""
        rid = request.request_id
        weights = self._weights_salt()
        if rid in self._salts:
            return self._salts[rid]
        if self.events:
            self._requests[rid] = request
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
            parts = [("cache_salt", cache_salt), ("lora", lora), ("weights", weights)]
            salt = request_salt(self.base_salt, parts)
        elif why != "disabled" and why not in self._refused:
            self._refused.add(why)
            log.info("HurrayConnector: requests with %s are not cached", why)
        self._salts[rid] = salt
        return salt

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        toks = list(request.prompt_token_ids or [])
        limit = (len(toks) - 1) // self.block_size * self.block_size  # never the last token
        if not self.loads or limit <= num_computed_tokens:
            return 0, False
        salt = self.salt_of(request)
        if salt is None or request.request_id in self._failed:
            return 0, False
        try:
            # every rank's pages (each stores its own heads): the shortest run
            n = self.port.lookup_tokens(self.rank_specs, toks[:limit], salt)
        except Exception as e:  # the store down or slow: vLLM computes everything
            log.warning("hurray_store lookup failed (%s); computing the prompt", e)
            return 0, False
        self._stored[request.request_id] = n
        if n <= num_computed_tokens:
            return 0, False
        self._local[request.request_id] = num_computed_tokens
        return n - num_computed_tokens, self.hybrid

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        rid = request.request_id
        if not self.hybrid:
            self._loads[rid] = num_external_tokens
            return
        # An asynchronous load of every group's blocks, handed to the worker at the
        # next step; the request computes once it is in (or from its own hit if not).
        local = self._local.pop(rid, 0)
        end = local + num_external_tokens
        salt = self._salts.get(rid)
        if salt is None:
            return
        prompt = list(request.prompt_token_ids or [])[:end]
        groups = [list(b) for b in blocks.get_block_ids()]
        tr = Transfer(rid, prompt, groups[0], local // self.block_size, salt)
        self._async[rid] = (tr, groups)

    def _group_transfers(self, tr: Transfer, groups: list[list[int]]) -> list[Transfer]:
        """``tr`` for each KV cache group, on the group's blocks: in a sliding-window
        group from its first block vLLM holds (the ones before the window are its null
        block, neither loaded nor saved); none where it holds no block of ``tr``."""
        out = []
        end = len(tr.token_ids) // self.block_size
        for g, (blocks, window) in enumerate(zip(groups, self.windows, strict=True)):
            first = tr.first_block
            if window:
                while first < min(end, len(blocks)) and blocks[first] == NULL_BLOCK:
                    first += 1
            if first < end or not window:
                out.append(replace(tr, block_ids=blocks, first_block=first, group=g))
        return out

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = HurrayMetadata()
        so = scheduler_output
        for tr, groups in self._async.values():  # hybrid: loads vLLM waits for
            meta.loads += self._group_transfers(tr, groups)
        self._async.clear()
        for new in so.scheduled_new_reqs:
            salt = self._salts.get(new.req_id)
            if salt is None:  # not cached (or never seen by on_new_request)
                continue
            prompt = list(new.prompt_token_ids or [])
            blocks = [list(b) for b in new.block_ids]
            ext = self._loads.pop(new.req_id, 0)
            request = self._requests.pop(new.req_id, None)
            if ext:
                end = new.num_computed_tokens  # vLLM's own hit plus the store's
                first = (end - ext) // self.block_size
                tr = Transfer(new.req_id, prompt[:end], blocks[0], first, salt)
                if request is not None:  # every block of the segments it reads, from 0
                    tr.blocks = block_infos(request, 0, end // self.block_size, self.block_size)
                meta.loads.append(tr)
                self._unconfirmed.add(new.req_id)
            # Saved from what the store held at the lookup (unknown: from the start;
            # the store then skips what it holds, after the copy).
            held = min(new.num_computed_tokens, self._stored.pop(new.req_id, 0))
            tracked = _Tracked(prompt, blocks, held, salt, request)
            self._tracked[new.req_id] = tracked
            self._save_if_due(meta, new.req_id, tracked, new.num_computed_tokens, so)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self._tracked.get(req_id)
            if t is None:
                continue
            nb = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and nb is not None:
                t.block_ids = [list(b) for b in nb]  # a resumed request's blocks are all new
                t.saved = min(t.saved, cached.num_computed_tokens[i])
            elif nb is not None:
                for mine, more in zip(t.block_ids, nb, strict=True):
                    mine.extend(more)
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
            tr = Transfer(req_id, t.prompt[:full], list(t.block_ids[0]), first, t.salt)
            if t.request is not None:
                tr.blocks = block_infos(t.request, first, full // self.block_size, self.block_size)
            if self.hybrid:
                meta.saves += self._group_transfers(tr, [list(b) for b in t.block_ids])
            else:
                meta.saves.append(tr)
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
        if self.events and (ev := getattr(connector_output, "kv_cache_events", None)):
            if self._kv_events is None:
                self._kv_events = ev
            else:
                self._kv_events.add_events(ev.get_all_events())
                self._kv_events.increment_workers(ev.get_number_of_workers())
        # A hybrid load that failed: vLLM computes the request from its own hit, and
        # the store is not asked for it again.
        self._failed |= getattr(connector_output, "failed_recving", None) or set()
        bad = connector_output.invalid_block_ids or set()
        for req_id in self._unconfirmed:
            t = self._tracked.get(req_id)
            if t is None:
                continue
            lost = [i for i, b in enumerate(t.block_ids[0]) if b in bad]
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
        self._stored.pop(request.request_id, None)
        self._requests.pop(request.request_id, None)
        self._unconfirmed.discard(request.request_id)
        self._local.pop(request.request_id, None)
        self._async.pop(request.request_id, None)
        self._failed.discard(request.request_id)
        return False, None

    def take_events(self) -> list[Any]:
        """The blocks the workers stored and removed since the last call, as vLLM's
        events (those every worker reported)."""
        ev, self._kv_events = self._kv_events, None
        if ev is None:
            return []
        ev.aggregate()
        return ev.get_all_events()
