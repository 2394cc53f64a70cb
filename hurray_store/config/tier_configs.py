"""The built-in tiers' config entries, by the ``type:`` a config names. They live with the
config, not the tier modules: the loader reads every entry without importing a tier's
client library (redis-py, obstore). A tier of another package declares its own
(``Tier.config_cls``, ``type: module:Class``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal
from urllib.parse import urlsplit

from hurray_store.config.fields import documented
from hurray_store.errors import ConfigError

# --------------------------------------------------------------------------- tiers


@dataclass(frozen=True, slots=True)
class GpuTierConfig:
    """Decoded layer objects as tensors on a torch device."""

    kind: ClassVar[str] = "gpu"

    capacity_bytes: int = documented(
        "byte budget of the tier on the device; LRU eviction beyond it"
    )
    name: str = documented("tier name in stats, metrics and env overrides (default: the type)", "")
    device: str = documented(
        "torch device: cuda:0 on a GPU machine; cpu stands in for it without one", "cuda:0"
    )


@dataclass(frozen=True, slots=True)
class CpuTierConfig:
    """Encoded objects in host memory."""

    kind: ClassVar[str] = "cpu"

    capacity_bytes: int = documented(
        "byte budget of the tier in host memory; LRU eviction beyond it"
    )
    name: str = documented("tier name in stats, metrics and env overrides (default: the type)", "")
    pin_memory: Literal["auto", "true", "false"] = documented(
        "page-lock objects for fast device copies: auto pins when CUDA is present", "auto"
    )
    preallocate: bool = documented(
        "fault the whole budget in at open (as LMCache does), so no put pays page faults", False
    )


@dataclass(frozen=True, slots=True)
class DiskTierConfig:
    """One file per object under ``path``, written atomically."""

    kind: ClassVar[str] = "disk"
    # Fields holding a path, resolved against the config file's folder by the loader.
    path_fields: ClassVar[tuple[str, ...]] = ("path",)

    path: str = documented("root folder; relative paths resolve against the config file's folder")
    capacity_bytes: int = documented("byte budget of the files; LRU eviction beyond it")
    name: str = documented("tier name in stats, metrics and env overrides (default: the type)", "")
    fsync: bool = documented(
        "fsync each file (and its folder) before the rename that publishes it", False
    )
    write_threads: int | None = documented(
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

    url: str = documented(
        "redis://[:password@]host:port/db, rediss:// for TLS, or "
        "redis+cluster://host:port,host:port for a cluster"
    )
    name: str = documented("tier name in stats, metrics and env overrides (default: the type)", "")
    cluster: bool = documented("use the cluster client even with a redis:// URL", False)
    key_prefix: str = documented(
        "prefix of every key this tier writes (and SCANs at start)", "hurray:"
    )
    ttl_s: int | None = documented("expire objects after this many seconds; null keeps them", None)
    capacity_bytes: int | None = documented(
        "byte budget with our LRU eviction; null leaves eviction to Redis' maxmemory policy", None
    )
    timeout_s: float = documented(
        "per operation (connect included), plus one second per 50 MB it moves", 2.0
    )
    max_connections: int = documented("connection pool size", 16)
    write_threads: int | None = documented(
        "SETs of 1 MiB or more to a single Redis sent at once, each from a thread of the "
        "tier's own; null: 4 (at most max_connections). Fewer leave more of a small "
        "machine's cores to the engine's thread",
        None,
    )
    pipeline_batch: int = documented(
        "commands per pipeline round trip for batched range reads", 256
    )
    backoff_initial_s: float = documented("first wait before retrying after an outage", 0.5)
    backoff_max_s: float = documented("longest wait between retries during an outage", 30.0)
    tls_ca_file: str = documented(
        "rediss://: the CA certificate(s) (PEM) the server's certificate must chain to; "
        "empty: the system's CAs",
        "",
    )
    tls_cert_file: str = documented(
        "rediss://: this client's certificate (PEM), if the server asks", ""
    )
    tls_key_file: str = documented("rediss://: the private key of tls_cert_file (PEM)", "")
    wait_replicas: int = documented(
        "a group counts as written only once this many replicas acknowledged it (Redis "
        "WAIT after its commit record), so a master failover right after cannot lose a "
        "committed segment; 0: do not wait",
        0,
    )
    wait_timeout_s: float = documented(
        "how long a write waits for wait_replicas; fewer acknowledgements in time: the "
        "group is deleted and the write skipped",
        1.0,
    )


@dataclass(frozen=True, slots=True)
class S3TierConfig:
    """An S3 bucket or an S3-compatible object store (MinIO, SeaweedFS, Ceph RGW, R2)
    through obstore: one object per S3 object, byte-range reads."""

    kind: ClassVar[str] = "s3"

    url: str = documented("s3://bucket/prefix: the bucket, and the key prefix of every object")
    name: str = documented("tier name in stats, metrics and env overrides (default: the type)", "")
    endpoint: str = documented(
        "the service's URL for S3-compatible servers (http://host:port); empty: AWS", ""
    )
    region: str = documented("the bucket's region; empty: AWS_REGION from the environment", "")
    access_key_id: str = documented(
        "credentials; empty: AWS_ACCESS_KEY_ID (and the rest of the usual AWS_* "
        "variables) from the environment",
        "",
    )
    secret_access_key: str = documented(
        "credentials; empty: AWS_SECRET_ACCESS_KEY from the environment; "
        "HURRAY_STORE__TIERS__S3__SECRET_ACCESS_KEY sets it from the environment too",
        "",
    )
    capacity_bytes: int | None = documented(
        "byte budget with our LRU eviction; null: no budget (a bucket lifecycle rule, "
        "if any, deletes objects, and a deleted object is a miss)",
        None,
    )
    timeout_s: float = documented(
        "per request (connect included), plus one second per 50 MB it moves", 5.0
    )
    max_connections: int = documented("requests in flight at once", 32)
    multipart_bytes: int = documented(
        "objects larger than this are uploaded in parts of this size (S3 multipart), "
        "still published atomically when the upload completes",
        8 << 20,
    )
    backoff_initial_s: float = documented("first wait before retrying after an outage", 0.5)
    backoff_max_s: float = documented("longest wait between retries during an outage", 30.0)
    orphan_age_s: float = documented(
        "at open, an uncommitted object (a layer without its manifest) is deleted only "
        "once older than this: a younger one may be another store's upload",
        600.0,
    )
    change_poll_s: float = documented(
        "how often the tier lists the prefix's change log for the commits and deletes of "
        "other stores on it (one LIST); 0: never (this store is alone on the prefix)",
        1.0,
    )
    change_poll_timeout_s: float = documented(
        "a change-log poll's own limit (its LIST, and the cleanup's): one that runs past "
        "it is tried again at the next poll and never marks the tier unreachable",
        30.0,
    )
    change_log_keep_s: float = documented(
        "change log entries older than this are deleted by the store that lists them", 3600.0
    )


@dataclass(frozen=True, slots=True)
class RemoteTierConfig:
    """A hurray_store cache server (``hurray-store serve``), shared by many engines."""

    kind: ClassVar[str] = "remote"

    url: str = documented("hurray://host:port of the cache server")
    name: str = documented("tier name in stats, metrics and env overrides (default: the type)", "")
    token: str = documented(
        "shared secret the server asks for (empty: none); "
        "HURRAY_STORE__TIERS__REMOTE__TOKEN sets it from the environment",
        "",
    )
    connections: int = documented(
        "connection pool size; requests are pipelined on each connection", 4
    )
    timeout_s: float = documented(
        "per request, plus one second per 50 MB it moves; a request past it is a miss", 5.0
    )
    connect_timeout_s: float = documented("to open one connection and finish its HELLO", 2.0)
    max_message_bytes: int = documented(
        "largest message payload this client accepts (announced in its HELLO)", 64 << 20
    )
    backoff_initial_s: float = documented(
        "first wait before reconnecting after the server went away", 0.2
    )
    backoff_max_s: float = documented("longest wait between reconnect attempts", 10.0)


TierConfig = (
    GpuTierConfig
    | CpuTierConfig
    | DiskTierConfig
    | RedisTierConfig
    | RemoteTierConfig
    | S3TierConfig
)


@dataclass(frozen=True, slots=True)
class TierKind:
    """One kind of tier: the class of its config entry and the tier class that opens
    it: ``module:Class`` for a built-in one (imported only when a store opens one, so a
    config names Redis without loading redis-py), else the class itself."""

    config_cls: type
    tier: str | type

    @property
    def built_in(self) -> bool:
        return isinstance(self.tier, str)


# The one registry of tiers, by the ``type:`` a config entry names: the built-in ones,
# and those of other packages once a config names them (``module:Class``) or code
# registers them (``hurray_store.tiers.register``).
TIERS: dict[str, TierKind] = {
    c.kind: TierKind(c, f"hurray_store.tiers.{where}")
    for c, where in (
        (GpuTierConfig, "memory:GpuTier"),
        (CpuTierConfig, "memory:CpuTier"),
        (DiskTierConfig, "disk:DiskTier"),
        (RedisTierConfig, "redis:RedisTier"),
        (RemoteTierConfig, "remote:RemoteTier"),
        (S3TierConfig, "s3:S3Tier"),
    )
}


def register_tier(tier_cls: type) -> str:
    """Put ``tier_cls`` (a tier class with a ``config_cls`` dataclass that has a
    ``kind``) in ``TIERS``; returns its kind. ConfigError for anything else (the tiers
    layer checks it is a ``Tier`` when it opens one)."""
    config_cls = getattr(tier_cls, "config_cls", None)
    kind = getattr(config_cls, "kind", None)
    if (
        not isinstance(tier_cls, type)
        or not isinstance(config_cls, type)
        or not hasattr(config_cls, "__dataclass_fields__")
        or not isinstance(kind, str)
    ):
        raise ConfigError(
            f"{tier_cls!r} is not a tier (a hurray_store.tiers.Tier subclass with a "
            "config_cls dataclass that names its kind)"
        )
    TIERS[kind] = TierKind(config_cls, tier_cls)
    return kind


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
