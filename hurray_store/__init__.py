"""hurray_store: a KV-cache storage backend whose persisted unit is the Hurray
block-paged descriptor."""

from hurray_store.config import StoreConfig, load_config
from hurray_store.errors import (
    ConfigError,
    FormatError,
    HurrayStoreError,
    PagingError,
    PoolExhaustedError,
    SpecError,
)
from hurray_store.paging import PagedKVPool, Snapshot, restore, snapshot
from hurray_store.spec import KVSpec
from hurray_store.store import PutResult, RetrievedLayer, RetrieveResult, TieredStore, open_store
from hurray_store.store.index import PageLocation, PrefixIndex, PrefixMatch

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "FormatError",
    "HurrayStoreError",
    "KVSpec",
    "PageLocation",
    "PagedKVPool",
    "PagingError",
    "PoolExhaustedError",
    "PrefixIndex",
    "PrefixMatch",
    "PutResult",
    "RetrieveResult",
    "RetrievedLayer",
    "Snapshot",
    "SpecError",
    "StoreConfig",
    "TieredStore",
    "__version__",
    "load_config",
    "open_store",
    "restore",
    "snapshot",
]
