"""The vLLM connector's data path, apart from vLLM (torch and the store only, so it runs
on KV views built without vLLM too): copies of an engine's blocks out of its per-layer
KV views for saving, and retrieved pages into them, on the CPU or on CUDA.

**Saves leave the step at once.** ``save`` copies the step's blocks out of the views
into host buffers and returns; the puts into the store, the write-through and the
commit that makes the blocks visible to other instances run on the store's thread
behind the engine, one step's saves at a time, oldest first.

- On CUDA the blocks are gathered on a side stream that first waits for the engine's
  stream (the step's KV is written), and then copied into pinned host buffers on the
  same side stream. The engine's stream waits (on the device, no host wait) only for
  the gather: its next kernels, which may write a freed block into a new request's KV,
  are ordered after the gather has read it, so vLLM may reuse the blocks at once and
  no block has to be held past ``request_finished``. The store's thread waits for the
  copy's event before it writes the buffers.
- On the CPU the copy out is a memcpy on the engine's thread, done when ``save``
  returns.
- The backlog is the engine port's (``engine/saves.py``), opened with one writer: the
  host buffers of saves not yet written hold at most its ``save_backlog_bytes``. A
  step's room is taken before its blocks are copied out; a step that does not fit
  drops the oldest saves still waiting (the one being written is kept) and, if it
  still does not fit, is dropped itself, copied nowhere; each drop is counted in
  ``saves_dropped``. A save never waits for the store and never grows memory past the
  bound. A dropped save is a future miss, as a failed one is.

**Loads.** ``start_load`` retrieves the step's hits on the store's thread into a host
pool (pinned on CUDA); as each layer arrives its pages are written into the engine's
blocks (on CUDA: copied host-to-device and scattered on the side stream, which first
waits for the engine's stream, then an event per layer); ``wait_layer`` holds the
engine's thread until the layer is on its way and makes the engine's stream wait for
its event.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from hurray_store.adapters.vllm.events import VllmBlock, WorkerEvents
from hurray_store.adapters.vllm.layout import (
    Packing,
    check_view,
    latent_of,
    pages_of,
    write_latent,
    write_pages,
)
from hurray_store.engine import EnginePort, Save
from hurray_store.paging import PagedKVPool
from hurray_store.spec import KVSpec

log = logging.getLogger(__name__)
_INSTANCES = itertools.count()  # one data path per KV cache group: their saves apart


@dataclass(slots=True)
class Transfer:
    """Blocks ``first_block..`` of a request's blocks: to load (pages of
    ``token_ids[:len]`` the store holds) or to save (full prompt pages)."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]  # the request's blocks, from its first
    first_block: int  # the first of them this transfer touches
    salt: bytes  # the request's page salt (``keys.request_salt``), made by the scheduler
    # vLLM's KV events on: a save's blocks first_block.., a load's from 0, as the events
    # name them (else None)
    blocks: list[VllmBlock] | None = None
    group: int = 0  # the KV cache group whose blocks ``block_ids`` are (a hybrid model)


@dataclass(slots=True)
class _Pending:
    """One step's saves, copied out, waiting for the store."""

    saves: list[Transfer]
    buffers: list[torch.Tensor]  # per layer [roles, pages, block_size, heads, head_dim]
    copied: Any  # a CUDA event: the copy into ``buffers`` is done (None: it is)
    nbytes: int
    started: bool = False  # its write began (else a drop ended it)


@dataclass(slots=True)
class Loading:
    """A step's loads in flight on the store's thread."""

    loads: list[Transfer]
    ready: list[threading.Event]  # per layer: its pages are on their way into the blocks
    events: list[Any]  # per layer, on CUDA: the side stream's writes are done (or None)
    future: Future[list[int]] | None = None  # tokens delivered per load
    # Given up on (a layer past the engine's bound): no layer is written into the blocks
    # from then on. A layer's write holds ``lock``, so none is under way once it is set.
    abandoned: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    layer_bytes: int = 0  # the bytes one layer of it moves

    def abandon(self) -> None:
        with self.lock:
            self.abandoned = True


