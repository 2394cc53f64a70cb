"""The config schema: frozen dataclasses, every key with its doc string and units."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit

from hurray_store.errors import ConfigError

ENV_PREFIX = "HURRAY_STORE__"


def _doc(text: str, default: Any = MISSING) -> Any:
    if default is MISSING:
        return field(metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


# --------------------------------------------------------------------------- tiers


@dataclass(frozen=True, slots=True)
class GpuTierConfig:
    """Decoded layer objects as tensors on a torch device."""

    kind: ClassVar[str] = "gpu"

    capacity_bytes: int = _doc("byte budget of the tier on the device; LRU eviction beyond it")
    name: str = _doc("tier name in stats, metrics and env overrides (default: the type)", "")
    device: str = _doc(
        "torch device: cuda:0 on a GPU machine; cpu stands in for it without one", "cuda:0"
    )


@dataclass(frozen=True, slots=True)
class CpuTierConfig:
    """Encoded objects in host memory."""

    kind: ClassVar[str] = "cpu"

    capacity_bytes: int = _doc("byte budget of the tier in host memory; LRU eviction beyond it")
    name: str = _doc("tier name in stats, metrics and env overrides (default: the type)", "")
    pin_memory: Literal["auto", "true", "false"] = _doc(
        "page-lock objects for fast device copies: auto pins when CUDA is present", "auto"
    )
    preallocate: bool = _doc(
        "fault the whole budget in at open (as LMCache does), so no put pays page faults", False
    )


@dataclass(frozen=True, slots=True)
class DiskTierConfig:
    """One file per object under ``path``, written atomically."""

    kind: ClassVar[str] = "disk"
    # Fields holding a path, resolved against the config file's folder by the loader.
    path_fields: ClassVar[tuple[str, ...]] = ("path",)

    path: str = _doc("root folder; relative paths resolve against the config file's folder")
    capacity_bytes: int = _doc("byte budget of the files; LRU eviction beyond it")
    name: str = _doc("tier name in stats, metrics and env overrides (default: the type)", "")
    fsync: bool = _doc(
        "fsync each file (and its folder) before the rename that publishes it", False
    )
    write_threads: int | None = _doc(
        "files written at once, each on a thread of the tier's own; null: one fewer than "
        "the machine's cores (at least 1), leaving a core to the engine's thread; with "
        "fsync, CPU count + 4 (those threads mostly wait on the device)",
        None,
    )


@dataclass(frozen=True, slots=True)
class RedisTierConfig:
    """Redis or Redis Cluster through redis-py's asyncio clients."""

    kind: ClassVar[str] = "redis"
    # Files that must exist, resolved against the config file's folder (when set).
    file_fields: ClassVar[tuple[str, ...]] = ("tls_ca_file", "tls_cert_file", "tls_key_file")

    url: str = _doc(
        "redis://[:password@]host:port/db, rediss:// for TLS, or "
        "redis+cluster://host:port,host:port for a cluster"
    )
    name: str = _doc("tier name in stats, metrics and env overrides (default: the type)", "")
    cluster: bool = _doc("use the cluster client even with a redis:// URL", False)
    key_prefix: str = _doc("prefix of every key this tier writes (and SCANs at start)", "hurray:")
    ttl_s: int | None = _doc("expire objects after this many seconds; null keeps them", None)
    capacity_bytes: int | None = _doc(
        "byte budget with our LRU eviction; null leaves eviction to Redis' maxmemory policy", None
    )
    timeout_s: float = _doc(
        "per operation (connect included), plus one second per 50 MB it moves", 2.0
    )
    max_connections: int = _doc("connection pool size", 16)
    write_threads: int | None = _doc(
        "SETs of 1 MiB or more to a single Redis sent at once, each from a thread of the "
        "tier's own; null: 4 (at most max_connections). Fewer leave more of a small "
        "machine's cores to the engine's thread",
        None,
    )
    pipeline_batch: int = _doc("commands per pipeline round trip for batched range reads", 256)
    backoff_initial_s: float = _doc("first wait before retrying after an outage", 0.5)
    backoff_max_s: float = _doc("longest wait between retries during an outage", 30.0)
    tls_ca_file: str = _doc(
        "rediss://: the CA certificate(s) (PEM) the server's certificate must chain to; "
        "empty: the system's CAs",
        "",
    )
    tls_cert_file: str = _doc("rediss://: this client's certificate (PEM), if the server asks", "")
    tls_key_file: str = _doc("rediss://: the private key of tls_cert_file (PEM)", "")
    wait_replicas: int = _doc(
        "a group counts as written only once this many replicas acknowledged it (Redis "
        "WAIT after its commit record), so a master failover right after cannot lose a "
        "committed segment; 0: do not wait",
        0,
    )
    wait_timeout_s: float = _doc(
        "how long a write waits for wait_replicas; fewer acknowledgements in time: the "
        "group is deleted and the write skipped",
        1.0,
    )


