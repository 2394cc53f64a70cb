"""Which tier class opens which config kind: each tier module registers its own."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hurray_store.tiers.base import Tier

TIER_TYPES: dict[str, type[Tier]] = {}


def register(cls: type[Tier]) -> type[Tier]:
    """Make ``cls`` the tier for config entries of ``cls.config_cls`` (a decorator)."""
    TIER_TYPES[cls.config_cls.kind] = cls
    return cls
