"""hurray_store: a KV-cache storage backend whose persisted unit is the Hurray
block-paged descriptor."""

from hurray_store.errors import (
    FormatError,
    HurrayStoreError,
    PagingError,
    PoolExhaustedError,
    SpecError,
)
from hurray_store.index import PageLocation, PrefixIndex, PrefixMatch
from hurray_store.paging import PagedKVPool, Snapshot, restore, snapshot
from hurray_store.spec import KVSpec

__version__ = "0.1.0"

__all__ = [
    "FormatError",
    "HurrayStoreError",
    "KVSpec",
    "PageLocation",
    "PagedKVPool",
    "PagingError",
    "PoolExhaustedError",
    "PrefixIndex",
    "PrefixMatch",
    "Snapshot",
    "SpecError",
    "__version__",
    "restore",
    "snapshot",
]