@dataclass(frozen=True, slots=True)
class S3TierConfig:
    """An S3 bucket or an S3-compatible object store (MinIO, SeaweedFS, Ceph RGW, R2)
    through obstore: one object per S3 object, byte-range reads."""

    kind: ClassVar[str] = "s3"

    url: str = _doc("s3://bucket/prefix: the bucket, and the key prefix of every object")
    name: str = _doc("tier name in stats, metrics and env overrides (default: the type)", "")
    endpoint: str = _doc(
        "the service's URL for S3-compatible servers (http://host:port); empty: AWS", ""
    )
    region: str = _doc("the bucket's region; empty: AWS_REGION from the environment", "")
    access_key_id: str = _doc(
        "credentials; empty: AWS_ACCESS_KEY_ID (and the rest of the usual AWS_* "
        "variables) from the environment",
        "",
    )
    secret_access_key: str = _doc(
        "credentials; empty: AWS_SECRET_ACCESS_KEY from the environment; "
        "HURRAY_STORE__TIERS__S3__SECRET_ACCESS_KEY sets it from the environment too",
        "",
    )
    capacity_bytes: int | None = _doc(
        "byte budget with our LRU eviction; null: no budget (a bucket lifecycle rule, "
        "if any, deletes objects, and a deleted object is a miss)",
        None,
    )
    timeout_s: float = _doc(
        "per request (connect included), plus one second per 50 MB it moves", 5.0
    )
    max_connections: int = _doc("requests in flight at once", 32)
    multipart_bytes: int = _doc(
        "objects larger than this are uploaded in parts of this size (S3 multipart), "
        "still published atomically when the upload completes",
        8 << 20,
    )
    backoff_initial_s: float = _doc("first wait before retrying after an outage", 0.5)
    backoff_max_s: float = _doc("longest wait between retries during an outage", 30.0)
    orphan_age_s: float = _doc(
        "at open, an uncommitted object (a layer without its manifest) is deleted only "
        "once older than this: a younger one may be another store's upload",
        600.0,
    )
    change_poll_s: float = _doc(
        "how often the tier lists the prefix's change log for the commits and deletes of "
        "other stores on it (one LIST); 0: never (this store is alone on the prefix)",
        1.0,
    )
    change_log_keep_s: float = _doc(
        "change log entries older than this are deleted by the store that lists them", 3600.0
    )


