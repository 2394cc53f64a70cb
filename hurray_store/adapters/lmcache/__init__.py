"""hurray_store behind LMCache 0.5.6 (and 0.5.7rc2): the in-process storage plugin and
the L2 adapter of ``lmcache server`` (this package is the only one that imports
``lmcache``).

- ``plugin.HurrayStoragePlugin``: chunks through the store's object level, per-layer
  block-paged objects plus a checksummed chunk record (the commit point).
- ``l2.HurrayL2Adapter``: objects and their records, one group each.
- ``hurray_store.format.records``: those records, packed and parsed (pure; SGLang's page
  objects end in the chunk record too).
- ``hurray_store.engine.EnginePort``: the one way both reach the store.

See docs/lmcache.md.
"""

from hurray_store.adapters.lmcache.l2 import HurrayL2Adapter, HurrayL2AdapterConfig
from hurray_store.adapters.lmcache.plugin import HurrayStoragePlugin
from hurray_store.engine import EnginePort, StoreThread
from hurray_store.format.records import layout_fingerprint

__all__ = [
    "EnginePort",
    "HurrayL2Adapter",
    "HurrayL2AdapterConfig",
    "HurrayStoragePlugin",
    "StoreThread",
    "layout_fingerprint",
]
