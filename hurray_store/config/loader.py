"""The one config loader: YAML path, dict or None; environment overrides; errors that
name the dotted key."""

from __future__ import annotations

import importlib
import os
import re
import stat
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Literal

import yaml

from hurray_store.config.schema import (
    ENV_PREFIX,
    ServerConfig,
    StoreConfig,
    TenantConfig,
    join_key,
)
from hurray_store.config.tier_configs import (
    TIERS,
    DiskTierConfig,
    RedisTierConfig,
    RemoteTierConfig,
    S3TierConfig,
    TierConfig,
    parse_hurray_url,
    parse_s3_url,
    register_tier,
)
from hurray_store.errors import ConfigError


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
            text = _read_config(p)
        except OSError as e:
            raise ConfigError(f"cannot read config file {p}: {e.strerror or e}") from e
        except UnicodeDecodeError as e:
            raise ConfigError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from e
        try:
            raw = yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {' '.join(str(e).split())}") from e
        except RecursionError:
            raise ConfigError(f"{p}: not a config: nested too deeply") from None
        except ConfigError as e:  # the loader's bounds
            raise ConfigError(f"{p}: {e}") from None
        if raw is None:
            raw = {}
        base = p.resolve().parent
    if not isinstance(raw, dict):
        raise ConfigError(f"a config is a mapping of keys, got {type(raw).__name__}")
    _apply_env(raw, os.environ if env is None else env)
    cfg = _build(StoreConfig, raw, "")
    _check_namespace(cfg.namespace, "namespace")
    if cfg.salt.startswith("\0"):  # the prefix of keys.request_salt's composed salts
        raise ConfigError("salt: may not start with a NUL character (composed salts do)")
    cfg = _replace(cfg, server=_check_server(cfg.server, cfg.namespace))
    if not cfg.engine.lease_s >= 0:
        raise ConfigError(f"engine.lease_s: expected seconds (0: none), got {cfg.engine.lease_s}")
    if any(q < 1 for q in cfg.engine.page_sizes):
        raise ConfigError(
            f"engine.page_sizes: expected page sizes >= 1, got {cfg.engine.page_sizes}"
        )
    if not cfg.engine.wait_s > 0:
        raise ConfigError(
            f"engine.wait_s: expected a positive number of seconds, got {cfg.engine.wait_s}"
        )
    _check_port(cfg.engine.metrics_port, "engine.metrics_port")
    _check_events(cfg.events)
    return _resolve_paths(cfg, base)


# A config file is a few KiB: a larger one, or one that is not a regular file (a device,
# a FIFO), is refused before it is read. A YAML alias is a reference to the node it names,
# but whatever walks or prints the value expands it (1.2 KB of nested aliases is 1.2 GiB in
# an error message): a document is refused when it expands past ``MAX_YAML_NODES`` nodes.
MAX_CONFIG_BYTES = 1 << 20
MAX_YAML_NODES = 100_000


def _read_config(p: Path) -> str:
    st = p.stat()
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{p}: not a regular file")
    with open(p, "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{p}: larger than a config may be ({MAX_CONFIG_BYTES} bytes)")
    return data.decode("utf-8")


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, counting each node as the nodes it expands to (an alias as
    the whole node it names) and refusing a document past ``MAX_YAML_NODES``."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        node: Any = super().compose_node(parent, index)
        sizes: dict[int, int] = self.__dict__.setdefault("_sizes", {})
        size = sizes.get(id(node))
        if size is None:  # a node just composed (an alias's node has its size already)
            if isinstance(node, yaml.ScalarNode):
                size = 1
            elif isinstance(node, yaml.SequenceNode):
                size = 1 + sum(sizes.get(id(c), 1) for c in node.value)
            else:
                size = 1 + sum(sizes.get(id(k), 1) + sizes.get(id(v), 1) for k, v in node.value)
            sizes[id(node)] = size
        if size > MAX_YAML_NODES:
            raise ConfigError(
                f"not a config: its YAML aliases expand to more than {MAX_YAML_NODES:,} values"
            )
        return node


def _check_port(v: int | None, where: str) -> None:
    if v is not None and not 0 <= v <= 65535:
        raise ConfigError(f"{where}: expected a TCP port (0-65535), got {v}")


# events: what is kept and how often it is sent (0 ms would spin a core on an idle process)
_EVENT_BOUNDS = {
    "interval_ms": (1, 3_600_000),
    "buffer_batches": (1, 1_000_000),
    "max_events": (1, 100_000_000),
}


def _check_events(e: Any) -> None:
    for key, (lo, hi) in _EVENT_BOUNDS.items():
        v = getattr(e, key)
        if not lo <= v <= hi:
            raise ConfigError(f"events.{key}: expected {lo} to {hi:,}, got {v}")


