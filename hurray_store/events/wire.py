"""vLLM's KV-event wire format (``vllm/distributed/kv_events.py``, 0.32 to 0.34): the
same msgspec structs, field for field, so vLLM's own classes, llm-d's and Dynamo's
decoders read what we send. A message is ``[topic, seq (u64 big-endian),
msgpack(KVEventBatch)]``; a batch is ``[ts, [event, ...]]`` (``data_parallel_rank``
left out), an event a map tagged by its class name."""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
LOCAL = "LOCAL"

# The medium a router scores a tier's hits by (Dynamo weighs a host hit 0.75 and a
# storage hit 0.25 and drops unknown media; llm-d keys its tiers by medium).
_MEDIA = {"gpu": MEDIUM_GPU, "cpu": MEDIUM_CPU}

BlockHash = bytes | int  # vLLM's ExternalBlockHash


def medium_of(tier_kind: str) -> str:
    """``GPU`` and ``CPU`` for the memory tiers, ``STORAGE`` for every other (disk,
    Redis, S3, a cache server)."""
    return _MEDIA.get(tier_kind, MEDIUM_STORAGE)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events; tagged by class name, as vLLM's."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None  # here: the tier's name (a secondary tier's identifier)
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(KVEventBatch)
