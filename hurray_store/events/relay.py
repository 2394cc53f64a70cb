"""What a store's ledger says, published as KV events (docs/events.md).

An ``EventRelay`` watches a ``TieredStore`` (``watch``: every group that becomes
readable in a tier or stops being), turns each change into vLLM's ``BlockStored`` or
``BlockRemoved`` for that tier's medium, and every ``interval_ms`` sends what waits as
one batch per topic through a ``ZmqPublisher``. Which groups are published, under which
topic and as which blocks, is the caller's (``blocks``): an engine adapter names its
pages by its engine's keys, the cache server each tenant's pages under its topic.

The watcher runs under the ledger's lock: it only resolves the group's blocks and
appends to a bounded deque (past ``max_events`` the oldest are dropped and counted); a
save never waits for a subscriber, a socket or this thread.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hurray_store.config import EventsConfig
from hurray_store.events.publisher import MAX_TOPIC_BYTES, ZmqPublisher
from hurray_store.events.wire import (
    LOCAL,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    medium_of,
)
from hurray_store.format import Manifest

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Blocks:
    """A group as a router sees it: its blocks' hashes, under ``topic``; for a stored
    event, the tokens they hold (``block_size`` each; empty when the engine's keys do
    not carry them) and the hash of the block before the first (None: none known)."""

    topic: str
    hashes: tuple[BlockHash, ...]
    block_size: int = 0
    token_ids: tuple[int, ...] = ()
    parent: BlockHash | None = None


# What a group is to routers: empty, nothing to publish (another namespace, a member
# list); None, not known yet (a segment whose manifest the catalog takes only after its
# top tier's write): asked again when the batch is sent.
BlocksOf = Callable[[Any], Sequence[Blocks] | None]


def default_topic(cfg: EventsConfig, model: str) -> str:
    """``kv@<instance>@<model>``, the topic llm-d's and Dynamo's subscribers filter on,
    unless the config names one. One longer than a subscription may be is said once:
    a subscriber asking for all of it is cut off (``MAX_TOPIC_BYTES``)."""
    topic = cfg.topic or f"kv@{cfg.instance or socket.gethostname()}@{model}"
    if len(topic.encode()) > MAX_TOPIC_BYTES:
        log.warning(
            "KV events: the topic %r is longer than a subscription may be (%d bytes); "
            "subscribers can filter on its first %d bytes only (set events.topic)",
            topic[:80],
            MAX_TOPIC_BYTES,
            MAX_TOPIC_BYTES,
        )
    return topic


def segment_blocks(topic: str, m: Manifest) -> list[Blocks]:
    """A segment's pages, one ``Blocks`` per sequence it stores pages of."""
    P = m.page_size
    return [
        Blocks(
            topic,
            s.page_hashes,
            P,
            s.token_ids[s.first_page * P : (s.first_page + len(s.page_hashes)) * P],
        )
        for s in m.sequences
        if s.page_hashes
    ]


class EventRelay:
    def __init__(
        self,
        store: Any,  # a TieredStore (its ``watch`` and its tiers' kinds)
        cfg: EventsConfig,
        blocks: BlocksOf,
        *,
        publisher: ZmqPublisher | None = None,
    ) -> None:
        self.cfg = cfg
        self._blocks = blocks
        self._media = {t.name: medium_of(t.kind) for t in store.config.tiers}
        self.publisher = publisher or ZmqPublisher(
            cfg.endpoint, cfg.replay_endpoint, buffer_batches=cfg.buffer_batches
        )
        self._waiting: deque[tuple[str, str, Any, Sequence[Blocks] | None]] = deque()
        self._lock = threading.Lock()
        self.dropped = 0  # events dropped before they were sent
        self.published = 0
        self._stop = threading.Event()
        self._unwatch = store.watch(self._note)
        self._thread = threading.Thread(target=self._run, name="hurray-kv-relay", daemon=True)
        self._thread.start()

    def _resolve(self, group: Any) -> Sequence[Blocks] | None:
        try:
            return self._blocks(group)
        except Exception as e:  # a key it cannot name is not published, never an error
            log.debug("KV events: %r not published: %s", group, e)
            return ()

    def _note(self, kind: str, tier: str, group: Any, reason: str) -> None:
        got = self._resolve(group)
        if got is not None and not got:
            return
        with self._lock:
            if len(self._waiting) >= self.cfg.max_events:
                self._waiting.popleft()
                self.dropped += 1
            self._waiting.append((kind, tier, group, got))

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.interval_ms / 1000):
            self.send()

    def send(self) -> None:
        """Publish what waits now: one batch per topic, events in the order noted."""
        with self._lock:
            noted = list(self._waiting)
            self._waiting.clear()
        if not noted:
            return
        batches: dict[str, list[Any]] = {}
        for kind, tier, group, got in noted:
            for b in got if got is not None else self._resolve(group) or ():
                batches.setdefault(b.topic, []).append(self._event(kind, tier, b))
        now = time.time()
        for topic, events in batches.items():
            self.publisher.publish(topic, KVEventBatch(ts=now, events=events))
            self.published += len(events)

    def _event(self, kind: str, tier: str, b: Blocks) -> BlockStored | BlockRemoved:
        medium = self._media.get(tier)
        if kind == "stored":
            return BlockStored(
                block_hashes=list(b.hashes),
                parent_block_hash=b.parent,
                token_ids=list(b.token_ids),
                block_size=b.block_size,
                lora_id=None,
                medium=medium,
                lora_name=None,
                locality=LOCAL,
                ownership=tier,
            )
        return BlockRemoved(list(b.hashes), medium, locality=LOCAL, ownership=tier)

    def stats(self) -> dict[str, int]:
        return {
            "kv_events_published": self.published,
            "kv_events_dropped": self.dropped + self.publisher.dropped,
            "kv_event_batches_sent": self.publisher.sent,
        }

    def close(self) -> None:
        """Send what waits, then stop."""
        self._unwatch()
        self._stop.set()
        self._thread.join(timeout=5)
        self.send()
        self.publisher.flush()
        self.publisher.close()