# A namespace is the first component of every stored key: no character the key scheme
# (``<ns>/s/{...}/``, ``<ns>/o/``, ``<ns>/g/``) or a file name could misread.
_MAX_CAPACITY = 1 << 62  # beyond any memory or disk; also keeps mmap sizes in range
_NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _check_namespace(ns: str, where: str) -> None:
    if not _NAMESPACE.fullmatch(ns):
        raise ConfigError(
            f"{where}: {ns!r} is not a namespace (1-64 of A-Z a-z 0-9 . _ -, starting with "
            "a letter or digit)"
        )


def _check_tenants(s: ServerConfig, namespace: str) -> tuple[TenantConfig, ...]:
    """Tenants with their namespaces filled in; names, tokens and namespaces distinct."""
    out: list[TenantConfig] = []
    names: set[str] = set()
    tokens: set[str] = {s.token} if s.token else set()
    spaces: set[str] = {namespace} if s.token else set()
    for i, t in enumerate(s.tenants):
        where = f"server.tenants.{t.name or i}"
        if not t.name:
            raise ConfigError(f"{where}.name: a tenant needs a name")
        ns = t.namespace or t.name
        _check_namespace(ns, f"{where}.namespace")
        if not t.token:
            raise ConfigError(f"{where}.token: a tenant needs a token (it is how it is known)")
        if t.quota_bytes is not None and t.quota_bytes < 1:
            raise ConfigError(f"{where}.quota_bytes: expected a positive number of bytes or null")
        for what, value, seen in (
            ("name", t.name, names),
            ("token", t.token, tokens),
            ("namespace", ns, spaces),
        ):
            if value in seen:
                shown = "" if what == "token" else f" {value!r}"
                raise ConfigError(
                    f"{where}.{what}: another tenant (or server.token's own namespace) has "
                    f"this {what}{shown}; each tenant needs its own"
                )
            seen.add(value)
        out.append(_replace(t, namespace=ns))
    return tuple(out)


def _check_server(s: ServerConfig, namespace: str) -> ServerConfig:
    for key in ("port", "metrics_port"):
        _check_port(getattr(s, key), f"server.{key}")
    if not (64 << 10) <= s.max_message_bytes <= 0xFFFFFFFF:
        raise ConfigError(
            "server.max_message_bytes: expected 65536 to 4294967295 (a u32 payload "
            f"length), got {s.max_message_bytes}"
        )
    for key in (
        "max_object_bytes",
        "max_connections",
        "max_unauthenticated",
        "max_requests_per_connection",
        "max_inflight_put_bytes",
        "max_inflight_message_bytes",
        "max_inflight_message_bytes_per_tenant",
        "max_claims_per_connection",
        "max_claims_per_tenant",
    ):
        if getattr(s, key) < 1:
            raise ConfigError(f"server.{key}: expected a positive number, got {getattr(s, key)}")
    if not s.hello_failures_per_s > 0:
        raise ConfigError(
            f"server.hello_failures_per_s: expected a positive rate, got {s.hello_failures_per_s}"
        )
    if s.max_object_bytes > s.max_inflight_put_bytes:
        raise ConfigError(
            f"server.max_object_bytes: {s.max_object_bytes} exceeds server.max_inflight_put_bytes "
            f"({s.max_inflight_put_bytes}): such an object could never be received"
        )
    return _replace(s, tenants=_check_tenants(s, namespace))


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
            value = yaml.load(env[var], Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader
        except yaml.YAMLError as e:
            raise ConfigError(f"{where}: not a YAML value: {e}") from e
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
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
                f"{join_key(where, str(k))}: unknown key (expected one of {sorted(known)})"
            )
    kwargs: dict[str, Any] = {}
    for name, f in known.items():
        key = join_key(where, name)
        if name not in raw:
            if f.default is MISSING:
                raise ConfigError(f"{key}: required key is missing")
            continue
        if name == "tiers":
            kwargs[name] = _tiers(raw[name], key)
        else:
            kwargs[name] = _convert(hints[name], raw[name], key)
    return cls(**kwargs)


