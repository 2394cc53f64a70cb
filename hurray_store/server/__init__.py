"""The cache server (``hurray-store serve``): the store shared over the Hurray network
transport, with an HTTP endpoint for metrics and health."""

from hurray_store.server.app import CacheServer, serve, server_store

__all__ = ["CacheServer", "serve", "server_store"]