class BlockTransfers:
    """Saves and loads between one engine's per-layer KV views and a store.

    ``views``: one tensor per layer, logically ``[blocks, kv_heads, tokens, C]`` in
    ``layout`` (``vllm/layout.py``), all on one device; ``spec``: the store's KVSpec of
    these pages (``page_size`` is the engine's block size); ``packing``: the CPU
    backend's packing within C; ``counts``: a dict this adds its counts to;
    ``on_written``: called on the store's thread after each step's saves are written.
    """

    def __init__(
        self,
        port: EnginePort,
        spec: KVSpec,
        views: list[torch.Tensor],
        layout: str,
        *,
        packing: Packing | None = None,
        counts: dict[str, Any] | None = None,
        on_written: Callable[[], None] | None = None,
        events: WorkerEvents | None = None,
    ) -> None:
        if len(views) != spec.num_layers:
            raise ValueError(f"{len(views)} KV layer views, the spec has {spec.num_layers} layers")
        for v in views:
            check_view(v, layout)
        self.port, self.st = port, port.thread
        self.spec, self.views, self.layout = spec, views, layout
        self.packing = packing
        self.device = views[0].device
        self.cuda = self.device.type == "cuda"
        self.side = torch.cuda.Stream(self.device) if self.cuda else None
        self.page_bytes = spec.roles * spec.page_size * spec.num_kv_heads * spec.head_dim
        self.page_bytes *= spec.dtype.itemsize * spec.num_layers
        self.counts = counts if counts is not None else {}
        for k in (
            "blocks_saved",
            "blocks_unreachable",  # not saved: an earlier block of theirs was not stored
            "blocks_not_stored",  # not saved: no tier took them (an outage, full tiers)
            "saves_failed",
            "saves_dropped",
            "blocks_loaded",
            "save_steps",
        ):
            self.counts.setdefault(k, 0)
        self.counts.setdefault("copy_out_s", 0.0)  # engine time spent in save()
        self.on_written = on_written
        self.events = events  # vLLM's KV events on: the saved blocks' vLLM keys go here
        # names the steps' saves in the port's backlog (a name per step and per group)
        self._steps = itertools.count()
        self._tag = f"vllm-{next(_INSTANCES)}"

    # ------------------------------------------------------------------ saves

    def save(self, saves: list[Transfer]) -> None:
        """Copy the new blocks of ``saves`` (each: ``block_ids[first_block:len(token_ids)
        // block_size]``; the blocks before were saved by an earlier step or loaded, and
        are not copied again) out of the views and hand their put to the port's save
        backlog (one save a step, written oldest first, one at a time); returns once
        they are copied out (on CUDA: once the copy is ordered), never waiting for the
        store. The room is taken before the copy: a step that does not fit (after the
        oldest waiting steps are dropped) is dropped itself, copied nowhere."""
        bs = self.spec.page_size
        saves = [s for s in saves if len(s.token_ids) // bs > s.first_block]
        if not saves:
            return
        t0 = time.perf_counter()
        ids = [b for s in saves for b in s.block_ids[s.first_block : len(s.token_ids) // bs]]
        nbytes = len(ids) * self.page_bytes
        if not self.port.reserve(nbytes):
            self._dropped(len(saves))
            return
        try:
            buffers, copied = self.copy_out(ids)
        except Exception as e:  # a save that fails is a future miss, never an error
            self.port.unreserve(nbytes)
            self.counts["saves_failed"] += len(saves)
            log.warning("HurrayConnector: copying %d blocks out failed: %s", len(ids), e)
            return
        p = _Pending(saves, buffers, copied, nbytes)
        name = f"{self._tag}-step-{next(self._steps)}"
        save = Save(name, None, nbytes, partial(self._done, p), partial(self._write, p))
        self.port.save([save], reserved=True)
        self.counts["save_steps"] += 1
        self.counts["copy_out_s"] += time.perf_counter() - t0

    def _dropped(self, n_saves: int) -> None:
        self.counts["saves_dropped"] += n_saves
        log.warning("HurrayConnector: the save backlog is full: %d saves dropped", n_saves)

    def _done(self, p: _Pending, ok: bool) -> None:
        """A step's save ended (on the store's thread): written, failed, or dropped
        from the backlog before it was written."""
        if not p.started:
            self._dropped(len(p.saves))
        elif self.on_written is not None:
            self.on_written()

    def copy_out(self, ids: list[int]) -> tuple[list[torch.Tensor], Any]:
        """Blocks ``ids`` of every layer as host buffers, each ``[2, len(ids),
        block_size, heads, head_dim]`` (pinned on CUDA), and the CUDA event that says
        they are filled (None on the CPU: they are)."""
        s = self.spec
        shape = (s.roles, len(ids), s.page_size, s.num_kv_heads, s.head_dim)
        bufs = [torch.empty(shape, dtype=s.dtype, pin_memory=self.cuda) for _ in self.views]
        idx = torch.tensor(ids, dtype=torch.long)
        if not self.cuda:
            for view, buf in zip(self.views, bufs, strict=True):
                self._pages_of(view, idx, out=buf)
            return bufs, None
        assert self.side is not None
        engine = torch.cuda.current_stream(self.device)
        self.side.wait_stream(engine)  # the step's KV is written
        with torch.cuda.stream(self.side):
            pages = [self._pages_of(v, idx) for v in self.views]
            gathered = torch.cuda.Event()
            gathered.record(self.side)
            for roles, buf in zip(pages, bufs, strict=True):
                for r, part in enumerate(roles):
                    buf[r].copy_(part, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.side)
        engine.wait_event(gathered)  # the engine's next writes come after the gather
        return bufs, copied

    def _pages_of(
        self, view: torch.Tensor, idx: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        """Blocks ``idx`` of one layer view as the store's pages, one tensor per role
        (K and V; an MLA latent alone), into ``out`` (``[roles, n, P, H, D]``) when given."""
        s = self.spec
        if s.fused:
            return (
                latent_of(
                    view,
                    self.layout,
                    idx,
                    block_size=s.page_size,
                    out=None if out is None else out[0],
                ),
            )
        kw: dict[str, Any] = {"block_size": s.page_size, "packing": self.packing}
        o = None if out is None else (out[0], out[1])
        return pages_of(view, self.layout, s.head_dim, idx, out=o, **kw)

    async def _write(self, p: _Pending) -> bool:
        """On the store's thread: one step's saves put and flushed (committed: visible
        to every instance's lookup)."""
        p.started = True
        if p.copied is not None:
            while not p.copied.query():  # the device copy is still running
                await asyncio.sleep(2e-4)
        bs = self.spec.page_size
        tables, off = [], 0
        for tr in p.saves:  # the blocks before ``first_block`` are not in the buffers
            n = len(tr.token_ids) // bs - tr.first_block
            tables.append([0] * tr.first_block + list(range(off, off + n)))
            off += n
        if self.events is not None:  # before the commit its events are about
            for tr, t in zip(p.saves, tables, strict=True):
                if tr.blocks:
                    self.events.note_blocks(
                        tr.token_ids[: len(t) * bs], tr.salt, tr.first_block, tr.blocks
                    )
        try:
            pool = PagedKVPool.from_tensors(self.spec, p.buffers)
            toks = [tr.token_ids[: len(t) * bs] for tr, t in zip(p.saves, tables, strict=True)]
            salts = [tr.salt for tr in p.saves]
            starts = [tr.first_block for tr in p.saves]
            r = await self.port.put_pages(pool, toks, tables, salts, starts)  # and committed
            self.counts["blocks_saved"] += r.pages_written
            self.counts["blocks_unreachable"] += r.pages_unreachable
            self.counts["blocks_not_stored"] += r.pages_not_stored
            return True
        except Exception as e:  # a save that fails is a future miss, never an error
            self.counts["saves_failed"] += len(p.saves)
            log.warning("HurrayConnector: saving %d requests failed: %s", len(p.saves), e)
            return False

    def pending_bytes(self) -> int:
        """Host bytes of the saves not yet written (queued and the one being written)."""
        return self.port.saves_pending()[0]

    def queued(self) -> int:
        """Saves waiting for the store's thread (not counting the one being written)."""
        return self.port.saves_pending()[1]

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued save is written (or dropped); False on timeout."""
        return self.port.wait_saves(timeout)

    # ------------------------------------------------------------------ loads

    def start_load(self, loads: list[Transfer]) -> Loading:
        """Start retrieving ``loads`` (one retrieve for all) into the views."""
        ready = [threading.Event() for _ in self.views]
        events: list[Any] = [None] * len(self.views)  # set before the layer's ready
        start = None
        if self.cuda:
            start = torch.cuda.Event()
            start.record(torch.cuda.current_stream(self.device))  # before the blocks' reuse
        if self.events is not None:  # the blocks of what it reads, for its removal events
            for tr in loads:
                if tr.blocks:
                    self.events.note_blocks(tr.token_ids, tr.salt, 0, tr.blocks)
        pages = sum(len(tr.token_ids) // self.spec.page_size - tr.first_block for tr in loads)
        loading = Loading(loads, ready, events, layer_bytes=pages * self.page_bytes // len(ready))
        loading.future = self.st.submit(self._load(loading, start))
        return loading

    def wait_layer(self, loading: Loading, li: int, timeout: float) -> bool:
        """Hold until layer ``li``'s pages are in (on CUDA: ordered before the engine's
        next kernels); False if it did not come in ``timeout`` seconds: the load is
        then abandoned (``Loading.abandon``: no later layer is written) and every one
        of its blocks is to be reported failed."""
        if loading.abandoned:
            return False
        ok = loading.ready[li].wait(timeout)
        if not ok:
            loading.abandon()
        if (ev := loading.events[li]) is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)
        return ok

    def finish_load(self, loading: Loading, timeout: float) -> list[int]:
        """The tokens delivered per load (each from its request's first token); raises
        what the retrieve raised. An abandoned load delivered nothing (not waited for)."""
        assert loading.future is not None
        if loading.abandoned:
            return [tr.first_block * self.spec.page_size for tr in loading.loads]
        try:
            return loading.future.result(timeout)
        finally:
            for ev in loading.events:  # a layer nobody waited for
                if ev is not None:
                    torch.cuda.current_stream(self.device).wait_event(ev)

    def _host_pool(self, pages: int) -> PagedKVPool:
        s = self.spec
        shape = (s.roles, max(pages, 1), s.page_size, s.num_kv_heads, s.head_dim)
        layers = [torch.empty(shape, dtype=s.dtype, pin_memory=self.cuda) for _ in self.views]
        return PagedKVPool.from_tensors(s, layers)

    async def _load(self, loading: Loading, start: Any) -> list[int]:
        loads, ready, events = loading.loads, loading.ready, loading.events
        bs = self.spec.page_size
        got = [tr.first_block * bs for tr in loads]
        layers: Any = None
        try:
            pool = self._host_pool(sum(len(tr.token_ids) // bs for tr in loads))
            seqs = [tr.token_ids for tr in loads]
            skip = [tr.first_block for tr in loads]  # vLLM holds them, or needs none
            layers = self.port.load_pages(pool, seqs, [tr.salt for tr in loads], skip)
            async for layer in layers:
                li = layer.layer_index
                with loading.lock:
                    if loading.abandoned:  # the engine went on without it
                        break
                    self._scatter(pool, li, layer.block_tables, loads, events, start)
                ready[li].set()
                got = layer.num_tokens  # the last layer's counts are the final word
        finally:
            if layers is not None:
                await layers.aclose()
            for e in ready:  # a failed load: the forward goes on, the blocks are reported
                e.set()
        return got

    def _scatter(
        self,
        pool: PagedKVPool,
        li: int,
        tables: list[list[int]],
        loads: list[Transfer],
        events: list[Any],
        start: Any,
    ) -> None:
        src: list[int] = []
        dst: list[int] = []
        for tr, table in zip(loads, tables, strict=True):
            src += table[tr.first_block :]
            dst += tr.block_ids[tr.first_block : len(table)]
        if not src:
            return
        events[li] = self.copy_in(pool.layers[li], li, src, dst, start)

    def copy_in(
        self, pages: torch.Tensor, li: int, src: list[int], dst: list[int], start: Any = None
    ) -> Any:
        """Write pages ``src`` of ``pages`` (one layer of a host pool, ``[2, n,
        block_size, heads, head_dim]``, pinned on CUDA) into blocks ``dst`` of layer
        ``li``'s view. On CUDA the copy runs on the side stream after the engine's event
        ``start`` (None: after the engine's stream now); returns the event that says it
        is done (None on the CPU: it is)."""
        s = self.spec
        if self.cuda and start is None:
            start = torch.cuda.Event()
            start.record(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), self._on_side(start):  # vLLM's KV: inference tensors
            layer = pages.to(self.device, non_blocking=True) if self.cuda else pages
            si = torch.tensor(src, dtype=torch.long, device=layer.device)
            if s.fused:
                latent = layer[0].index_select(0, si)
                write_latent(self.views[li], self.layout, dst, latent, block_size=s.page_size)
            else:
                k, v = layer[0].index_select(0, si), layer[1].index_select(0, si)
                kw: dict[str, Any] = {"block_size": s.page_size, "packing": self.packing}
                write_pages(self.views[li], self.layout, s.head_dim, dst, k, v, **kw)
            if not self.cuda:
                return None
            done = torch.cuda.Event()
            done.record(self.side)
            return done

    @contextlib.contextmanager
    def _on_side(self, start: Any) -> Iterator[None]:
        """On CUDA: this thread's work on the side stream, after the engine's ``start``."""
        if not self.cuda:
            yield
            return
        assert self.side is not None
        with torch.cuda.device(self.device), torch.cuda.stream(self.side):
            self.side.wait_event(start)
            yield
