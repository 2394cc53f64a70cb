"""KV events for routers: what the store commits and loses, published over ZMQ in vLLM's
wire format (docs/events.md). The only package that imports ``zmq`` and ``msgspec``."""

from hurray_store.events.publisher import ZmqPublisher
from hurray_store.events.relay import Blocks, BlocksOf, EventRelay, default_topic, segment_blocks
from hurray_store.events.wire import (
    DECODER,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    medium_of,
)

__all__ = [
    "DECODER",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Blocks",
    "BlocksOf",
    "EventRelay",
    "KVEventBatch",
    "ZmqPublisher",
    "default_topic",
    "medium_of",
    "segment_blocks",
]
