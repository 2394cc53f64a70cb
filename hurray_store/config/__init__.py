"""The store's configuration: frozen dataclasses and the one loader.

A config is one YAML file (or a dict of the same shape). ``load_config`` checks every
key against the dataclasses below, converts values, resolves relative paths against the
file's own folder, and applies environment overrides; nothing else in the package reads
the environment. A bad key or value raises ConfigError naming the dotted key.

Environment overrides: ``HURRAY_STORE__<KEY>__<KEY>...=<YAML value>``, for example
``HURRAY_STORE__TIERS__DISK__CAPACITY_BYTES=10737418240`` or
``HURRAY_STORE__POLICY__WRITE_MODE=back``. A list (``tiers``) is indexed by the entry's
``name`` or its position. Values are parsed as YAML scalars, so ``true``, ``42`` and
``null`` mean what they mean in the file.
"""

from hurray_store.config.loader import (
    default_config_dict,
    load_config,
)
from hurray_store.config.schema import (
    ENV_PREFIX,
    EngineConfig,
    EventsConfig,
    PolicyConfig,
    ServerConfig,
    StoreConfig,
    schema,
)
from hurray_store.config.tier_configs import (
    TIERS,
    CpuTierConfig,
    DiskTierConfig,
    GpuTierConfig,
    RedisTierConfig,
    RemoteTierConfig,
    S3TierConfig,
    TierConfig,
    TierKind,
    parse_hurray_url,
    parse_s3_url,
    register_tier,
)

__all__ = [
    "CpuTierConfig",
    "DiskTierConfig",
    "ENV_PREFIX",
    "EngineConfig",
    "EventsConfig",
    "GpuTierConfig",
    "PolicyConfig",
    "RedisTierConfig",
    "RemoteTierConfig",
    "S3TierConfig",
    "ServerConfig",
    "StoreConfig",
    "TIERS",
    "TierConfig",
    "TierKind",
    "register_tier",
    "default_config_dict",
    "load_config",
    "parse_hurray_url",
    "parse_s3_url",
    "schema",
]
