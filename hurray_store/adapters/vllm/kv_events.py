"""vLLM's container of a connector's KV events (``KVConnectorKVEvents``), for the
connector's worker to hand over and its scheduler to take: it keeps the events every
worker reported (each TP rank reports the same blocks), as vLLM's own connectors do."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_events import KVConnectorKVEvents, KVEventAggregator


class HurrayKVEvents(KVConnectorKVEvents):
    def __init__(self, num_workers: int) -> None:
        self._agg = KVEventAggregator(num_workers)

    def add_events(self, events: list[Any]) -> None:
        self._agg.add_events(events)

    def aggregate(self) -> HurrayKVEvents:
        common = self._agg.get_common_events()
        self._agg.clear_events()
        self._agg.add_events(common)
        self._agg.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._agg.increment_workers(count)

    def get_all_events(self) -> list[Any]:
        return list(self._agg.get_all_events())

    def get_number_of_workers(self) -> int:
        return int(self._agg.get_number_of_workers())

    def clear_events(self) -> None:
        self._agg.clear_events()
        self._agg.reset_workers()
