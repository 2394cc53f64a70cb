"""The plugin's puts: each LMCache chunk laid out (``ChunkLayout.encode``) and stored as
one object, its record last, so that it is written whole or not at all; pending until
the store has it, then LMCache's buffer is let go and LMCache told."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future
from typing import Any

from hurray_store.adapters.lmcache.chunks import Chunk
from hurray_store.adapters.lmcache.layout import ChunkLayout
from hurray_store.adapters.lmcache.lookups import ChunkLookups
from hurray_store.tiers import SelfChecked

log = logging.getLogger(__name__)


class ChunkPuts:
    """The puts of one engine's chunks, and those still pending."""

    def __init__(self, lookups: ChunkLookups, layout: ChunkLayout) -> None:
        # The store, its thread and the registry are the lookups': a put asks them first.
        self.store, self.runner, self.chunks = lookups.store, lookups.runner, lookups.chunks
        self.layout, self.lookups = layout, lookups
        self._pending: dict[Any, Future[None]] = {}
        self._lock = threading.Lock()

    async def _put(self, c: Chunk, chunk: SelfChecked) -> None:
        if not await self.store.put_object(c.name, chunk, self_checked=True):
            raise OSError("stored in no tier")
        self.store.refresh_ref(c.ref)  # the next lookup's pin finds the copy at once

    def submit(
        self,
        keys: Sequence[Any],
        objs: list[Any],
        on_complete: Callable[[Any], None] | None,
    ) -> None:
        """Put each chunk of ``objs`` under its key of ``keys``, but those the store
        holds or has pending. The puts go to the store's loop together, once every chunk
        is laid out: one wake-up of its thread for the batch, which costs less than the
        wait for the layout (docs/benchmarks.md, LMCache). What other processes on the
        disk folder removed is read first, so such a chunk is written again."""
        self.lookups.sync_others()
        puts: list[tuple[Coroutine[Any, Any, None], Future[None]]] = []
        try:
            with self.chunks.lock:
                chunks = [self.chunks.entry(k) for k in keys]
            for key, c, obj in zip(keys, chunks, objs, strict=True):
                if self.lookups.will_find(c.name) or self.pending(key):
                    continue
                obj.ref_count_up()  # LMCache drops its reference once we return
                try:
                    chunk = self.layout.encode(obj)
                except Exception:
                    obj.ref_count_down()
                    raise
                fut: Future[None] = Future()
                puts.append((self._put(c, chunk), fut))
                self._track(key, obj, fut, on_complete)
        finally:
            if puts:
                self.runner.start_all(puts)

    def _track(
        self,
        key: Any,
        obj: Any,
        fut: Future[None],
        on_complete: Callable[[Any], None] | None,
    ) -> None:
        """``key``'s put is pending until ``fut`` is done; then LMCache's buffer is let
        go and LMCache told."""
        with self._lock:
            self._pending[key] = fut

        def done(f: Future[None]) -> None:
            with self._lock:
                self._pending.pop(key, None)
            obj.ref_count_down()
            if f.exception() is not None:
                log.warning("hurray plugin: put of %s failed: %s", key, f.exception())
            elif on_complete is not None:
                try:
                    on_complete(key)
                except Exception as e:  # LMCache's contract: callback errors are logged
                    log.warning("hurray plugin: completion callback for %s raised %s", key, e)

        fut.add_done_callback(done)

    def pending(self, key: Any) -> bool:
        with self._lock:
            return key in self._pending

    def wait(self) -> None:
        """Wait for every submitted put, then for the store's writes below its top tier."""
        with self._lock:
            futs = list(self._pending.values())
        for f in futs:
            f.result()
        self.runner.call(self.store.flush())
