"""The config schema: frozen dataclasses, every key with its doc string and units (the
tiers' entries in ``tier_configs.py``)."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Literal

from hurray_store.config.fields import documented
from hurray_store.config.tier_configs import (
    TIERS,
    TierConfig,
)

ENV_PREFIX = "HURRAY_STORE__"


# --------------------------------------------------------------------------- store


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    write_mode: Literal["through", "back"] = documented(
        "through: every lower tier receives each put asynchronously; back: an object "
        "moves down only when it is evicted (and on flush)",
        "through",
    )
    promote_on_hit: bool = documented(
        "copy an object read whole from a lower tier into the tiers above it", True
    )
    max_pending_bytes: int = documented(
        "write-through bytes in flight before put waits for them", 1 << 30
    )


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """One tenant of the cache server: a token, the namespace it reads and writes, and
    its share of the server's tiers."""

    name: str = documented("the tenant's name in logs, stats and metrics")
    token: str = documented(
        "the secret its clients send in their HELLO; "
        "HURRAY_STORE__SERVER__TENANTS__<NAME>__TOKEN sets it from the environment"
    )
    namespace: str = documented(
        "the namespace its keys live in (its clients' store namespace); default: its name", ""
    )
    quota_bytes: int | None = documented(
        "bytes of objects it may hold on the server; past it, its own least recently used "
        "groups are deleted to make room (null: no quota)",
        None,
    )
    admin: bool = documented(
        "may also read and delete the keys of every other tenant (named in full, "
        "<namespace>/...) and see every tenant's stats",
        False,
    )


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """``hurray-store serve``: the cache server over this config's tiers (ignored by a
    store opened in-process). Command-line flags override host and ports."""

    host: str = documented(
        "address to listen on; 127.0.0.1 keeps the server on this machine", "127.0.0.1"
    )
    port: int = documented("TCP port of the Hurray transport", 9470)
    metrics_host: str = documented(
        "address of the HTTP endpoint (/metrics, /healthz, /readyz)", "127.0.0.1"
    )
    metrics_port: int | None = documented(
        "HTTP port for /metrics and the health checks; null: none", 9471
    )
    token: str = documented(
        "the admin token of the store's own namespace: a client sending it in its HELLO "
        "may touch every tenant's keys (empty and no tenants: no auth, every client is "
        "admin); HURRAY_STORE__SERVER__TOKEN sets it from the environment",
        "",
    )
    tenants: tuple[TenantConfig, ...] = documented(
        "tenants, each with its own token, namespace and quota; a client is served as the "
        "tenant whose token it sends",
        (),
    )
    max_message_bytes: int = documented(
        "largest message payload accepted; a larger header gets ERROR and the connection closes",
        64 << 20,
    )
    max_object_bytes: int = documented("largest object one TENSOR_PUT may announce", 1 << 30)
    max_connections: int = documented(
        "connections served at once (past their CLIENT_HELLO); one more gets ERROR (busy) "
        "and is closed",
        256,
    )
    max_unauthenticated: int = documented(
        "connections that have not sent their CLIENT_HELLO yet; one more closes the oldest "
        "of them that has sent no byte (a client sends its hello at once, so a flood of "
        "silent connections pushes out only its own)",
        1024,
    )
    max_requests_per_connection: int = documented(
        "requests one connection may have in flight; the server reads its next message "
        "once one of them is answered (no connection fills the server's queue)",
        64,
    )
    hello_failures_per_s: float = documented(
        "CLIENT_HELLOs with a wrong token one peer address may send a second (bursts of 10 "
        "times this); past it, each further failure is answered after 1 s",
        5.0,
    )
    request_timeout_s: float = documented(
        "to read one message, or one put's data frames, once its header arrived", 30.0
    )
    hello_timeout_s: float = documented(
        "for a new connection to send its CLIENT_HELLO; until then it holds a 4 KiB buffer",
        5.0,
    )
    max_inflight_put_bytes: int = documented(
        "bytes of puts being received or staged, counted as they arrive, plus each "
        "object's key and 2 KiB; a frame waits for room (up to half of request_timeout_s), "
        "then its put gets ERROR (busy)",
        1 << 30,
    )
    max_inflight_message_bytes: int = documented(
        "bytes of the other messages (requests, PINGs) of 64 KiB or more being received "
        "or answered, all connections together; one waits for room (up to "
        "request_timeout_s), then gets ERROR (busy) and its payload is skipped",
        256 << 20,
    )
    max_inflight_message_bytes_per_tenant: int = documented(
        "the same, for all of one tenant's connections together", 128 << 20
    )
    staging_timeout_s: float = documented(
        "how long a segment's layer objects wait for their commit before they are dropped", 120.0
    )
    claim_timeout_s: float = documented(
        "how long pages claimed by one client's put make another client's put wait for them", 30.0
    )
    max_claims_per_connection: int = documented(
        "pages one connection may hold claimed at once; a claiming lookup past it claims "
        "what fits, leading pages first",
        1 << 16,
    )
    max_claims_per_tenant: int = documented(
        "pages all of one tenant's connections may hold claimed at once", 1 << 18
    )
    shutdown_timeout_s: float = documented(
        "on SIGTERM/SIGINT, how long in-flight requests may take before connections are cut", 30.0
    )


