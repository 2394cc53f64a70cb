"""The store's configuration: frozen dataclasses and the one loader.

A config is one YAML file (or a dict of the same shape). ``load_config`` checks every
key against the dataclasses below, converts values, resolves relative paths against the
file's own folder, and applies environment overrides; nothing else in the package reads
the environment. A bad key or value raises ConfigError naming the dotted key.

Environment overrides: ``HURRAY_STORE__<KEY>__<KEY>...=<YAML value>``, for example
``HURRAY_STORE__TIERS__DISK__CAPACITY_BYTES=10737418240`` or
``HURRAY_STORE__POLICY__WRITE_MODE=back``. A list (``tiers``) is indexed by the entry's
``name`` or its position. Values are parsed as YAML scalars, so ``true``, ``42`` and
``null`` mean what they mean in the file.
"""

from __future__ import annotations

import os
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit

import yaml

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

    path: str = _doc("root folder; relative paths resolve against the config file's folder")
    capacity_bytes: int = _doc("byte budget of the files; LRU eviction beyond it")
    name: str = _doc("tier name in stats, metrics and env overrides (default: the type)", "")
    fsync: bool = _doc(
        "fsync each file (and its folder) before the rename that publishes it", False
    )


@dataclass(frozen=True, slots=True)
class RedisTierConfig:
    """Redis or Redis Cluster through redis-py's asyncio clients."""

    kind: ClassVar[str] = "redis"

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
    timeout_s: float = _doc("socket connect and read timeout per operation", 2.0)
    max_connections: int = _doc("connection pool size", 16)
    pipeline_batch: int = _doc("commands per pipeline round trip for batched range reads", 256)
    backoff_initial_s: float = _doc("first wait before retrying after an outage", 0.5)
    backoff_max_s: float = _doc("longest wait between retries during an outage", 30.0)


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


TierConfig = GpuTierConfig | CpuTierConfig | DiskTierConfig | RedisTierConfig | RemoteTierConfig
# The tier kinds, by the ``type:`` a config entry names; each tier class names its config
# class (``tiers.register``).
TIER_CONFIGS: dict[str, type[TierConfig]] = {
    c.kind: c
    for c in (GpuTierConfig, CpuTierConfig, DiskTierConfig, RedisTierConfig, RemoteTierConfig)
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
        "shared secret every client must send in its HELLO (empty: no auth); "
        "HURRAY_STORE__SERVER__TOKEN sets it from the environment",
        "",
    )
    max_message_bytes: int = _doc(
        "largest message payload accepted; a larger header gets ERROR and the connection closes",
        64 << 20,
    )
    max_object_bytes: int = _doc("largest object one TENSOR_PUT may announce", 1 << 30)
    max_connections: int = _doc(
        "connections served at once; one more gets ERROR (busy) and is closed", 256
    )
    request_timeout_s: float = _doc(
        "to read one message, or one put's data frames, once its header arrived", 30.0
    )
    hello_timeout_s: float = _doc("for a new connection to send its CLIENT_HELLO", 5.0)
    max_inflight_put_bytes: int = _doc(
        "bytes of puts being received or staged; a put waits for room (up to "
        "request_timeout_s), then gets ERROR (busy)",
        1 << 30,
    )
    staging_timeout_s: float = _doc(
        "how long a segment's layer objects wait for their commit before they are dropped", 120.0
    )
    claim_timeout_s: float = _doc(
        "how long pages claimed by one client's put make another client's put wait for them", 30.0
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


def default_config_dict() -> dict[str, Any]:
    """The embedded default: CPU memory and a disk tier under ./.hurray-cache."""
    return {
        "tiers": [
            {"type": "cpu", "capacity_bytes": 4 << 30},
            {"type": "disk", "path": ".hurray-cache", "capacity_bytes": 64 << 30, "fsync": False},
        ]
    }


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any] | StoreConfig | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> StoreConfig:
    """Load a StoreConfig from a YAML path, a dict, or None (the embedded default).

    Relative paths resolve against the file's folder (the current folder for a dict).
    ``env`` defaults to ``os.environ``; pass ``{}`` to ignore the environment.
    """
    if isinstance(source, StoreConfig):
        return source
    base = Path.cwd()
    if source is None:
        raw: Any = default_config_dict()
    elif isinstance(source, Mapping):
        raw = _plain(source)
    else:
        p = Path(source)
        try:
            text = p.read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config file {p}: {e.strerror or e}") from e
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from e
        if raw is None:
            raw = {}
        base = p.resolve().parent
    if not isinstance(raw, dict):
        raise ConfigError(f"a config is a mapping of keys, got {type(raw).__name__}")
    _apply_env(raw, os.environ if env is None else env)
    cfg = _build(StoreConfig, raw, "")
    _check_server(cfg.server)
    return _resolve_paths(cfg, base)


def _check_server(s: ServerConfig) -> None:
    for key in ("port", "metrics_port"):
        v = getattr(s, key)
        if v is not None and v > 65535:
            raise ConfigError(f"server.{key}: expected a TCP port (0-65535), got {v}")
    if not (64 << 10) <= s.max_message_bytes <= 0xFFFFFFFF:
        raise ConfigError(
            "server.max_message_bytes: expected 65536 to 4294967295 (a u32 payload "
            f"length), got {s.max_message_bytes}"
        )
    for key in ("max_object_bytes", "max_connections", "max_inflight_put_bytes"):
        if getattr(s, key) < 1:
            raise ConfigError(f"server.{key}: expected a positive number, got {getattr(s, key)}")
    if s.max_object_bytes > s.max_inflight_put_bytes:
        raise ConfigError(
            f"server.max_object_bytes: {s.max_object_bytes} exceeds server.max_inflight_put_bytes "
            f"({s.max_inflight_put_bytes}): such an object could never be received"
        )


