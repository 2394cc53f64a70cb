"""A worked example of a tier written outside the package (docs/store.md, "Adding a
tier"): objects in a dict of this process. A tier is one class over its config
dataclass; ``register`` makes ``open_tier`` (and so a store) open it for entries of
that config; ``hurray_store.testing.contract.TierContract`` holds it to the contract
(tests/test_example_tier.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from hurray_store.tiers import Blob, Buffer, Range, ReadInto, Tier, register


@dataclass(frozen=True, slots=True)
class DictTierConfig:
    """The config entry: ``kind`` names the tier, ``name`` and ``capacity_bytes`` are
    what every tier has (the store's policy keeps the budget)."""

    kind: ClassVar[str] = "dict"
    name: str = "dict"
    capacity_bytes: int | None = None


@register
class DictTier(Tier):
    config_cls = DictTierConfig  # its ``kind`` becomes the tier's

    def __init__(self, cfg: DictTierConfig, namespace: str | None = None) -> None:
        super().__init__(cfg, namespace)
        self.objects: dict[str, bytes] = {}

    async def get(self, key: str) -> Blob | None:
        data = self.objects.get(key)
        return None if data is None else memoryview(data)

    async def get_ranges(
        self, key: str, ranges: Sequence[Range], into: ReadInto = None
    ) -> list[Blob] | None:
        data = self.objects.get(key)
        if data is None or any(off + n > len(data) for off, n in ranges):
            return None  # absent, or shorter than a range asks: a miss
        view = memoryview(data)
        return [view[off : off + n] for off, n in ranges]

    async def put(self, key: str, buffers: Sequence[Buffer]) -> bool:
        # One assignment of the whole object: a reader sees the old one or the new one.
        self.objects[key] = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
        return True

    async def delete(self, key: str) -> None:
        self.objects.pop(key, None)

    async def contains(self, key: str) -> bool:
        return key in self.objects

    async def sizes(self, keys: Sequence[str]) -> list[int | None]:
        return [len(self.objects[k]) if k in self.objects else None for k in keys]
