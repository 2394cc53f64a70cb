"""The server's HTTP endpoint: Prometheus metrics and health checks.

``/metrics``  the store's and the server's metrics (prometheus_client's exposition)
``/healthz``  liveness: 200 while the server's event loop turns (its heartbeat is at
              most ``stale_s`` old), 503 when it is stuck
``/readyz``   readiness: 200 while accepting, 503 once draining for shutdown

It runs in a daemon thread (wsgiref, one thread per request), so a busy event loop
cannot stop a scrape, and a stuck one shows as a failed liveness check.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        pass


class HealthEndpoint:
    def __init__(
        self,
        registry: Any,
        beat: Callable[[], float],
        draining: Callable[[], bool],
        stale_s: float = 5.0,
    ) -> None:
        self._metrics = make_wsgi_app(registry)
        self._beat = beat
        self._draining = draining
        self._stale_s = stale_s
        self._httpd: _Server | None = None
        self.port = 0

    def app(self, environ: dict[str, Any], start: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            return self._metrics(environ, start)
        if path == "/healthz":
            age = time.monotonic() - self._beat()
            ok = age <= self._stale_s
            return _text(
                start, 200 if ok else 503, "ok\n" if ok else f"event loop stalled for {age:.1f} s\n"
            )
        if path == "/readyz":
            ok = not self._draining()
            return _text(start, 200 if ok else 503, "ready\n" if ok else "draining\n")
        return _text(start, 404, "try /metrics, /healthz or /readyz\n")

    def start(self, host: str, port: int) -> int:
        self._httpd = make_server(host, port, self.app, _Server, handler_class=_Quiet)
        self.port = self._httpd.server_address[1]
        threading.Thread(
            target=self._httpd.serve_forever, name="hurray-store-http", daemon=True
        ).start()
        return self.port

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()


def _text(start: Callable[..., Any], status: int, body: str) -> list[bytes]:
    reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
    data = body.encode()
    start(
        f"{status} {reason}",
        [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(data)))],
    )
    return [data]