def _plain(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    return x


def _apply_env(raw: dict[str, Any], env: Mapping[str, str]) -> None:
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX):
            continue
        parts = [p.lower() for p in var[len(ENV_PREFIX) :].split("__")]
        where = "environment " + var
        if not all(parts):
            raise ConfigError(f"{where}: empty key component")
        try:
            value = yaml.safe_load(env[var])
        except yaml.YAMLError as e:
            raise ConfigError(f"{where}: not a YAML value: {e}") from e
        node: Any = raw
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(node, list):
                idx = _list_index(node, part)
                if idx is None:
                    raise ConfigError(
                        f"{where}: no entry {part!r} in {'.'.join(parts[:i]) or 'the config'}"
                    )
                if last:
                    node[idx] = value
                else:
                    node = node[idx]
            elif isinstance(node, dict):
                if last:
                    node[part] = value
                else:
                    node = node.setdefault(part, {})
            else:
                raise ConfigError(f"{where}: {'.'.join(parts[:i])} is not a mapping")


def _list_index(items: list[Any], part: str) -> int | None:
    for i, item in enumerate(items):
        if isinstance(item, dict) and str(item.get("name") or item.get("type")).lower() == part:
            return i
    if part.isdigit() and int(part) < len(items):
        return int(part)
    return None


def _build(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    for k in raw:
        if k not in known:
            raise ConfigError(
                f"{_join(where, str(k))}: unknown key (expected one of {sorted(known)})"
            )
    kwargs: dict[str, Any] = {}
    for name, f in known.items():
        key = _join(where, name)
        if name not in raw:
            if f.default is MISSING:
                raise ConfigError(f"{key}: required key is missing")
            continue
        if name == "tiers":
            kwargs[name] = _tiers(raw[name], key)
        else:
            kwargs[name] = _convert(hints[name], raw[name], key)
    return cls(**kwargs)


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _tiers(raw: Any, where: str) -> tuple[TierConfig, ...]:
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{where}: expected a non-empty list of tiers")
    out: list[TierConfig] = []
    names: set[str] = set()
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ConfigError(f"{where}.{i}: expected a mapping with a type")
        kind = item.get("type")
        label = f"{where}.{item.get('name') or kind or i}"
        if kind not in TIER_CONFIGS:
            raise ConfigError(f"{label}.type: expected one of {sorted(TIER_CONFIGS)}, got {kind!r}")
        body = {k: v for k, v in item.items() if k != "type"}
        cfg = _build(TIER_CONFIGS[kind], body, label)
        if not cfg.name:
            cfg = _replace(cfg, name=kind)
        if cfg.name in names:
            raise ConfigError(
                f"{label}.name: two tiers are named {cfg.name!r}; give each a distinct name"
            )
        names.add(cfg.name)
        if isinstance(cfg, RemoteTierConfig):
            try:
                parse_hurray_url(cfg.url)
            except ConfigError as e:
                raise ConfigError(f"{label}.url: {e}") from None
        cap = getattr(cfg, "capacity_bytes", None)
        if cap is not None and cap < 1:
            raise ConfigError(
                f"{label}.capacity_bytes: expected a positive number of bytes, got {cap}"
            )
        out.append(cfg)
    return tuple(out)


def _replace(cfg: Any, **changes: Any) -> Any:
    values = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    values.update(changes)
    return type(cfg)(**values)


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, where)
    if origin is Literal:
        allowed = typing.get_args(tp)
        v = str(value).lower() if isinstance(value, bool) else value
        if v not in allowed:
            raise ConfigError(f"{where}: expected one of {list(allowed)}, got {value!r}")
        return v
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if value < 0:
            raise ConfigError(f"{where}: expected a non-negative integer, got {value}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ConfigError(f"{where}: expected a non-negative number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if isinstance(tp, type) and hasattr(tp, "__dataclass_fields__"):
        return _build(tp, value, where)
    raise ConfigError(f"{where}: unsupported type {tp}")  # pragma: no cover - schema bug


def _resolve_paths(cfg: StoreConfig, base: Path) -> StoreConfig:
    tiers = tuple(
        _replace(t, path=str((base / t.path).resolve())) if isinstance(t, DiskTierConfig) else t
        for t in cfg.tiers
    )
    return _replace(cfg, tiers=tiers)


_SECTIONS: dict[str, type] = {"policy": PolicyConfig, "server": ServerConfig}


def schema() -> list[tuple[str, str, str]]:
    """(dotted key, default, doc) of every key, for docs and the docs test."""
    rows: list[tuple[str, str, str]] = []

    def walk(cls: type, prefix: str) -> None:
        for f in fields(cls):
            key = _join(prefix, f.name)
            if f.name == "tiers":
                rows.append((key, "(required)", f.metadata["doc"]))
                for kind, tcls in TIER_CONFIGS.items():
                    walk(tcls, f"tiers[type={kind}]")
            elif f.name in _SECTIONS:
                walk(_SECTIONS[f.name], key)
            else:
                d = "(required)" if f.default is MISSING else repr(f.default)
                rows.append((key, d, f.metadata["doc"]))

    walk(StoreConfig, "")
    return rows
