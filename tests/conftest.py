"""Fixtures that start real services on free loopback ports: redis-server, and a
three-master Redis Cluster built with ``redis-cli --cluster create``."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REDIS = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
needs_redis = pytest.mark.skipif(
    REDIS is None, reason="redis-server is not installed (make test installs it)"
)


def free_port(bus: bool = False) -> int:
    """A free loopback port; with ``bus``, one whose cluster bus port (+10000) is free
    and valid too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not bus:
            return port
        if port + 10000 <= 65535:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 10000))
                return port
            except OSError:
                pass


def wait_listening(
    port: int, proc: subprocess.Popen[bytes], what: str, timeout: float, log: Path | None = None
) -> None:
    """Wait until ``proc`` accepts connections on ``port``; raise (with its log) if it
    exits or does not listen within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{what} exited with {proc.returncode}" + (f":\n{log.read_text()}" if log else "")
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(
        f"{what} did not listen on port {port}" + (f":\n{log.read_text()}" if log else "")
    )


class RedisProc:
    """One redis-server on 127.0.0.1; ``stop`` kills it, ``start`` brings it back on
    the same port."""

    def __init__(self, workdir: Path, *extra: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.workdir = workdir
        self.extra = list(extra)
        self.proc: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def cli(self, *args: str) -> str:
        assert REDIS_CLI is not None
        out = subprocess.run(
            [REDIS_CLI, "-p", str(self.port), *args], capture_output=True, timeout=20
        )
        return out.stdout.decode()

    def start(self) -> RedisProc:
        assert REDIS is not None
        self.proc = subprocess.Popen(
            [
                REDIS,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_listening(self.port, self.proc, "redis-server", 10)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProc]:
    if REDIS is None:
        pytest.skip("redis-server is not installed")
    r = RedisProc(tmp_path_factory.mktemp("redis")).start()
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture
def redis_fresh(tmp_path: Path) -> Iterator[RedisProc]:
    """A redis-server of the test's own, which the test may kill and restart."""
    if REDIS is None:
        pytest.skip("redis-server is not installed")
    r = RedisProc(tmp_path / "redis").start()
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RedisProc]]:
    if REDIS is None or REDIS_CLI is None:
        pytest.skip("redis-server / redis-cli are not installed")
    base = tmp_path_factory.mktemp("cluster")
    nodes = []
    try:
        for i in range(3):
            port = free_port(bus=True)
            nodes.append(
                RedisProc(
                    base / str(i),
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    f"nodes-{port}.conf",
                    "--cluster-node-timeout",
                    "2000",
                    port=port,
                ).start()
            )
        subprocess.run(
            [
                REDIS_CLI,
                "--cluster",
                "create",
                *[f"127.0.0.1:{n.port}" for n in nodes],
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + 30
        while not all("cluster_state:ok" in n.cli("cluster", "info") for n in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        yield nodes
    finally:
        for n in nodes:
            n.stop()
