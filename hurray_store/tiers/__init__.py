"""Tiers and their registry: every tier opens from its config entry through ``open_tier``."""

from __future__ import annotations

from hurray_store.config import TierConfig
from hurray_store.tiers.base import (
    Blob,
    Buffer,
    Capabilities,
    GroupObject,
    NowRead,
    Range,
    RangeIn,
    ReadInto,
    Reservation,
    Sealed,
    SealedObject,
    SharedTier,
    StoredObject,
    Tier,
    Unhashed,
    blob_nbytes,
    host_view,
    transfer_timeout_s,
)
from hurray_store.tiers.disk import DiskTier
from hurray_store.tiers.memory import CpuTier, GpuTier
from hurray_store.tiers.remote import RemoteTier

TIER_TYPES: dict[str, type[Tier]] = {}


def register(cls: type[Tier]) -> type[Tier]:
    """Make ``cls`` the tier for config entries of ``cls.config_cls``."""
    TIER_TYPES[cls.config_cls.kind] = cls
    return cls


for _cls in (GpuTier, CpuTier, DiskTier, RemoteTier):
    register(_cls)


def open_tier(cfg: TierConfig, namespace: str | None = None) -> Tier:
    """The tier for one config entry, for a store of ``namespace`` (not yet opened:
    ``await tier.open()``)."""
    kind = cfg.kind
    if kind == "redis" and kind not in TIER_TYPES:
        from hurray_store.tiers.redis import RedisTier  # redis-py loads only when used

        register(RedisTier)
    if kind == "s3" and kind not in TIER_TYPES:
        from hurray_store.tiers.s3 import S3Tier  # obstore loads only when used

        register(S3Tier)
    return TIER_TYPES[kind](cfg, namespace)


__all__ = [
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
    "Sealed",
    "SealedObject",
    "StoredObject",
    "Tier",
    "Unhashed",
    "blob_nbytes",
    "host_view",
    "open_tier",
    "register",
    "transfer_timeout_s",
]
