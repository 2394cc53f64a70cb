"""deploy/: the container file, the compose file and the service unit run the commands and
configs they name, as written (no container runtime needed): each command is run here,
its paths mapped to this checkout and its ports and folders to the test's through the
HURRAY_STORE__... overrides the deployments document; the server comes up ready, serves
an engine, and drains on SIGTERM with exit code 0."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import yaml

from hurray_store.config import load_config
from hurray_store.testing.services import RedisProc, free_port

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
BIN = ROOT / ".venv" / "bin" / "hurray-store"


def _dockerfile() -> tuple[list[str], str]:
    """The Dockerfile's CMD (JSON form) and its HEALTHCHECK command."""
    text = (DEPLOY / "Dockerfile").read_text()
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))  # type: ignore[union-attr]
    health = re.search(r"^HEALTHCHECK .*\\\n\s+CMD (.*)$", text, re.M).group(1)  # type: ignore[union-attr]
    return cmd, health


def _local(cmd: list[str]) -> list[str]:
    """A deployment's command with its paths in this checkout."""
    out = [
        str(BIN) if c in ("hurray-store", "/opt/hurray-store/.venv/bin/hurray-store") else c
        for c in cmd
    ]
    return [
        c.replace("/app/", f"{ROOT}/").replace(
            "/etc/hurray-store/server.yaml", str(DEPLOY / "server.yaml")
        )
        for c in out
    ]


def _run(
    cmd: list[str], env: dict[str, str], log: Path
) -> tuple[subprocess.Popen[bytes], int, int]:
    """Start ``cmd`` with the test's ports and loopback: (process, port, metrics port),
    once /readyz answers."""
    port, mport = free_port(), free_port()
    env = {
        **os.environ,
        "LMCACHE_TRACK_USAGE": "false",
        "HURRAY_STORE__SERVER__HOST": "127.0.0.1",
        "HURRAY_STORE__SERVER__METRICS_HOST": "127.0.0.1",
        "HURRAY_STORE__SERVER__PORT": str(port),
        "HURRAY_STORE__SERVER__METRICS_PORT": str(mport),
        **env,
    }
    with log.open("wb") as out:  # a file: a pipe nobody reads could stall the server
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    end = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.read_text()[-2000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{mport}/readyz", timeout=1) as r:
                if r.status == 200:
                    return proc, port, mport
        except OSError:
            pass
        assert time.monotonic() < end, "the server never became ready"
        time.sleep(0.2)


def _serves(port: int) -> bool:
    """An engine's remote tier puts and gets an object through the server."""
    from hurray_store.config import RemoteTierConfig
    from hurray_store.tiers.remote import RemoteTier

    async def go() -> bool:
        t = RemoteTier(RemoteTierConfig(url=f"hurray://127.0.0.1:{port}", name="remote"), "hurray")
        await t.open()
        try:
            ok = await t.put("deploy/check", [b"kv" * 1000])
            got = await t.get("deploy/check")
            return ok and got is not None and bytes(got) == b"kv" * 1000
        finally:
            await t.close()

    return asyncio.run(go())


def _drains(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=60)


def test_the_container_files_command_and_health_check_run_as_written(tmp_path: Path) -> None:
    cmd, health = _dockerfile()
    assert cmd[:2] == ["hurray-store", "serve"]
    users = re.findall(r"^USER (\S+)$", (DEPLOY / "Dockerfile").read_text(), re.M)
    assert users and users[-1] not in ("root", "0"), "the server does not run as root"
    load_config(DEPLOY / "server.yaml")  # the config it names is valid as shipped
    env = {"HURRAY_STORE__TIERS__DISK__PATH": str(tmp_path / "cache")}  # its volume
    proc, port, mport = _run(_local(cmd), env, tmp_path / "log")
    try:
        assert _serves(port)
        check = shlex.split(health.replace("9471", str(mport)))
        assert check[0] == "python"
        assert (
            subprocess.run([str(ROOT / ".venv/bin/python"), *check[1:]], timeout=30).returncode == 0
        )
    finally:
        assert _drains(proc) == 0


def test_the_compose_files_server_runs_in_front_of_redis(
    tmp_path: Path, redis_server: RedisProc
) -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    hurray, redis = compose["services"]["hurray"], compose["services"]["redis"]
    assert redis["image"].startswith("redis") and "redis" in hurray["depends_on"]
    assert hurray["build"]["dockerfile"] == "deploy/Dockerfile"
    cfg = load_config(DEPLOY / "compose-server.yaml")
    assert [t.kind for t in cfg.tiers] == ["cpu", "redis"]
    # only the store evicts, by whole segment, within what Redis may hold (docs/config.md)
    argv = redis["command"]
    assert argv[argv.index("--maxmemory-policy") + 1] == "noeviction"
    maxmemory = argv[argv.index("--maxmemory") + 1]
    assert maxmemory.endswith("gb")
    redis_tier = cfg.tiers[1]
    assert redis_tier.capacity_bytes is not None
    assert redis_tier.capacity_bytes < int(maxmemory[:-2]) << 30
    # The compose service `redis` is the test's redis-server.
    env = {"HURRAY_STORE__TIERS__REDIS__URL": redis_server.url}
    proc, port, _ = _run(_local(hurray["command"]), env, tmp_path / "log")
    try:
        assert _serves(port)
    finally:
        assert _drains(proc) == 0


def test_the_service_units_command_runs_and_stops_on_its_signal(tmp_path: Path) -> None:
    unit = (DEPLOY / "hurray-store.service").read_text()
    fields = dict(
        line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#")
    )
    assert fields["KillSignal"] == "SIGTERM" and fields["Restart"] == "on-failure"
    drain = load_config(DEPLOY / "server.yaml").server.shutdown_timeout_s
    assert float(fields["TimeoutStopSec"]) > drain, "systemd would kill it mid-drain"
    assert fields["StateDirectory"] == "hurray-store"  # /var/lib/hurray-store, the disk tier's
    assert fields["DynamicUser"] == "yes", "not as root"
    cmd = _local(shlex.split(fields["ExecStart"]))
    proc, port, _ = _run(
        cmd, {"HURRAY_STORE__TIERS__DISK__PATH": str(tmp_path / "s")}, tmp_path / "log"
    )
    try:
        assert _serves(port)
    finally:
        assert _drains(proc) == 0
