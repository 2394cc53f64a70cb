"""The cache server: one TieredStore shared by many engine processes over the Hurray
network transport ``docs/server.md`` describes the protocol as served.

One task accepts connections; one task per connection reads its messages in order.
A TENSOR_PUT's data frames are received straight into a resident buffer (its bytes
counted against ``max_inflight_put_bytes`` until the store no longer needs them); every
other request runs as a task of its own and writes its answer under the connection's
send lock, so a connection carries many requests at once (stream ids tell them apart).

What a put becomes:

* a segment's layer object (``<ns>/s/{seg}/<layer>`` in the server's namespace) is
  *staged*: held until the segment's manifest arrives in X_COMMIT, which verifies
  every object against the manifest and stores them together, manifest last (the
  commit point, as in-process). Staged objects that see no commit within
  ``staging_timeout_s`` are dropped.
* any other key is stored at once, as an object-level key of the server's store.

Claims make a page stored once across clients: X_LOOKUP with the claim flag reserves the
pages nobody holds for the asking connection; another client's claiming lookup of the
same pages waits (up to ``claim_timeout_s``) for the commit that brings them, then sees
them as held. A claim ends with that commit, its connection, or its timeout.

Bad input: a message that cannot be trusted (garbage, a header over the size limit, a
truncated message, an unknown or unexpected type, anything before CLIENT_HELLO, a wrong
token) gets ERROR and that connection is closed; the others are not touched. A request
that is well formed but cannot be served (unknown key, a non-CPU device) gets ERROR on
its stream and the connection stays.
"""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import logging
import signal
import socket
import time
from functools import partial
from typing import Any

from hurray_store.config import ServerConfig, StoreConfig
from hurray_store.server.backing import ServedStore
from hurray_store.server.events import tenant_events
from hurray_store.server.guards import HelloFailures
from hurray_store.server.http import HealthEndpoint
from hurray_store.server.metrics import ServerMetrics
from hurray_store.server.segments import PutBudget, SegmentStaging
from hurray_store.server.session import Session
from hurray_store.server.tenants import Tenants
from hurray_store.store import TieredStore

log = logging.getLogger(__name__)
# How many of the oldest connections without a hello are looked at for one that has
# sent nothing, when the queue is full.
_SILENT_SCAN = 16


def _first_silent(queue: dict[Session, None]) -> Session:
    """The oldest queued connection that has sent no byte (among the oldest few), else
    the oldest."""
    for i, s in enumerate(queue):
        if i >= _SILENT_SCAN:
            break
        if not s.got_header and not _has_bytes(s.sock):
            return s
    return next(iter(queue))


def _has_bytes(sock: socket.socket) -> bool:
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True  # broken: its own session sees to it


def _loopback(addr: str) -> bool:
    """Whether a bound address is reached from this host only."""
    try:
        return ipaddress.ip_address(addr.split("%")[0]).is_loopback
    except ValueError:
        return False


