"""The config loader: shipped files, errors that name the dotted key, env overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from hurray_store.config import (
    CpuTierConfig,
    DiskTierConfig,
    RedisTierConfig,
    StoreConfig,
    load_config,
    schema,
)
from hurray_store.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
LMCACHE_CONFIG = (
    ROOT / "configs/lmcache.yaml"
)  # LMCache's own config, tested in test_lmcache_plugin
CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.yaml") if p != LMCACHE_CONFIG)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    cfg = load_config(path, env={})
    assert isinstance(cfg, StoreConfig) and cfg.tiers


def test_default_yaml_is_the_embedded_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    assert load_config(ROOT / "configs/default.yaml", env={}) == load_config(None, env={})


def test_relative_paths_resolve_against_the_files_folder(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    f = tmp_path / "sub/c.yaml"
    f.write_text("tiers:\n  - {type: disk, path: cache, capacity_bytes: 10}\n")
    (disk,) = load_config(f, env={}).tiers
    assert isinstance(disk, DiskTierConfig) and disk.path == str(tmp_path / "sub/cache")


_CPU = [{"type": "cpu", "capacity_bytes": 1}]


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"tiers": [{"type": "cpu", "capacity_bytes": 1}], "nope": 1}, "nope"),
        ({"tiers": [{"type": "cpu", "capacity_bytes": 1, "colour": "red"}]}, "tiers.cpu.colour"),
        ({"tiers": [{"type": "cpu", "capacity_bytes": "lots"}]}, "tiers.cpu.capacity_bytes"),
        ({"tiers": [{"type": "cpu", "capacity_bytes": True}]}, "tiers.cpu.capacity_bytes"),
        ({"tiers": [{"type": "cpu", "capacity_bytes": 0}]}, "tiers.cpu.capacity_bytes"),
        ({"tiers": [{"type": "cpu"}]}, "tiers.cpu.capacity_bytes"),
        ({"tiers": [{"type": "tape", "capacity_bytes": 1}]}, "tiers.tape.type"),
        ({"tiers": [{"type": "remote"}]}, "tiers.remote.url"),
        ({"tiers": [{"type": "remote", "url": "redis://h:1"}]}, "tiers.remote.url"),
        ({"tiers": [{"type": "s3", "url": "http://bucket/x"}]}, "tiers.s3.url"),
        ({"tiers": [{"type": "s3", "url": "s3:///x"}]}, "tiers.s3.url"),
        (
            {"tiers": [{"type": "s3", "url": "s3://b", "multipart_bytes": 1024}]},
            "tiers.s3.multipart_bytes",
        ),
        (
            {"tiers": [{"type": "redis", "url": "redis://h", "wait_replicas": -1}]},
            "tiers.redis.wait_replicas",
        ),
        (
            {"tiers": [{"type": "redis", "url": "rediss://h", "tls_ca_file": "/nope.pem"}]},
            "tiers.redis.tls_ca_file",
        ),
        (
            {"tiers": [{"type": "redis", "url": "rediss://h", "tls_cert_file": __file__}]},
            "tiers.redis",
        ),
        (
            {"tiers": [{"type": "cpu", "capacity_bytes": 1}], "server": {"port": 70000}},
            "server.port",
        ),
        (
            {"tiers": [{"type": "cpu", "capacity_bytes": 1}], "server": {"max_message_bytes": 100}},
            "server.max_message_bytes",
        ),
        (
            {
                "tiers": [{"type": "cpu", "capacity_bytes": 1}],
                "server": {"max_object_bytes": 1 << 40},
            },
            "server.max_object_bytes",
        ),
        ({"tiers": [{"type": "cpu", "capacity_bytes": 1}], "server": {"tokn": "x"}}, "server.tokn"),
        (
            {"tiers": [{"type": "disk", "capacity_bytes": 1, "path": "x", "fsync": "yes"}]},
            "tiers.disk.fsync",
        ),
        ({"tiers": [{"type": "redis", "url": "redis://h", "ttl_s": -5}]}, "tiers.redis.ttl_s"),
        (
            {"tiers": [{"type": "redis", "url": "redis://h", "write_threads": -1}]},
            "tiers.redis.write_threads",
        ),
        (
            {"tiers": [{"type": "disk", "capacity_bytes": 1, "path": "x", "write_threads": 0}]},
            "tiers.disk.write_threads",
        ),
        (
            {"tiers": [{"type": "cpu", "capacity_bytes": 1}], "policy": {"write_mode": "sideways"}},
            "policy.write_mode",
        ),
        ({"tiers": [{"type": "cpu", "capacity_bytes": 1}], "quantization": "int4"}, "quantization"),
        ({"tiers": []}, "tiers"),
        ({}, "tiers"),
        (
            {"tiers": [{"type": "cpu", "capacity_bytes": 1}], "engine": {"wait_s": 0}},
            "engine.wait_s",
        ),
        (
            {"tiers": [{"type": "cpu", "capacity_bytes": 1}, {"type": "cpu", "capacity_bytes": 1}]},
            "tiers.cpu.name",
        ),
        # accepted once, then a core spun or a crash at start
        ({"tiers": _CPU, "events": {"interval_ms": 0}}, "events.interval_ms"),
        ({"tiers": _CPU, "events": {"buffer_batches": 2**63}}, "events.buffer_batches"),
        ({"tiers": _CPU, "events": {"max_events": 0}}, "events.max_events"),
        ({"tiers": _CPU, "engine": {"metrics_port": 70000}}, "engine.metrics_port"),
        ({"tiers": _CPU, "server": {"port": -1}}, "server.port"),
        (
            {"tiers": [{"type": "remote", "url": "hurray://127.0.0.1:9", "backoff_initial_s": 0}]},
            "tiers.remote.backoff_initial_s",
        ),
        (
            {"tiers": [{"type": "redis", "url": "redis://h", "backoff_max_s": 0}]},
            "tiers.redis.backoff_max_s",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_keys_and_values_name_the_dotted_key(raw: dict, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(raw, env={})
    assert str(e.value).startswith(key + ":") or f"{key}:" in str(e.value), str(e.value)


def test_bad_yaml_and_missing_file_are_config_errors(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("tiers: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(f, env={})
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml", env={})


# 1.2 KB of YAML whose nine levels of aliases expand to 10**9 strings when walked
_BOMB = (
    "a: &a ["
    + ",".join(["lol"] * 10)
    + "]\n"
    + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [" + ",".join([f"*{chr(97 + i)}"] * 10) + "]\n"
        for i in range(8)
    )
)


def test_a_yaml_alias_bomb_is_refused_in_one_short_line(tmp_path: Path) -> None:
    f = tmp_path / "bomb.yaml"
    f.write_text(_BOMB + "tiers: *i\n")
    assert len(f.read_bytes()) < 1500
    with pytest.raises(ConfigError) as e:
        load_config(f, env={})
    assert str(e.value) == f"{f}: not a config: its YAML aliases expand to more than 100,000 values"
    with pytest.raises(ConfigError, match="HURRAY_STORE__NAMESPACE: not a config: its YAML alias"):
        load_config({"tiers": _CPU}, env={"HURRAY_STORE__NAMESPACE": _BOMB})
    # a few aliases, as configs use them, still load
    f.write_text(
        "tiers: [{type: cpu, name: a, capacity_bytes: &cap 1048576},\n"
        "        {type: cpu, name: b, capacity_bytes: *cap}]\n"
    )
    assert [t.capacity_bytes for t in load_config(f, env={}).tiers] == [1 << 20, 1 << 20]


def test_a_config_that_is_not_a_small_regular_file_is_refused_before_it_is_read(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match="/dev/zero: not a regular file"):
        load_config(Path("/dev/zero"), env={})
    big = tmp_path / "big.yaml"
    big.write_text("tiers: [{type: cpu, capacity_bytes: 1}]\n" + "#" * (1 << 20) + "\n")
    with pytest.raises(ConfigError, match="larger than a config may be"):
        load_config(big, env={})


def test_env_overrides_by_tier_name_and_position() -> None:
    env = {
        "HURRAY_STORE__TIERS__DISK__CAPACITY_BYTES": "123",
        "HURRAY_STORE__TIERS__0__CAPACITY_BYTES": "77",
        "HURRAY_STORE__POLICY__WRITE_MODE": "back",
        "HURRAY_STORE__TIERS__DISK__FSYNC": "true",
        "UNRELATED": "1",
    }
    cfg = load_config(None, env=env)
    cpu, disk = cfg.tiers
    assert isinstance(cpu, CpuTierConfig) and cpu.capacity_bytes == 77
    assert isinstance(disk, DiskTierConfig) and disk.capacity_bytes == 123 and disk.fsync is True
    assert cfg.policy.write_mode == "back"


def test_env_override_of_an_unknown_key_or_tier_is_an_error() -> None:
    with pytest.raises(ConfigError, match="tiers.disk.colour: unknown key"):
        load_config(None, env={"HURRAY_STORE__TIERS__DISK__COLOUR": "red"})
    with pytest.raises(ConfigError, match="no entry 'tape'"):
        load_config(None, env={"HURRAY_STORE__TIERS__TAPE__CAPACITY_BYTES": "1"})
    with pytest.raises(ConfigError, match="tiers.cpu.capacity_bytes: expected an integer"):
        load_config(None, env={"HURRAY_STORE__TIERS__CPU__CAPACITY_BYTES": "many"})


def test_redis_defaults() -> None:
    (r,) = load_config({"tiers": [{"type": "redis", "url": "redis://127.0.0.1:1"}]}, env={}).tiers
    assert (
        isinstance(r, RedisTierConfig)
        and r.name == "redis"
        and r.capacity_bytes is None
        and r.ttl_s is None
    )


def test_every_key_is_documented_in_docs_config_md() -> None:
    doc = (ROOT / "docs/config.md").read_text()
    missing = [
        key
        for key, _, _ in schema()
        if f"`{key}`" not in doc and f"`{key.split('.')[-1]}`" not in doc
    ]
    assert not missing, f"docs/config.md lacks {missing}"
    for key, _, text in schema():
        assert text, f"{key} has no doc string"
