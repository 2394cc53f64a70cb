"""Tiers: every tier opens from its config entry through ``open_tier``, by the one
registry of tier kinds (``config.TIERS``)."""

from __future__ import annotations

import importlib

from hurray_store.config import TIERS, TierConfig, register_tier
from hurray_store.errors import ConfigError
from hurray_store.tiers.base import (
    Capabilities,
    GroupObject,
    HelpsWrites,
    NowRead,
    ReadsNow,
    Reservation,
    Reserves,
    SharedMedium,
    SharedTier,
    StoredObject,
    Tier,
    Unhashed,
    tell_others,
)
from hurray_store.tiers.disk import DiskTier
from hurray_store.tiers.helpers import blob_nbytes, host_view, transfer_timeout_s
from hurray_store.tiers.memory import CpuTier, GpuTier
from hurray_store.tiers.remote import RemoteTier
from hurray_store.tiers.self_checked import SelfChecked, SelfCheckedObject
from hurray_store.tiers.types import Blob, Buffer, Range, RangeIn, ReadInto


def register(cls: type[Tier]) -> type[Tier]:
    """Make ``cls`` the tier for config entries of ``cls.config_cls`` (a class
    decorator, for a tier of another package opened from code)."""
    if not (isinstance(cls, type) and issubclass(cls, Tier)):
        raise ConfigError(f"{cls!r} is not a hurray_store.tiers.Tier subclass")
    register_tier(cls)
    return cls


def tier_class(kind: str) -> type[Tier]:
    """The tier class of a registered kind (a built-in one's module imported now)."""
    entry = TIERS.get(kind)
    if entry is None:
        raise ConfigError(f"no tier of kind {kind!r} is registered")
    cls = entry.tier
    if isinstance(cls, str):
        module, _, name = cls.partition(":")
        cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, Tier)):
        raise ConfigError(f"{cls!r} is not a hurray_store.tiers.Tier subclass")
    return cls


def open_tier(cfg: TierConfig, namespace: str | None = None) -> Tier:
    """The tier for one config entry, for a store of ``namespace`` (not yet opened:
    ``await tier.open()``)."""
    return tier_class(cfg.kind)(cfg, namespace)


__all__ = [
    "CpuTier",
    "DiskTier",
    "GpuTier",
    "RemoteTier",
    "Blob",
    "Buffer",
    "Capabilities",
    "GroupObject",
    "HelpsWrites",
    "NowRead",
    "RangeIn",
    "Range",
    "ReadInto",
    "ReadsNow",
    "Reservation",
    "Reserves",
    "SharedMedium",
    "SharedTier",
    "SelfChecked",
    "SelfCheckedObject",
    "StoredObject",
    "Tier",
    "Unhashed",
    "blob_nbytes",
    "host_view",
    "open_tier",
    "tell_others",
    "register",
    "tier_class",
    "transfer_timeout_s",
]