@dataclass(frozen=True, slots=True)
class EventsConfig:
    """KV events for routers (docs/events.md): every page the store commits or loses,
    published in vLLM's wire format over ZMQ. Off unless ``endpoint`` is set; the vLLM
    connector ignores it (vLLM's own ``--kv-events-config`` publishes its events)."""

    endpoint: str = documented(
        "ZMQ PUB endpoint to bind (tcp://127.0.0.1:5557, ipc://...); empty: publish nothing",
        "",
    )
    replay_endpoint: str = documented(
        "ZMQ ROUTER endpoint to bind for replays of missed batches; empty: none", ""
    )
    topic: str = documented(
        "topic of every message; empty: kv@<instance>@<model> (the cache server: "
        "kv@<tenant>@server, one topic per tenant)",
        "",
    )
    instance: str = documented("this instance's name in the topic; empty: the host name", "")
    buffer_batches: int = documented(
        "batches kept for replay; a subscriber asks for those from a sequence number", 10_000
    )
    max_events: int = documented(
        "events waiting to be published at most; past it the oldest are dropped and "
        "counted (a stalled publisher never holds up a save)",
        65_536,
    )
    interval_ms: int = documented("how often waiting events are sent, one batch a topic", 100)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How an engine (vLLM, SGLang, LMCache through the engine port) meets a store
    whose tiers can be down or hang (Redis, S3, a cache server): docs/engine.md."""

    wait_s: float = documented(
        "the longest an engine's lookup, or a layer of its load, waits on a store with a "
        "tier behind a network service; past it the lookup is a miss (the engine "
        "computes), the load's blocks are reported failed, and until the late call ends "
        "every lookup is a miss at once. Stores of only cpu and disk tiers do not apply it",
        0.25,
    )
    metrics_port: int | None = documented(
        "an HTTP port for /metrics of an in-process store (the vLLM connector, the SGLang "
        "backend, the LMCache plugin and L2 adapter): its tiers' and the engine's counts "
        "(docs/metrics.md); 0 picks a free one; null: none",
        None,
    )
    metrics_host: str = documented("the address the metrics port listens on", "127.0.0.1")
    lease_s: float = documented(
        "what an engine's existence check counted (SGLang's batch_exists) stays pinned, "
        "safe from eviction, until its get or this long, whichever comes first",
        10.0,
    )
    page_sizes: tuple[int, ...] = documented(
        "other page sizes an engine's lookup and load also read, where its own layout "
        "falls short: each that divides the engine's page size or that it divides "
        "(docs/store.md, 'Portable pages'); [] reads the engine's own page size only",
        (16, 32, 64, 128),
    )


@dataclass(frozen=True, slots=True)
class StoreConfig:
    tiers: tuple[TierConfig, ...] = documented("tiers, fastest first; a put lands in the first")
    namespace: str = documented(
        "first component of every object key; stores sharing tiers share a namespace", "hurray"
    )
    salt: str = documented(
        "tenant salt mixed into every page hash: another salt never sees these pages", ""
    )
    quantization: Literal["none", "int8"] = documented(
        "store pages as int8 with per-slot scales, or as they are", "none"
    )
    max_segment_bytes: int = documented(
        "largest segment one put writes; bigger batches are split", 256 << 20
    )
    policy: PolicyConfig = documented("placement, write-through, promotion", PolicyConfig())
    server: ServerConfig = documented(
        "the cache server (hurray-store serve); unused in-process", ServerConfig()
    )
    events: EventsConfig = documented(
        "KV events for routers (ZMQ, vLLM's wire format); off by default", EventsConfig()
    )
    engine: EngineConfig = documented(
        "how long an engine waits on a tier that can hang", EngineConfig()
    )


# --------------------------------------------------------------------------- loading


# Sections of the store config that are dataclasses of their own (env overrides, docs).
SECTIONS: dict[str, type] = {
    "policy": PolicyConfig,
    "server": ServerConfig,
    "events": EventsConfig,
    "engine": EngineConfig,
}
# Keys holding a list of dataclass entries (documented as ``key[]``).
LISTS: dict[str, type] = {"tenants": TenantConfig}


def join_key(where: str, name: str) -> str:
    """The dotted key of ``name`` under ``where``."""
    return f"{where}.{name}" if where else name


def schema() -> list[tuple[str, str, str]]:
    """(dotted key, default, doc) of every key, for docs and the docs test."""
    rows: list[tuple[str, str, str]] = []

    def walk(cls: type, prefix: str) -> None:
        for f in fields(cls):
            key = join_key(prefix, f.name)
            if f.name == "tiers":
                rows.append((key, "(required)", f.metadata["doc"]))
                for kind, entry in TIERS.items():
                    if entry.built_in:
                        walk(entry.config_cls, f"tiers[type={kind}]")
            elif f.name in SECTIONS:
                walk(SECTIONS[f.name], key)
            elif f.name in LISTS:
                rows.append((key, repr(f.default), f.metadata["doc"]))
                walk(LISTS[f.name], f"{key}[]")
            else:
                d = "(required)" if f.default is MISSING else repr(f.default)
                rows.append((key, d, f.metadata["doc"]))

    walk(StoreConfig, "")
    return rows
