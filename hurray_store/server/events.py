"""The cache server's KV events (docs/events.md): every tenant's pages, each tenant's
under a topic of its own (``kv@<tenant>@server``, or ``<events.topic>@<tenant>``).
A segment is published as its sequences' page hashes and tokens; an object by its
name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hurray_store.keys import ObjectKey, SegmentKey
from hurray_store.server.tenants import Tenants
from hurray_store.store import TieredStore


def tenant_events(store: TieredStore, tenants: Tenants) -> Any:
    """An ``EventRelay`` over ``store`` when its config asks for events, else None."""
    cfg = store.config.events
    if not cfg.endpoint:
        return None
    from hurray_store.events import Blocks, EventRelay, segment_blocks  # zmq, on demand

    topics = {
        t.namespace: f"{cfg.topic}@{t.name}" if cfg.topic else f"kv@{t.name}@server"
        for t in tenants.all
    }

    def blocks(group: Any) -> Sequence[Blocks] | None:
        topic = topics.get(getattr(group, "namespace", None))  # type: ignore[arg-type]
        if topic is None:
            return ()
        if group.__class__ is ObjectKey:
            return (Blocks(topic, (group.name.encode(),)),)
        if isinstance(group, SegmentKey):
            m = store.groups.cached_manifest(group)
            return None if m is None else segment_blocks(topic, m)
        return ()

    return EventRelay(store, cfg, blocks)
