"""Pages of an SGLang host pool that are not paged KV (a Mamba state slot: its temporal
and conv states; no SGLang import): each page one state object (``format/records.py``,
``HSST``): the pool's own bytes of the page (``get_data_page``), then a record naming
the page and checking them. ``adapters/sglang/backend.py`` serves them through SGLang's
v2 calls."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import xxhash

from hurray_store.adapters.sglang.page_io import SET_STEP, _key, save_missing
from hurray_store.engine import EnginePort
from hurray_store.format.records import check_state_object, state_layout, state_object
from hurray_store.store.objects import Data


class StateIO:
    """Reads and writes of one host pool's state pages (``pool``: SGLang's
    ``MambaPoolHost``, or any host pool with ``get_data_page`` /
    ``set_from_flat_data_page``) through the engine port. ``prefix`` is what a page's
    name and fingerprint hash besides its key (the model, the pool's name, geometry and
    rank)."""

    def __init__(
        self,
        port: EnginePort,
        pool: Any,
        prefix: str,
        counts: dict[str, int],
        failed: Callable[[str, BaseException], None],
    ) -> None:
        self.port, self.pool = port, pool
        self.counts, self.failed = counts, failed
        self.page_size = int(getattr(pool, "page_size", 1) or 1)
        self.nbytes = int(pool.get_dummy_flat_data_page().numel())
        self.size = state_layout(self.nbytes)[2]
        self._lock = threading.Lock()
        self.set_prefix(prefix)

    def set_prefix(self, prefix: str) -> None:
        self.prefix = prefix
        self.names = f"sgl-state.{xxhash.xxh3_128_hexdigest(prefix.encode())}."

    def name_of(self, key: str) -> str:
        return self.names + _key(key)

    def fingerprint(self, key: str) -> bytes:
        return hashlib.sha256(f"{self.prefix}\0{key}".encode()).digest()

    def read(self, keys: list[str], slots: list[int]) -> int:
        """Read each key's state object, check it, and set the pool's page ``slots[j]``
        from it: how many, from the first, were read, right and set. A page that is not
        its key's object leaves the store; nothing is written into the pool for it."""
        fps = [self.fingerprint(k) for k in keys]
        d = state_layout(self.nbytes)[0]
        wrong: list[int] = []

        def check(j: int, mv: memoryview) -> str:
            why = check_state_object(mv, fps[j], self.nbytes)
            if why:
                wrong.append(j)
            return why

        def take(j: int, obj: torch.Tensor) -> None:
            self.pool.set_from_flat_data_page(slots[j], obj[d : d + self.nbytes])

        try:
            with self._lock:
                n = self.port.load([self.name_of(k) for k in keys], self.size, check, take)
        except Exception as e:  # noqa: BLE001 - misses, never an error into SGLang
            self.failed("get (states)", e)
            return 0
        self.counts["states_read"] += n
        self.counts["pages_rejected"] += len(wrong)
        return n

    def write(self, keys: list[str], slots: list[int]) -> list[bool]:
        """Store each page ``slots[j]`` of the pool under ``keys[j]`` unless the store
        holds it; returns once written through every tier."""
        names = [self.name_of(k) for k in keys]
        out, written, _ = save_missing(
            self.port,
            names,
            lambda todo: self._steps(todo, keys, names, slots),
            self.failed,
            "set (states)",
        )
        self.counts["states_written"] += written
        return out

    def _steps(
        self, todo: list[int], keys: list[str], names: list[str], slots: list[int]
    ) -> Iterator[list[tuple[str, Data]]]:
        """The state objects of the pages ``todo`` names, ``SET_STEP`` at a time, each
        page copied out of the pool (``get_data_page``) as the port asks for it."""
        for a in range(0, len(todo), SET_STEP):
            step: list[tuple[str, Data]] = []
            for j in todo[a : a + SET_STEP]:
                page = self.pool.get_data_page(slots[j], flat=True)
                data = memoryview(page.contiguous().view(torch.uint8).numpy())
                if data.nbytes != self.nbytes:
                    raise ValueError(f"a state page of {data.nbytes} bytes, not {self.nbytes}")
                step.append((names[j], state_object(data, self.fingerprint(keys[j]))))
            yield step