@dataclass(frozen=True, slots=True)
class RemoteTierConfig:
    """A hurray_store cache server (``hurray-store serve``), shared by many engines."""

    kind: ClassVar[str] = "remote"

    url: str = _doc("hurray://host:port of the cache server")
    name: str = _doc("tier name in stats, metrics and env overrides (default: the type)", "")
    token: str = _doc(
        "shared secret the server asks for (empty: none); "
        "HURRAY_STORE__TIERS__REMOTE__TOKEN sets it from the environment",
        "",
    )
    connections: int = _doc("connection pool size; requests are pipelined on each connection", 4)
    timeout_s: float = _doc(
        "per request, plus one second per 50 MB it moves; a request past it is a miss", 5.0
    )
    connect_timeout_s: float = _doc("to open one connection and finish its HELLO", 2.0)
    max_message_bytes: int = _doc(
        "largest message payload this client accepts (announced in its HELLO)", 64 << 20
    )
    backoff_initial_s: float = _doc(
        "first wait before reconnecting after the server went away", 0.2
    )
    backoff_max_s: float = _doc("longest wait between reconnect attempts", 10.0)


TierConfig = (
    GpuTierConfig
    | CpuTierConfig
    | DiskTierConfig
    | RedisTierConfig
    | RemoteTierConfig
    | S3TierConfig
)
# The tier kinds, by the ``type:`` a config entry names; each tier class names its config
# class (``tiers.register``).
TIER_CONFIGS: dict[str, type[TierConfig]] = {
    c.kind: c
    for c in (
        GpuTierConfig,
        CpuTierConfig,
        DiskTierConfig,
        RedisTierConfig,
        RemoteTierConfig,
        S3TierConfig,
    )
}


def parse_hurray_url(url: str) -> tuple[str, int]:
    """``(host, port)`` of a ``hurray://host:port`` URL; ConfigError otherwise."""
    u = urlsplit(url)
    try:
        port = u.port
    except ValueError:
        port = None
    if u.scheme != "hurray" or not u.hostname or port is None:
        raise ConfigError(f"expected hurray://host:port, got {url!r}")
    return u.hostname, port


def parse_s3_url(url: str) -> tuple[str, str]:
    """``(bucket, prefix)`` of an ``s3://bucket[/prefix]`` URL (the prefix without
    slashes at its ends); ConfigError otherwise."""
    u = urlsplit(url)
    if u.scheme != "s3" or not u.netloc:
        raise ConfigError(f"expected s3://bucket/prefix, got {url!r}")
    return u.netloc, u.path.strip("/")


