"""tools/bench_attack.py's rows of issue V: an engine's steps while its cache server
hangs, and a flood of tiny objects against a small cpu tier.

- hung server: an engine port on a cpu tier and a remote tier (a real ``hurray-store
  serve``) runs a vLLM-like step loop for ``seconds``: each step looks up 17 objects,
  loads the ones found, saves 4 new ones behind the step and computes 20 ms (a sleep).
  Each lookup starts with a page another engine stored (on the server only), so it asks
  the server. Run twice in one run: the server untouched, then SIGSTOPped for most of
  the loop and SIGCONTed near its end. The row is the steps run against those without the hang.
- tiny flood: 200,000 one-byte puts, pipelined, into a server whose only tier is 32 MiB
  of CPU memory; the server's RSS growth against that capacity, and what the tier holds.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from hurray_store import transport as tp
from hurray_store.engine import EnginePort, Save

sys.path.insert(0, os.path.dirname(__file__))
from _bench import free_port, wait_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OBJECT = 64 << 10  # one object of the step loop


def _server(work: Path, tiers: list[dict[str, Any]]) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    cfg = work / "server.yaml"
    server = {"port": port, "metrics_port": free_port()}
    cfg.write_text(yaml.safe_dump({"tiers": tiers, "server": server}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "hurray_store.cli", "serve", "--config", str(cfg)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_port(port, proc, "hurray-store serve")
    return proc, port


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _steps(port: int, seconds: float, hang: subprocess.Popen[bytes] | None) -> dict[str, float]:
    """The step loop on a fresh engine port; with ``hang``, that server is SIGSTOPped
    from 10 % of the loop to 90 % of it."""
    cfg = {
        "tiers": [
            {"type": "cpu", "capacity_bytes": 256 << 20},
            {"type": "remote", "url": f"hurray://127.0.0.1:{port}", "timeout_s": 5.0},
        ]
    }
    p = EnginePort(cfg, name="bench-steps")
    data = bytes(OBJECT)
    if hang is None:  # another engine's pages, on the server only
        other = EnginePort({"tiers": [cfg["tiers"][1]]}, name="bench-other")
        other.save_lent([[(f"other/{k}", memoryview(data)) for k in range(256)]])
        other.close()
    steps = found = longest = 0.0
    stopped = resumed = False
    t0 = time.monotonic()
    end = t0 + seconds
    try:
        i = 0
        while (now := time.monotonic()) < end:
            if hang is not None and not stopped and now - t0 >= 0.1 * seconds:
                hang.send_signal(signal.SIGSTOP)
                stopped = True
            if hang is not None and stopped and not resumed and now - t0 >= 0.9 * seconds:
                hang.send_signal(signal.SIGCONT)
                resumed = True
            s0 = time.monotonic()
            names = [f"step/{(i + k) % 64}" for k in range(16)]
            # First a page another engine stored (on the server only), as a new
            # request's prefix: the lookup asks the server.
            held = p.lookup([f"other/{i % 256}", *names]).n
            if held:
                p.load(names[: held - 1], OBJECT, lambda j, b: "", lambda j, t: None)
            found += held
            p.save(Save(f"step/{(i + 16 + k) % 64}", memoryview(data), OBJECT) for k in range(4))
            time.sleep(0.02)  # the step's compute
            longest = max(longest, time.monotonic() - s0)
            steps += 1
            i += 4
    finally:
        if hang is not None and not resumed:
            hang.send_signal(signal.SIGCONT)
        stats = p.stats()["port"]
        p.close()
    return {"steps": steps, "found": found, "longest_s": longest, "late": stats["calls_late"]}


def hung_server(seconds: float = 10.0) -> str:
    work = Path(tempfile.mkdtemp(prefix="bench-sick-"))
    proc, port = _server(work, [{"type": "cpu", "capacity_bytes": 256 << 20}])
    try:
        alone = _steps(port, seconds, None)
        hung = _steps(port, seconds, proc)
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()
    ratio = hung["steps"] / alone["steps"]
    return (
        f"| hung server ({0.8 * seconds:.0f} s of a {seconds:.0f} s step loop) "
        f"| {alone['steps']:.0f} steps, longest {alone['longest_s'] * 1000:.0f} ms "
        f"| {hung['steps']:.0f} steps, longest {hung['longest_s'] * 1000:.0f} ms, "
        f"{hung['late']:.0f} call(s) late | {ratio:.2f}x steps (aim >= 0.95x) |"
    )


def _put(sid: int, key: str) -> bytes:
    return (
        tp.HEADER.pack(tp.Msg.TENSOR_PUT, sid, len(p := tp.encode_put(key, 1)))
        + p
        + tp.HEADER.pack(tp.Msg.TENSOR_DATA, sid, tp.DATA_OFFSET.size + 1)
        + tp.DATA_OFFSET.pack(0)
        + b"x"
        + tp.HEADER.pack(tp.Msg.TENSOR_DATA_END, sid, 0)
    )


def tiny_flood(n: int = 200_000, cap: int = 32 << 20) -> str:
    work = Path(tempfile.mkdtemp(prefix="bench-flood-"))
    proc, port = _server(work, [{"type": "cpu", "capacity_bytes": cap}])
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        hello = tp.Hello(ext={"extensions": tp.EXTENSION}).encode()
        s.sendall(tp.HEADER.pack(tp.Msg.CLIENT_HELLO, 1, len(hello)) + hello)
        s.recv(65536)
        time.sleep(0.5)
        before = _rss_mib(proc.pid)
        for b in range(0, n, 64):
            s.sendall(b"".join(_put(3 + 2 * k, f"tiny/{b + k:08d}") for k in range(64)))
            for _ in range(64):
                kind, _, m = tp.HEADER.unpack(_recv_exact(s, tp.HEADER.size))
                _recv_exact(s, m)
                assert kind == tp.Msg.TENSOR_PUT_ACK, hex(kind)
        time.sleep(0.5)
        grown = _rss_mib(proc.pid) - before
        stats = _stats(s)
    finally:
        proc.kill()
        proc.wait()
    cpu = stats["tiers"]["cpu"]
    return (
        f"| tiny flood ({n:,} one-byte puts, {cap >> 20} MiB cpu tier) "
        f"| RSS +{grown:.0f} MiB ({grown / (cap >> 20):.2f}x the capacity) "
        f"| {cpu['objects']:,} objects held, {cpu['evictions']:,} evicted "
        f"| {cpu['bytes'] >> 20} MiB charged of {cap >> 20} |"
    )


def _recv_exact(s: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = s.recv(n - len(out))
        if not got:
            raise ConnectionError("the server closed the connection")
        out += got
    return bytes(out)


def _stats(s: socket.socket) -> dict[str, Any]:
    import json

    s.sendall(tp.HEADER.pack(tp.Msg.X_STATS, 9, 0))
    kind, _, n = tp.HEADER.unpack(_recv_exact(s, tp.HEADER.size))
    return dict(json.loads(_recv_exact(s, n)))


def rows() -> list[str]:
    torch.set_num_threads(1)
    return [hung_server(), tiny_flood()]
