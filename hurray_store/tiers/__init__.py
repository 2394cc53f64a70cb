"""Tiers and their registry: every tier opens from its config entry through ``open_tier``.
Each tier module registers its class by kind (``register``) when it is imported."""

from __future__ import annotations

import importlib

from hurray_store.config import TierConfig
from hurray_store.config.loader import OUTSIDE_TIERS
from hurray_store.errors import ConfigError
from hurray_store.tiers.base import (
    Capabilities,
    GroupObject,
    NowRead,
    Reservation,
    SharedTier,
    StoredObject,
    Tier,
    Unhashed,
)
from hurray_store.tiers.disk import DiskTier
from hurray_store.tiers.helpers import blob_nbytes, host_view, transfer_timeout_s
from hurray_store.tiers.memory import CpuTier, GpuTier
from hurray_store.tiers.registry import TIER_TYPES, register
from hurray_store.tiers.remote import RemoteTier
from hurray_store.tiers.self_checked import SelfChecked, SelfCheckedObject
from hurray_store.tiers.types import Blob, Buffer, Range, RangeIn, ReadInto

# Built-in tiers whose module loads only when a config names them (their client
# libraries are heavy: redis-py, obstore): kind -> module.
LAZY_TIERS = {"redis": "hurray_store.tiers.redis", "s3": "hurray_store.tiers.s3"}


def open_tier(cfg: TierConfig, namespace: str | None = None) -> Tier:
    """The tier for one config entry, for a store of ``namespace`` (not yet opened:
    ``await tier.open()``). A tier module registers itself (``register``) on import."""
    kind = cfg.kind
    if kind not in TIER_TYPES and kind in LAZY_TIERS:
        importlib.import_module(LAZY_TIERS[kind])
    if kind not in TIER_TYPES and kind in OUTSIDE_TIERS:  # named module:Class in a config
        cls = OUTSIDE_TIERS[kind]
        if not issubclass(cls, Tier):
            raise ConfigError(f"{cls.__qualname__} is not a hurray_store.tiers.Tier subclass")
        register(cls)
    return TIER_TYPES[kind](cfg, namespace)


__all__ = [
    "CpuTier",
    "DiskTier",
    "GpuTier",
    "RemoteTier",
    "LAZY_TIERS",
    "TIER_TYPES",
    "Blob",
    "Buffer",
    "Capabilities",
    "GroupObject",
    "NowRead",
    "RangeIn",
    "Range",
    "ReadInto",
    "Reservation",
    "SharedTier",
    "SelfChecked",
    "SelfCheckedObject",
    "StoredObject",
    "Tier",
    "Unhashed",
    "blob_nbytes",
    "host_view",
    "open_tier",
    "register",
    "transfer_timeout_s",
]