def _outside_tier(spec: str, label: str) -> type:
    """The config class of a tier named ``module:Class`` (a tier class of another
    package, with its ``config_cls``), put in the registry (``TIERS``) for the tiers
    layer to open. The config imports its module, but never the tiers layer."""
    module, _, name = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{label}.type: cannot load the tier {spec!r}: {e}") from None
    try:
        kind = register_tier(cls)
    except ConfigError as e:
        raise ConfigError(f"{label}.type: {spec!r}: {e}") from None
    return TIERS[kind].config_cls


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
        if isinstance(kind, str) and ":" in kind:
            config_cls: Any = _outside_tier(kind, label)
        elif isinstance(kind, str) and kind in TIERS:
            config_cls = TIERS[kind].config_cls
        else:
            built_in = sorted(k for k, e in TIERS.items() if e.built_in)
            raise ConfigError(
                f"{label}.type: expected one of {built_in} or module:Class "
                f"(a tier of another package), got {kind!r}"
            )
        body = {k: v for k, v in item.items() if k != "type"}
        cfg = _build(config_cls, body, label)
        if not cfg.name:
            cfg = _replace(cfg, name=config_cls.kind)
        if cfg.name in names:
            raise ConfigError(
                f"{label}.name: two tiers are named {cfg.name!r}; give each a distinct name"
            )
        names.add(cfg.name)
        if isinstance(cfg, DiskTierConfig) and "\0" in cfg.path:
            raise ConfigError(f"{label}.path: a NUL character in {cfg.path!r}")
        if isinstance(cfg, RemoteTierConfig):
            try:
                parse_hurray_url(cfg.url)
            except ConfigError as e:
                raise ConfigError(f"{label}.url: {e}") from None
        if isinstance(cfg, S3TierConfig):
            try:
                parse_s3_url(cfg.url)
            except ConfigError as e:
                raise ConfigError(f"{label}.url: {e}") from None
            if cfg.multipart_bytes < 5 << 20:
                raise ConfigError(
                    f"{label}.multipart_bytes: S3 parts are at least 5 MiB (5242880), "
                    f"got {cfg.multipart_bytes}"
                )
        if (
            isinstance(cfg, (DiskTierConfig, RedisTierConfig))
            and cfg.write_threads is not None
            and cfg.write_threads < 1
        ):
            raise ConfigError(
                f"{label}.write_threads: expected a positive number or null, "
                f"got {cfg.write_threads}"
            )
        for key in ("backoff_initial_s", "backoff_max_s"):  # 0 would retry in a busy loop
            if hasattr(cfg, key) and not getattr(cfg, key) > 0:
                raise ConfigError(
                    f"{label}.{key}: expected seconds above 0, got {getattr(cfg, key)}"
                )
        if isinstance(cfg, RedisTierConfig) and cfg.wait_replicas < 0:
            raise ConfigError(f"{label}.wait_replicas: expected 0 or more, got {cfg.wait_replicas}")
        cap = getattr(cfg, "capacity_bytes", None)
        if cap is not None and not 1 <= cap <= _MAX_CAPACITY:
            raise ConfigError(
                f"{label}.capacity_bytes: expected a positive number of bytes up to "
                f"{_MAX_CAPACITY} (2**62), got {cap}"
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
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not 0 <= value < float("inf")  # NaN fails this too
        ):
            raise ConfigError(f"{where}: expected a non-negative finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if origin is tuple:
        (item, _) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        return tuple(
            _convert(
                item, v, join_key(where, str(v.get("name") or i) if isinstance(v, dict) else str(i))
            )
            for i, v in enumerate(value)
        )
    if isinstance(tp, type) and hasattr(tp, "__dataclass_fields__"):
        return _build(tp, value, where)
    raise ConfigError(f"{where}: unsupported type {tp}")  # pragma: no cover - schema bug


def _resolve_paths(cfg: StoreConfig, base: Path) -> StoreConfig:
    """Relative paths in tiers resolve against ``base`` (the config file's folder): the
    fields each tier's config class declares in ``path_fields``, and in ``file_fields``
    (which must exist: a Redis tier's TLS files)."""
    tiers: list[TierConfig] = []
    for t in cfg.tiers:
        # Each config class declares its path fields (resolved) and file fields
        # (resolved, and they must exist); an empty one is left as it is.
        paths = {k: getattr(t, k) for k in getattr(t, "path_fields", ()) if getattr(t, k)}
        files = {k: getattr(t, k) for k in getattr(t, "file_fields", ()) if getattr(t, k)}
        files = {k: str((base / v).resolve()) for k, v in files.items()}
        for k, v in files.items():
            if not Path(v).is_file():
                raise ConfigError(f"tiers.{t.name}.{k}: no such file: {v}")
        resolved = {k: str((base / v).resolve()) for k, v in paths.items()} | files
        if resolved:
            t = _replace(t, **resolved)
        if isinstance(t, RedisTierConfig) and bool(t.tls_cert_file) != bool(t.tls_key_file):
            raise ConfigError(
                f"tiers.{t.name}: tls_cert_file and tls_key_file go together; one is missing"
            )
        tiers.append(t)
    return _replace(cfg, tiers=tuple(tiers))
