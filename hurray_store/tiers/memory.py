"""In-process memory tiers: ``cpu`` (encoded objects in host memory) and ``gpu`` (the
same objects as uint8 tensors on a torch device, so a retrieve slices typed views of
the pages and copies them device to device, with no host round trip and no decode).

Neither has a budget of its own: the policy keeps the byte ledger and tells the store
what to evict. Neither is persistent.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hurray_store.buffers import Arena
from hurray_store.config import CpuTierConfig, GpuTierConfig
from hurray_store.tiers.base import Capabilities, Reservation, Tier
from hurray_store.tiers.types import Blob, Buffer, Range, ReadInto


def _ranges_of(obj: Blob, ranges: Sequence[Range]) -> list[Blob] | None:
    n = obj.numel() if isinstance(obj, torch.Tensor) else len(obj)
    if any(off < 0 or ln < 0 or off + ln > n for off, ln in ranges):
        return None
    return [obj[off : off + ln] for off, ln in ranges]


# What host memory an object of the cpu tier costs besides its bytes (rounded up to
# the arena's alignment): its entries in the tier, the ledger and the object level, its
# key's strings. Measured at about 1.2 KiB (tools/bench_attack.py's tiny-object row;
# tests/test_budgets.py checks a 1-byte object costs no more); charged with a margin.
MEMORY_OBJECT_BYTES = 1536


def memory_charge(nbytes: int) -> int:
    """What the cpu tier's budget is charged for an object of ``nbytes``."""
    return -(-max(nbytes, 1) // Arena.ALIGN) * Arena.ALIGN + MEMORY_OBJECT_BYTES


class CpuTier(Tier):
    """Encoded objects in host memory: an arena of ``capacity_bytes`` (reserved, filled
    on first use, reused after eviction), or page-locked tensors when pinned. An object
    that does not fit the arena (fragmentation) lives in an ordinary bytes object."""

    config_cls = CpuTierConfig
    caps = Capabilities(trusted=True)

    def __init__(self, cfg: CpuTierConfig, namespace: str | None = None) -> None:
        super().__init__(cfg, namespace)
        pin = cfg.pin_memory
        self.pinned = torch.cuda.is_available() if pin == "auto" else pin == "true"
        self._arena = None if self.pinned else Arena(cfg.capacity_bytes, populate=cfg.preallocate)
        self._objects: dict[str, tuple[int, int] | Blob] = {}

    def charge(self, nbytes: int) -> int:
        return memory_charge(nbytes)

    def _view(self, key: str) -> Blob | None:
        obj = self._objects.get(key)
        if obj is None:
            return None
        if isinstance(obj, tuple):
            assert self._arena is not None
            off, n = obj
            return self._arena.view[off : off + n]
        return obj if isinstance(obj, torch.Tensor) else memoryview(obj)

    async def get(self, key: str) -> Blob | None:
        v = self._view(key)
        # A copy: arena space is reused once the object is evicted.
        return None if v is None else (v.clone() if isinstance(v, torch.Tensor) else bytes(v))

    async def get_ranges(
        self, key: str, ranges: Sequence[Range], into: ReadInto = None
    ) -> list[Blob] | None:
        """Zero-copy views, valid until the object is deleted or replaced (the store
        pins the groups it reads)."""
        v = self._view(key)
        return None if v is None else _ranges_of(v, ranges)

    async def put(self, key: str, buffers: Sequence[Buffer]) -> bool:
        views = [memoryview(b).cast("B") for b in buffers]
        n = sum(len(v) for v in views)
        if self.pinned:
            t = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            pos = 0
            for v in views:
                if len(v):
                    t[pos : pos + len(v)] = torch.frombuffer(v, dtype=torch.uint8)
                pos += len(v)
            self._set(key, t)
            return True
        assert self._arena is not None
        off = self._arena.alloc(n)
        if off is None:
            self._set(key, b"".join(views))
            return True
        pos = off
        dst = self._arena.view
        for v in views:
            dst[pos : pos + len(v)] = v
            pos += len(v)
        self._set(key, (off, n))
        return True

    def reserve(self, nbytes: int) -> Reservation | None:
        if self._arena is None:
            return None
        off = self._arena.alloc(nbytes)
        if off is None:
            return None
        return Reservation(self, (off, nbytes), self._arena.view[off : off + nbytes])

    async def put_reserved(self, key: str, res: Reservation) -> bool:
        self._set(key, res.token)
        res.committed = True
        return True

    def unreserve(self, res: Reservation) -> None:
        if self._arena is not None and not res.committed:
            self._arena.release(*res.token)
            res.committed = True  # released: never twice

    def _set(self, key: str, obj: tuple[int, int] | Blob) -> None:
        old = self._objects.get(key)
        self._objects[key] = obj
        if isinstance(old, tuple) and self._arena is not None:
            self._arena.release(*old)

    async def delete(self, key: str) -> None:
        old = self._objects.pop(key, None)
        if isinstance(old, tuple) and self._arena is not None:
            self._arena.release(*old)

    async def contains(self, key: str) -> bool:
        return key in self._objects


class GpuTier(Tier):
    config_cls = GpuTierConfig
    caps = Capabilities(on_device=True, trusted=True)

    def __init__(self, cfg: GpuTierConfig, namespace: str | None = None) -> None:
        super().__init__(cfg, namespace)
        self.device = torch.device(cfg.device)
        self._objects: dict[str, torch.Tensor] = {}

    async def get(self, key: str) -> Blob | None:
        obj = self._objects.get(key)
        return None if obj is None else obj.clone()

    async def get_ranges(
        self, key: str, ranges: Sequence[Range], into: ReadInto = None
    ) -> list[Blob] | None:
        obj = self._objects.get(key)
        return None if obj is None else _ranges_of(obj, ranges)

    async def put(self, key: str, buffers: Sequence[Buffer]) -> bool:
        n = sum(memoryview(b).nbytes for b in buffers)
        t = torch.empty(n, dtype=torch.uint8, device=self.device)
        pos = 0
        for b in buffers:
            mv = memoryview(b).cast("B")
            if len(mv):
                t[pos : pos + len(mv)].copy_(
                    torch.frombuffer(mv, dtype=torch.uint8), non_blocking=False
                )
            pos += len(mv)
        self._objects[key] = t
        return True

    async def delete(self, key: str) -> None:
        self._objects.pop(key, None)

    async def contains(self, key: str) -> bool:
        return key in self._objects
