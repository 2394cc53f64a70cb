"""The engine port (``EnginePort``): every engine adapter reaches the store through it
(docs/engine.md)."""

from hurray_store.engine.events import EventFeed, StoreEvent
from hurray_store.engine.port import EnginePort, Held
from hurray_store.engine.saves import Save
from hurray_store.engine.thread import StoreThread

__all__ = ["EnginePort", "EventFeed", "Held", "Save", "StoreEvent", "StoreThread"]
