"""The cache server (``hurray-store serve``): the store shared over the Hurray network
transport, with an HTTP endpoint for metrics and health (layer L5)."""

from hurray_store.server.core import CacheServer, serve

__all__ = ["CacheServer", "serve"]
