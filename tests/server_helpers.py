"""A real `hurray-store serve` process on free loopback ports, and a raw socket client
that speaks the transport byte by byte (for the malformed-input tests)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from hurray_store import transport as tp
from hurray_store.testing.services import Pausable, free_port, wait_listening

ROOT = Path(__file__).resolve().parent.parent


class ServerProc(Pausable):
    """``hurray-store serve`` on a cpu + disk config under ``workdir``."""

    def __init__(
        self,
        workdir: Path,
        *,
        token: str = "",
        cpu_bytes: int = 256 << 20,
        events: dict[str, Any] | None = None,
        tiers: list[dict[str, Any]] | None = None,
        **server: Any,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.port = free_port()
        self.metrics_port = free_port()
        self.token = token
        self.config = workdir / "server.yaml"
        cfg = {
            "tiers": tiers
            or [
                {"type": "cpu", "capacity_bytes": cpu_bytes},
                {"type": "disk", "path": "cache", "capacity_bytes": 4 << 30},
            ],
            "server": {
                "port": self.port,
                "metrics_port": self.metrics_port,
                "token": token,
                **server,
            },
            **({"events": events} if events else {}),
        }
        self.config.write_text(yaml.safe_dump(cfg))
        self.log = workdir / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"hurray://127.0.0.1:{self.port}"

    def start(self) -> ServerProc:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hurray_store.cli",
                "serve",
                "--config",
                str(self.config),
                "--log-level",
                "info",
            ],
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        wait_listening(self.port, self.proc, "the server", 60, self.log)
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Signal the server and wait for it; its exit code."""
        assert self.proc is not None
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=60)
        self.proc = None
        return rc

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def tier(self, **kw: Any) -> dict[str, Any]:
        """A remote tier entry for an engine config."""
        return {
            "type": "remote",
            "url": self.url,
            "token": self.token,
            "backoff_initial_s": 0.05,
            "backoff_max_s": 0.5,
            **kw,
        }


class Raw:
    """A blocking socket that speaks the transport message by message."""

    def __init__(self, port: int, timeout: float = 10.0) -> None:
        self.s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        # Small messages go out at once (Nagle's wait for an ACK would add 40 ms to
        # each round of pipelined puts).
        self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self) -> None:
        self.s.close()

    def send(self, kind: int, sid: int, payload: bytes = b"") -> None:
        self.s.sendall(tp.HEADER.pack(kind, sid, len(payload)) + payload)

    def exact(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.s.recv(n - len(out))
            if not chunk:
                raise EOFError(f"connection closed after {len(out)} of {n} bytes")
            out += chunk
        return bytes(out)

    def recv(self) -> tuple[int, int, bytes]:
        kind, sid, n = tp.HEADER.unpack(self.exact(tp.HEADER_LEN))
        return kind, sid, self.exact(n)

    def hello(self, token: str | None = "", ext: bool = True) -> tuple[int, int, bytes]:
        e = None
        if ext:
            e = {"extensions": tp.EXTENSION}
            if token is not None:
                e["token"] = token
        self.send(tp.Msg.CLIENT_HELLO, 1, tp.Hello(ext=e).encode())
        return self.recv()

    def error(self) -> tuple[int, str]:
        """The next message, which must be ERROR: (code, text)."""
        kind, _sid, payload = self.recv()
        assert kind == tp.Msg.ERROR, f"expected ERROR, got message 0x{kind:x}"
        e = tp.decode_error(memoryview(payload))
        return e.code, str(e)

    def is_closed(self, wait_s: float | None = None) -> bool:
        """True when the server closed this connection: EOF within the socket's timeout,
        or within ``wait_s`` (an open connection is then False, not a wait)."""
        if wait_s is not None:
            self.s.settimeout(wait_s)
        try:
            return self.s.recv(1) == b""
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            if wait_s is None:
                raise
            return False

    def ping(self, sid: int = 99) -> bool:
        self.send(tp.Msg.PING, sid, b"still there?")
        return self.recv() == (tp.Msg.PONG, sid, b"still there?")

    def put(self, key: str, data: bytes, sid: int = 5) -> tuple[int, int, bytes]:
        self.send(tp.Msg.TENSOR_PUT, sid, tp.encode_put(key, len(data)))
        self.send(tp.Msg.TENSOR_DATA, sid, tp.DATA_OFFSET.pack(0) + data)
        self.send(tp.Msg.TENSOR_DATA_END, sid)
        return self.recv()

    def get(self, key: str, sid: int = 7) -> bytes | None:
        """TENSOR_REQUEST; the object's bytes, or None on ERROR UNKNOWN_TENSOR."""
        self.send(tp.Msg.TENSOR_REQUEST, sid, tp.encode_request(key))
        kind, rsid, payload = self.recv()
        assert rsid == sid
        if kind == tp.Msg.ERROR:
            assert tp.decode_error(memoryview(payload)).code == tp.Err.UNKNOWN_TENSOR
            return None
        assert kind == tp.Msg.TENSOR_DESCRIPTOR
        total = tp.decode_descriptor(memoryview(payload), 1 << 40)
        out = bytearray()
        while True:
            kind, rsid, payload = self.recv()
            assert rsid == sid
            if kind == tp.Msg.TENSOR_DATA_END:
                break
            assert kind == tp.Msg.TENSOR_DATA
            (off,) = tp.DATA_OFFSET.unpack(payload[:8])
            assert off == len(out)
            out += payload[8:]
        assert len(out) == total
        return bytes(out)
