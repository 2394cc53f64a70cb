"""Per-tier counters, and their prometheus_client view.

The counters below are the one source of truth: ``store.stats()`` reads them, and a
custom collector hands the same numbers to Prometheus on each scrape, so the two can
never disagree. Latency goes to a prometheus Histogram (per tier and operation) and
its count and sum into the stats.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from hurray_store.throttle import Every

log = logging.getLogger(__name__)
WARN_EVERY_S = 10.0  # a warning repeated for many groups is logged at most this often

COUNTERS = (
    ("hits", "objects (or byte ranges of one object) found"),
    ("misses", "objects looked for and not found"),
    ("bytes_read", "bytes read from the tier"),
    ("bytes_written", "bytes written to the tier"),
    ("evictions", "objects evicted by the byte budget"),
    ("verification_failures", "objects that failed a checksum, fingerprint or token check"),
    ("skipped_writes", "writes not made (tier down, disk full, too big)"),
)


# Why a group moved: every move the store makes is counted under one of these (by the
# tier it left, or for promote and flush the tier it was copied into), logged at DEBUG,
# and exported as hurray_store_moves_total / hurray_store_moved_bytes_total.
MOVE_REASONS = {
    "evict": "the tier's byte budget needed the room: its least recently used group left",
    "demote": "evicted, and copied one tier down first (write-back)",
    "budget_lowered": "evicted after the medium filled before its budget (the budget became "
    "what the tier held)",
    "promote": "read whole from a lower tier, and copied into this one",
    "flush": "write-back: copied down into the first persistent tier on flush",
    "quarantine": "failed verification: taken out of service (disk: quarantine/)",
    "lost": "a read found it gone: expired, evicted by the service itself (Redis), deleted "
    "by hand, truncated",
    "other_process": "another process or store on the same medium removed it (the disk "
    "journal, the S3 change log)",
    "quota": "its tenant's quota needed the room (the cache server)",
    "delete": "a caller deleted it",
    "rejected": "an engine read it and its own check found it is not the object its name "
    "says (a page or chunk record that differs): deleted",
}


@dataclass(slots=True)
class TierCounters:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    verification_failures: int = 0
    skipped_writes: int = 0
    op_count: int = 0
    op_seconds: float = 0.0


class StoreMetrics:
    def __init__(
        self, tier_names: list[str], gauges: Callable[[], dict[str, dict[str, float]]]
    ) -> None:
        self.registry = CollectorRegistry()
        self.tiers = {n: TierCounters() for n in tier_names}
        self._gauges = gauges
        self.latency = Histogram(
            "hurray_store_tier_op_seconds",
            "latency of one tier operation",
            ["tier", "op"],
            registry=self.registry,
            buckets=(1e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1, 5),
        )
        self.moves: dict[tuple[str, str], list[int]] = {}  # (reason, tier) -> [groups, bytes]
        # Groups no tier took (every tier down, full or refusing): saves lost, in
        # groups and bytes; and when the last warning about them was logged.
        self.not_stored = [0, 0]
        self._not_stored_warn = Every(WARN_EVERY_S)
        self._not_stored_seen = 0  # groups not stored at the last warning
        self.registry.register(_Collector(self))

    def stored_nowhere(self, group: object, nbytes: int) -> None:
        """No tier took ``group``: counted, and warned about once per ``WARN_EVERY_S``
        (with how many since the last warning), never once per group."""
        self.not_stored[0] += 1
        self.not_stored[1] += nbytes
        if self._not_stored_warn.due():
            seen, self._not_stored_seen = self._not_stored_seen, self.not_stored[0]
            log.warning(
                "group %s (%d bytes) stored in no tier (%d groups so far, %d since the last "
                "warning; stats: not_stored)",
                group,
                nbytes,
                self.not_stored[0],
                self.not_stored[0] - seen,
            )

    def moved(self, reason: str, tier: str, group: object, nbytes: int) -> None:
        """A group left ``tier``, or was copied into it, for ``reason`` (one of
        ``MOVE_REASONS``): the one place every move of the store is recorded."""
        assert reason in MOVE_REASONS, reason
        c = self.moves.setdefault((reason, tier), [0, 0])
        c[0] += 1
        c[1] += nbytes
        log.debug("moved: %s, tier %s, %s, %d bytes", reason, tier, group, nbytes)

    def moves_snapshot(self) -> dict[str, dict[str, dict[str, int]]]:
        """Per reason, per tier: groups and bytes moved so far."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (reason, tier), (n, b) in sorted(self.moves.items()):
            out.setdefault(reason, {})[tier] = {"groups": n, "bytes": b}
        return out

    @contextmanager
    def timed(self, tier: str, op: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.observe(tier, op, time.perf_counter() - t0)

    def observe(self, tier: str, op: str, seconds: float) -> None:
        """Count one operation of ``tier`` that took ``seconds``."""
        c = self.tiers[tier]
        c.op_count += 1
        c.op_seconds += seconds
        self.latency.labels(tier, op).observe(seconds)

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {n: asdict(c) for n, c in self.tiers.items()}


class _Collector(Collector):
    def __init__(self, m: StoreMetrics) -> None:
        self.m = m

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        for name, doc in COUNTERS:
            fam = CounterMetricFamily(f"hurray_store_tier_{name}", doc, labels=["tier"])
            for tier, c in self.m.tiers.items():
                fam.add_metric([tier], getattr(c, name))
            yield fam
        by = ["reason", "tier"]
        moves = CounterMetricFamily("hurray_store_moves", "groups moved, by reason", labels=by)
        moved = CounterMetricFamily(
            "hurray_store_moved_bytes", "bytes of the groups moved, by reason", labels=by
        )
        for (reason, tier), (n, b) in self.m.moves.items():
            moves.add_metric([reason, tier], n)
            moved.add_metric([reason, tier], b)
        yield moves
        yield moved
        yield CounterMetricFamily(
            "hurray_store_not_stored_groups",
            "groups (segments, objects) no tier took: saves lost to an outage or full tiers",
            value=self.m.not_stored[0],
        )
        yield CounterMetricFamily(
            "hurray_store_not_stored_bytes",
            "bytes of the groups no tier took",
            value=self.m.not_stored[1],
        )
        gauges = self.m._gauges()
        for gname in ("objects", "bytes", "capacity_bytes"):
            g = GaugeMetricFamily(
                f"hurray_store_tier_{gname}", f"tier {gname} now", labels=["tier"]
            )
            for tier, vals in gauges.items():
                v = vals.get(gname)
                if v is not None:
                    g.add_metric([tier], float(v))
            yield g


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> int | None:
    """Serve ``registry`` on ``http://host:port/metrics`` from a daemon thread (an
    in-process store's metrics: ``engine.metrics_port``); the port served, or None,
    logged, when it cannot be bound (another rank of the same engine took it)."""
    from prometheus_client import start_http_server

    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        log.warning("metrics: http://%s:%d/metrics not served: %s", host, port, e)
        return None
    log.info("metrics on http://%s:%d/metrics", host, server.server_port)
    return int(server.server_port)


class EngineCollector(Collector):
    """An engine port's counts (``EnginePort.counts`` and its bound's) as Prometheus
    counters ``hurray_store_engine_<count>_total{engine=...}``: what an engine asked
    for, found, loaded and rejected, the hit rate's terms (docs/metrics.md)."""

    DOCS = {
        "lookups": "lookups an engine made",
        "objects_asked": "objects (pages, chunks) an engine's lookups asked about",
        "objects_held": "leading objects its lookups found",
        "tokens_asked": "prompt tokens an engine's prefix lookups asked about (vLLM)",
        "tokens_found": "leading tokens its prefix lookups found stored",
        "loaded": "objects loaded into the engine's memory, checked",
        "rejected": "objects read that failed their check (a miss, deleted)",
        "calls_late": "calls past engine.wait_s (a miss; the store was slow or hung)",
        "missed_while_late": "calls answered as a miss at once while one was late",
    }

    def __init__(self, engine: str, counts: Callable[[], dict[str, float]]) -> None:
        self.engine, self.counts = engine, counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        got = self.counts()
        for name, doc in self.DOCS.items():
            fam = CounterMetricFamily(f"hurray_store_engine_{name}", doc, labels=["engine"])
            fam.add_metric([self.engine], float(got.get(name, 0)))
            yield fam
