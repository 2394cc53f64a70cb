"""The plugin's puts: each LMCache chunk laid out (``ChunkLayout.encode``) and saved as
one object through the port (``EnginePort.save``), its record last, so that it is
written whole or not at all; pending until the store has it, then LMCache's buffer is
let go and LMCache told."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from hurray_store.adapters.lmcache.chunks import Chunk, ChunkRegistry
from hurray_store.adapters.lmcache.layout import ChunkLayout
from hurray_store.engine import EnginePort, Save

log = logging.getLogger(__name__)


class ChunkPuts:
    """The puts of one engine's chunks, through the port's save backlog."""

    def __init__(self, port: EnginePort, chunks: ChunkRegistry, layout: ChunkLayout) -> None:
        self.port, self.chunks, self.layout = port, chunks, layout

    def submit(
        self,
        keys: Sequence[Any],
        objs: list[Any],
        on_complete: Callable[[Any], None] | None,
    ) -> None:
        """Put each chunk of ``objs`` under its key of ``keys``, but those the store
        holds or is saving: each laid out here, then handed to the port together, once
        every chunk is laid out (one wake-up of the store's thread for the batch, which
        costs less than the wait for the layout: docs/benchmarks.md, LMCache). What other
        processes on the disk folder removed is read first, so such a chunk is written
        again."""
        with self.chunks.lock:
            chunks = [self.chunks.entry(k) for k in keys]
        held = self.port.held_each([c.name for c in chunks])
        saves: list[Save] = []
        try:
            for key, c, obj, h in zip(keys, chunks, objs, held, strict=True):
                if h or self.port.saving(c.name):
                    continue
                obj.ref_count_up()  # LMCache drops its reference once we return
                try:
                    chunk = self.layout.encode(obj)
                except Exception:
                    obj.ref_count_down()
                    raise
                saves.append(
                    Save(c.name, chunk, chunk.nbytes, self._done(key, c, obj, on_complete))
                )
        finally:
            if saves:
                self.port.save(saves)

    def _done(
        self, key: Any, c: Chunk, obj: Any, on_complete: Callable[[Any], None] | None
    ) -> Callable[[bool], None]:
        """What runs once ``key``'s save ended: LMCache's buffer let go, LMCache told."""

        def done(ok: bool) -> None:
            if ok:
                self.port.refresh(c.ref)  # the next lookup's pin finds the copy at once
            obj.ref_count_down()
            if not ok:
                log.warning("hurray plugin: put of %s failed or was dropped", key)
            elif on_complete is not None:
                try:
                    on_complete(key)
                except Exception as e:  # LMCache's contract: callback errors are logged
                    log.warning("hurray plugin: completion callback for %s raised %s", key, e)

        return done

    def pending(self, key: Any) -> bool:
        return self.port.saving(self.chunks.name(key))

    def wait(self) -> None:
        """Wait for every submitted put, then for the store's writes below its top tier."""
        self.port.flush()