class CacheServer:
    def __init__(self, store: TieredStore, cfg: ServerConfig) -> None:
        """``store``: built by ``server_store`` (it keeps every tenant's namespace)."""
        tenants = Tenants(cfg, store.namespace, store.groups)
        tenants.count_held()  # what an opened store found at restart
        self.store = ServedStore(store, tenants)
        self.cfg = cfg
        self.budget = PutBudget(cfg.max_inflight_put_bytes)
        # The other messages' bytes (requests, PINGs), in all and per tenant.
        self.messages = PutBudget(cfg.max_inflight_message_bytes)
        self.tenant_messages = {
            t.name: PutBudget(cfg.max_inflight_message_bytes_per_tenant) for t in tenants.all
        }
        self.hello_failures = HelloFailures(cfg.hello_failures_per_s)
        self.staging = SegmentStaging(self.store, cfg)
        self.sessions: set[Session] = set()
        self.unauthenticated: dict[Session, None] = {}  # before their CLIENT_HELLO
        self.served: set[Session] = set()  # past it: what max_connections counts
        self.metrics = ServerMetrics(self.store.registry)
        self.metrics.inflight.set_function(lambda: self.budget.used)
        self.metrics.staged.set_function(lambda: len(self.staging.staged))
        for t in tenants.all:
            self.metrics.tenant_bytes.labels(t.name).set_function(partial(getattr, t, "used"))
        evictions = self.metrics.tenant_quota_evictions
        tenants.on_evict = lambda t, n: evictions.labels(t.name).inc(n)
        self.draining = False
        self.beat = time.monotonic()
        self.port = 0
        self._listener: socket.socket | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._stopped = asyncio.Event()
        self.http: HealthEndpoint | None = None
        self.events = tenant_events(store, tenants)  # None unless the config asks
        if self.events is not None:
            log.info("KV events on %s", self.events.publisher.endpoint)

    # ------------------------------------------------------------------ lifecycle

    async def start(
        self, host: str | None = None, port: int | None = None, metrics_port: int | None = -1
    ) -> int:
        """Listen and serve in the background; returns the bound port. ``metrics_port``
        -1 takes the config's; None serves no HTTP endpoint; 0 picks a free port."""
        host = self.cfg.host if host is None else host
        port = self.cfg.port if port is None else port
        mport = self.cfg.metrics_port if metrics_port == -1 else metrics_port
        if mport is not None:
            self.http = HealthEndpoint(
                self.store.registry, lambda: self.beat, lambda: self.draining
            )
            try:
                self.http.start(self.cfg.metrics_host, mport)
            except OSError as e:
                raise OSError(
                    e.errno,
                    f"the metrics port {self.cfg.metrics_host}:{mport} (server.metrics_port, "
                    f"--metrics-port): {e.strerror}",
                ) from None
            log.info(
                "metrics and health on http://%s:%d/metrics (/healthz, /readyz)",
                self.cfg.metrics_host,
                self.http.port,
            )
        try:
            sock = socket.create_server((host, port), backlog=512, reuse_port=False)
        except OSError as e:
            raise OSError(
                e.errno, f"the transport port {host}:{port} (server.port, --port): {e.strerror}"
            ) from None
        sock.setblocking(False)
        self._listener = sock
        self.port = sock.getsockname()[1]
        self._tasks = [
            asyncio.ensure_future(self._accept()),
            asyncio.ensure_future(self._janitor()),
        ]
        log.info(
            "serving the Hurray transport on %s:%d (tiers: %s)",
            host,
            self.port,
            ", ".join(self.store.tier_names),
        )
        if self.store.tenants.open and not _loopback(sock.getsockname()[0]):
            log.warning(
                "the server listens on %s:%d with no token and no tenants: every client "
                "that reaches it is an admin of every namespace (set server.token or "
                "server.tenants, docs/server.md)",
                host,
                self.port,
            )
        return self.port

    async def serve_forever(self) -> None:
        """Serve until SIGTERM or SIGINT, then shut down gracefully."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopped.set)
        await self._stopped.wait()
        log.info("signal received: draining")
        await self.shutdown()

    def stop(self) -> None:
        self._stopped.set()

    async def shutdown(self) -> None:
        """Stop accepting, let in-flight requests finish (up to shutdown_timeout_s),
        close every connection, flush the store's write-through and close it."""
        self.draining = True
        if self._listener is not None:
            self._listener.close()
        accept, janitor = self._tasks or (None, None)
        if accept is not None:
            accept.cancel()
            await asyncio.gather(accept, return_exceptions=True)
        deadline = time.monotonic() + self.cfg.shutdown_timeout_s
        while any(s.busy for s in self.sessions) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for s in list(self.sessions):
            s.close()
            if s.task is not None:
                s.task.cancel()  # a read waiting on a closed socket would never wake
        while self.sessions and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self.staging.clear()
        await self.store.close()
        if self.events is not None:
            self.events.close()
        if janitor is not None:  # the heartbeat ran through the drain: /healthz stayed up
            janitor.cancel()
            await asyncio.gather(janitor, return_exceptions=True)
        if self.http is not None:
            self.http.stop()
        log.info("shut down")

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                conn, addr = await loop.sock_accept(self._listener)
            except OSError as e:
                if self.draining:
                    return
                log.warning("accept failed: %s", e)
                await asyncio.sleep(0.05)
                continue
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
            if len(self.unauthenticated) >= self.cfg.max_unauthenticated:
                # The queue of connections yet to say hello is full: the oldest that has
                # sent nothing goes (a client sends its hello with its connect, so a flood
                # of silent connections pushes out its own), else the oldest.
                gone = _first_silent(self.unauthenticated)
                self.unauthenticated.pop(gone)
                log.info("client %s: no CLIENT_HELLO yet and the queue is full; closed", gone.peer)
                gone.close()
            s = Session(self, conn, peer)
            self.sessions.add(s)
            self.unauthenticated[s] = None
            s.task = asyncio.ensure_future(s.run())
            await asyncio.sleep(0)  # let new connections read their hello between accepts

    async def _janitor(self) -> None:
        """Twice a second: the liveness heartbeat; drop expired staged objects and claims."""
        while True:
            await asyncio.sleep(0.5)
            self.beat = time.monotonic()
            self.staging.expire(self.beat)


def server_store(config: StoreConfig) -> TieredStore:
    """The store a cache server serves: the config's tiers, keeping the namespace of
    every tenant of ``config.server`` besides the config's own."""
    return TieredStore(config, namespaces=[t.namespace for t in config.server.tenants])


async def serve(
    store: TieredStore,
    cfg: ServerConfig,
    *,
    host: str | None = None,
    port: int | None = None,
    metrics_port: int | None = -1,
) -> None:
    """Open the store, serve until SIGTERM/SIGINT, shut down gracefully."""
    await store.open()
    server = CacheServer(store, cfg)
    await server.start(host, port, metrics_port)
    # Everything loaded so far (torch, the index) lives as long as the server: keep it
    # out of the garbage collector's passes, which the per-request objects trigger.
    gc.freeze()
    await server.serve_forever()


__all__ = ["CacheServer", "serve", "server_store"]
