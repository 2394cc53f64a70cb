"""hurray_store: a KV-cache storage backend whose persisted unit is the Hurray
block-paged descriptor."""

from hurray_store.errors import FormatError, HurrayStoreError

__version__ = "0.1.0"

__all__ = ["FormatError", "HurrayStoreError", "__version__"]
