"""In-process memory tiers: ``cpu`` (encoded objects in host memory) and ``gpu`` (the
same objects as uint8 tensors on a torch device, so a retrieve slices typed views of
the pages and copies them device to device, with no host round trip and no decode).

Neither has a budget of its own: the policy keeps the byte books and tells the store
what to evict. Neither is persistent.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hurray_store.config import CpuTierConfig, GpuTierConfig
from hurray_store.tiers.base import Blob, Buffer, Range, Tier


def _ranges_of(obj: Blob, ranges: Sequence[Range]) -> list[Blob] | None:
    n = obj.numel() if isinstance(obj, torch.Tensor) else len(obj)
    if any(off < 0 or ln < 0 or off + ln > n for off, ln in ranges):
        return None
    return [obj[off : off + ln] for off, ln in ranges]


class CpuTier(Tier):
    kind = "cpu"

    def __init__(self, cfg: CpuTierConfig) -> None:
        super().__init__(cfg)
        pin = cfg.pin_memory
        self.pinned = torch.cuda.is_available() if pin == "auto" else pin == "true"
        self._objects: dict[str, Blob] = {}

    async def get(self, key: str) -> Blob | None:
        obj = self._objects.get(key)
        return None if obj is None else (obj if isinstance(obj, torch.Tensor) else memoryview(obj))

    async def get_ranges(self, key: str, ranges: Sequence[Range]) -> list[Blob] | None:
        obj = self._objects.get(key)
        if obj is None:
            return None
        return _ranges_of(obj if isinstance(obj, torch.Tensor) else memoryview(obj), ranges)

    async def put(self, key: str, buffers: Sequence[Buffer]) -> bool:
        if self.pinned:
            n = sum(memoryview(b).nbytes for b in buffers)
            t = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            pos = 0
            for b in buffers:
                mv = memoryview(b).cast("B")
                t[pos : pos + len(mv)] = torch.frombuffer(mv, dtype=torch.uint8) if len(mv) else t[:0]
                pos += len(mv)
            self._objects[key] = t
        else:
            # One copy into one immutable object; it is the cheapest safe form (the
            # caller's buffers may be reused as soon as put returns).
            self._objects[key] = b"".join(buffers)
        return True

    async def delete(self, key: str) -> None:
        self._objects.pop(key, None)

    async def contains(self, key: str) -> bool:
        return key in self._objects


class GpuTier(Tier):
    kind = "gpu"
    on_device = True

    def __init__(self, cfg: GpuTierConfig) -> None:
        super().__init__(cfg)
        self.device = torch.device(cfg.device)
        self._objects: dict[str, torch.Tensor] = {}

    async def get(self, key: str) -> Blob | None:
        return self._objects.get(key)

    async def get_ranges(self, key: str, ranges: Sequence[Range]) -> list[Blob] | None:
        obj = self._objects.get(key)
        return None if obj is None else _ranges_of(obj, ranges)

    async def put(self, key: str, buffers: Sequence[Buffer]) -> bool:
        n = sum(memoryview(b).nbytes for b in buffers)
        t = torch.empty(n, dtype=torch.uint8, device=self.device)
        pos = 0
        for b in buffers:
            mv = memoryview(b).cast("B")
            if len(mv):
                t[pos : pos + len(mv)].copy_(torch.frombuffer(mv, dtype=torch.uint8), non_blocking=False)
            pos += len(mv)
        self._objects[key] = t
        return True

    async def delete(self, key: str) -> None:
        self._objects.pop(key, None)

    async def contains(self, key: str) -> bool:
        return key in self._objects