# --------------------------------------------------------------------------- store


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    write_mode: Literal["through", "back"] = _doc(
        "through: every lower tier receives each put asynchronously; back: an object "
        "moves down only when it is evicted (and on flush)",
        "through",
    )
    promote_on_hit: bool = _doc(
        "copy an object read whole from a lower tier into the tiers above it", True
    )
    max_pending_bytes: int = _doc(
        "write-through bytes in flight before put waits for them", 1 << 30
    )


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """One tenant of the cache server: a token, the namespace it reads and writes, and
    its share of the server's tiers."""

    name: str = _doc("the tenant's name in logs, stats and metrics")
    token: str = _doc(
        "the secret its clients send in their HELLO; "
        "HURRAY_STORE__SERVER__TENANTS__<NAME>__TOKEN sets it from the environment"
    )
    namespace: str = _doc(
        "the namespace its keys live in (its clients' store namespace); default: its name", ""
    )
    quota_bytes: int | None = _doc(
        "bytes of objects it may hold on the server; past it, its own least recently used "
        "groups are deleted to make room (null: no quota)",
        None,
    )
    admin: bool = _doc(
        "may also read and delete the keys of every other tenant (named in full, "
        "<namespace>/...) and see every tenant's stats",
        False,
    )


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """``hurray-store serve``: the cache server over this config's tiers (ignored by a
    store opened in-process). Command-line flags override host and ports."""

    host: str = _doc(
        "address to listen on; 127.0.0.1 keeps the server on this machine", "127.0.0.1"
    )
    port: int = _doc("TCP port of the Hurray transport", 9470)
    metrics_host: str = _doc(
        "address of the HTTP endpoint (/metrics, /healthz, /readyz)", "127.0.0.1"
    )
    metrics_port: int | None = _doc(
        "HTTP port for /metrics and the health checks; null: none", 9471
    )
    token: str = _doc(
        "the admin token of the store's own namespace: a client sending it in its HELLO "
        "may touch every tenant's keys (empty and no tenants: no auth, every client is "
        "admin); HURRAY_STORE__SERVER__TOKEN sets it from the environment",
        "",
    )
    tenants: tuple[TenantConfig, ...] = _doc(
        "tenants, each with its own token, namespace and quota; a client is served as the "
        "tenant whose token it sends",
        (),
    )
    max_message_bytes: int = _doc(
        "largest message payload accepted; a larger header gets ERROR and the connection closes",
        64 << 20,
    )
    max_object_bytes: int = _doc("largest object one TENSOR_PUT may announce", 1 << 30)
    max_connections: int = _doc(
        "connections served at once (past their CLIENT_HELLO); one more gets ERROR (busy) "
        "and is closed",
        256,
    )
    max_unauthenticated: int = _doc(
        "connections that have not sent their CLIENT_HELLO yet; one more closes the oldest "
        "of them that has sent no byte (a client sends its hello at once, so a flood of "
        "silent connections pushes out only its own)",
        1024,
    )
    max_requests_per_connection: int = _doc(
        "requests one connection may have in flight; the server reads its next message "
        "once one of them is answered (no connection fills the server's queue)",
        64,
    )
    hello_failures_per_s: float = _doc(
        "CLIENT_HELLOs with a wrong token one peer address may send a second (bursts of 10 "
        "times this); past it, each further failure is answered after 1 s",
        5.0,
    )
    request_timeout_s: float = _doc(
        "to read one message, or one put's data frames, once its header arrived", 30.0
    )
    hello_timeout_s: float = _doc(
        "for a new connection to send its CLIENT_HELLO; until then it holds a 4 KiB buffer",
        5.0,
    )
    max_inflight_put_bytes: int = _doc(
        "bytes of puts being received or staged, counted as they arrive, plus each "
        "object's key and 2 KiB; a frame waits for room (up to half of request_timeout_s), "
        "then its put gets ERROR (busy)",
        1 << 30,
    )
    staging_timeout_s: float = _doc(
        "how long a segment's layer objects wait for their commit before they are dropped", 120.0
    )
    claim_timeout_s: float = _doc(
        "how long pages claimed by one client's put make another client's put wait for them", 30.0
    )
    max_claims_per_connection: int = _doc(
        "pages one connection may hold claimed at once; a claiming lookup past it claims "
        "what fits, leading pages first",
        1 << 16,
    )
    max_claims_per_tenant: int = _doc(
        "pages all of one tenant's connections may hold claimed at once", 1 << 18
    )
    shutdown_timeout_s: float = _doc(
        "on SIGTERM/SIGINT, how long in-flight requests may take before connections are cut", 30.0
    )


@dataclass(frozen=True, slots=True)
class StoreConfig:
    tiers: tuple[TierConfig, ...] = _doc("tiers, fastest first; a put lands in the first")
    namespace: str = _doc(
        "first component of every object key; stores sharing tiers share a namespace", "hurray"
    )
    salt: str = _doc(
        "tenant salt mixed into every page hash: another salt never sees these pages", ""
    )
    quantization: Literal["none", "int8"] = _doc(
        "store pages as int8 with per-slot scales, or as they are", "none"
    )
    max_segment_bytes: int = _doc(
        "largest segment one put writes; bigger batches are split", 256 << 20
    )
    policy: PolicyConfig = _doc("placement, write-through, promotion", PolicyConfig())
    server: ServerConfig = _doc(
        "the cache server (hurray-store serve); unused in-process", ServerConfig()
    )


# --------------------------------------------------------------------------- loading


# Sections of the store config that are dataclasses of their own (env overrides, docs).
SECTIONS: dict[str, type] = {"policy": PolicyConfig, "server": ServerConfig}
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
                for kind, tcls in TIER_CONFIGS.items():
                    walk(tcls, f"tiers[type={kind}]")
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
