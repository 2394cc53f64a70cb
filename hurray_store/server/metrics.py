"""The cache server's Prometheus metrics, in the store's registry (one /metrics)."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram


class ServerMetrics:
    def __init__(self, registry: Any) -> None:
        self.connections = Gauge(
            "hurray_store_server_connections", "client connections open now", registry=registry
        )
        self.requests = Counter(
            "hurray_store_server_requests",
            "client requests by message type",
            ["message"],
            registry=registry,
        )
        self.errors = Counter(
            "hurray_store_server_errors",
            "ERROR messages sent, by error code",
            ["code"],
            registry=registry,
        )
        self.bytes_in = Counter(
            "hurray_store_server_received_bytes",
            "object bytes received in TENSOR_PUT data frames",
            registry=registry,
        )
        self.bytes_out = Counter(
            "hurray_store_server_sent_bytes",
            "object bytes sent in TENSOR_DATA frames",
            registry=registry,
        )
        self.latency = Histogram(
            "hurray_store_server_request_seconds",
            "time from a request's last byte in to its answer's last byte out",
            ["message"],
            registry=registry,
            buckets=(1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
        )
        self.inflight = Gauge(
            "hurray_store_server_inflight_put_bytes",
            "bytes of puts being received or staged",
            registry=registry,
        )
        self.staged = Gauge(
            "hurray_store_server_staged_segments",
            "segments whose layer objects await their commit",
            registry=registry,
        )
        self.tenant_bytes = Gauge(
            "hurray_store_server_tenant_bytes",
            "bytes of objects a tenant holds on the server (what its quota counts)",
            ["tenant"],
            registry=registry,
        )
        self.tenant_quota_evictions = Counter(
            "hurray_store_server_tenant_quota_evictions",
            "groups of a tenant deleted to make room under its quota",
            ["tenant"],
            registry=registry,
        )
