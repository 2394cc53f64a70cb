"""The cache server under attack: a well-behaved engine's latency with and without hostile
clients on loopback, in one run.

One ``hurray-store serve`` process (a 128 MiB cpu tier) with two tenants: the engine's,
and the attackers' (their own token, a 32 MiB quota). The engine is a ``remote`` tier that
puts and gets 1 MiB objects, one at a time, and times each call. It runs once alone (the
reference), then again while these attackers run from threads of this process:

- silent: 300 connections that never send CLIENT_HELLO, renewed every second;
- non-readers: 8 clients that ask for a 2 MiB object again and again and never read;
- empty puts: a client staging zero-byte segment objects as fast as it can;
- announced: a TENSOR_PUT announcing 512 MiB that sends nothing, renewed as it times out;
- lookups: X_LOOKUPs with 4,096 sequences of 64 hashes each, back to back;
- flood: 1 MiB puts under new keys as fast as the server takes them (more than the whole
  tier in a run): the quota keeps them from evicting the engine's KV.
  Before the attack the engine stores 64 objects; the tool counts those left after it;
- abandoned: 8 connections at a time that send half of a 64 MiB message (a put's data
  frame, an X_COMMIT) and stop, renewed as the server cuts them;
- claims: claiming X_LOOKUPs of 262,144 fresh page hashes each, back to back;
- staging: 1 MiB segment layer objects staged and never committed;
- commits: X_COMMITs of a 48 MiB manifest for a segment with one tiny staged object;
- tiny puts: 1-byte puts, 64 pipelined at a time;
- bad hellos: CLIENT_HELLOs with a wrong token, as fast as they are answered;
- connect flood: connections that never speak, opened as fast as the server accepts.

Besides the engine's put and get, each phase times 20 fresh connections' CLIENT_HELLO
(an engine that connects while the flood runs) and samples the server's RSS.

Then two rows of their own (``tools/_bench_sick.py``; ``--sick-only`` runs only them):
an engine's step loop while its cache server hangs (steps against the same loop with no
hang), and 200,000 one-byte puts into a 32 MiB cpu tier (RSS against the capacity).

Everything goes to 127.0.0.1, every loop is bounded in time, and the tool stops by
itself. It prints p50 and p99 of the engine's put and get, and its failures, per phase.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, os.path.dirname(__file__))
from _bench import free_port, wait_port  # noqa: E402

from hurray_store import transport as tp
from hurray_store.config import RemoteTierConfig
from hurray_store.tiers.remote import RemoteTier

TOKEN = "bench-attack"  # the engine's tenant
ATTACKER = "bench-attacker"  # the attackers' tenant
KEPT = 64  # 1 MiB objects the engine stores before the attack
TIER_BYTES = 128 << 20  # the server's cpu tier; the attackers' quota is a quarter of it


def start_server(work: Path, quota: int | None) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    cfg = {
        "tiers": [{"type": "cpu", "capacity_bytes": TIER_BYTES}],
        "server": {
            "port": port,
            "metrics_port": None,
            "request_timeout_s": 5.0,
            "tenants": [
                {"name": "engine", "token": TOKEN, "namespace": "hurray"},
                {"name": "attacker", "token": ATTACKER, "quota_bytes": quota},
            ],
        },
    }
    (work / "server.yaml").write_text(yaml.safe_dump(cfg))
    log = open(work / "server.log", "wb")  # noqa: SIM115 - the server's lifetime
    proc = subprocess.Popen(
        [sys.executable, "-m", "hurray_store.cli", "serve", "--config", str(work / "server.yaml")],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_port(port, proc, "the server")
    except RuntimeError as e:
        proc.kill()
        raise SystemExit(f"{e}: {(work / 'server.log').read_text()[-2000:]}") from None
    return proc, port


class Raw:
    def __init__(self, port: int, hello: bool = True) -> None:
        self.s = socket.create_connection(("127.0.0.1", port), timeout=5.0)
        if hello:
            ext = {"extensions": tp.EXTENSION, "token": ATTACKER}
            self.send(tp.Msg.CLIENT_HELLO, 1, tp.Hello(ext=ext).encode())
            self.s.recv(65536)

    def send(self, kind: int, sid: int, payload: bytes = b"") -> None:
        self.s.sendall(tp.HEADER.pack(kind, sid, len(payload)) + payload)

    def close(self) -> None:
        self.s.close()


def attacker(stop: Any, body: Callable[[], None]) -> threading.Thread:
    def run() -> None:
        while not stop.is_set():
            try:
                body()
            except OSError:
                time.sleep(0.05)  # the server cut us off: that is its job

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


FLOODED = multiprocessing.get_context("fork").Value("q", 0)  # bytes the flood put


def attacks(port: int, stop: Any) -> list[threading.Thread]:
    def silent() -> None:
        conns = [Raw(port, hello=False) for _ in range(300)]
        stop.wait(1.0)
        for c in conns:
            c.close()

    def non_reader() -> None:
        c = Raw(port)
        c.s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        for sid in range(3, 3 + 2 * 200, 2):
            if stop.is_set():
                break
            c.send(tp.Msg.TENSOR_REQUEST, sid, tp.encode_request("attack/big"))
            stop.wait(0.05)
        c.close()

    def empty_puts() -> None:
        c = Raw(port)
        for i in range(2000):
            if stop.is_set():
                break
            sid = 3 + 2 * i
            c.send(tp.Msg.TENSOR_PUT, sid, tp.encode_put(f"hurray/s/{{{i:032x}}}/0", 0))
            c.send(tp.Msg.TENSOR_DATA_END, sid)
        c.close()

    def announced() -> None:
        c = Raw(port)
        c.send(tp.Msg.TENSOR_PUT, 3, tp.encode_put("attack/announced", 512 << 20))
        stop.wait(6.0)
        c.close()

    def lookups() -> None:
        c = Raw(port)
        seqs = [(0, [os.urandom(16) for _ in range(64)]) for _ in range(tp.MAX_LOOKUP_SEQS)]
        payload = tp.encode_lookup(seqs, claim=False)
        for i in range(20):
            if stop.is_set():
                break
            c.send(tp.Msg.X_LOOKUP, 3 + 2 * i, payload)
            c.s.recv(1 << 20)
        c.close()

    def puts_of(key: Callable[[int], str], n: int, count: bool = False) -> None:
        """``n`` puts of 1 MiB under ``key(i)``, one at a time (each ACK or ERROR read)."""
        c = Raw(port)
        data = os.urandom(1 << 20)
        for i in range(n):
            if stop.is_set():
                break
            sid = 3 + 2 * (i % 1000)
            c.send(tp.Msg.TENSOR_PUT, sid, tp.encode_put(key(i), len(data)))
            c.send(tp.Msg.TENSOR_DATA, sid, tp.DATA_OFFSET.pack(0) + data)
            c.send(tp.Msg.TENSOR_DATA_END, sid)
            c.s.recv(4096)
            if count:
                with FLOODED.get_lock():
                    FLOODED.value += len(data)
        c.close()

    def flood() -> None:
        puts_of(lambda i: f"flood/{os.getpid()}/{i}", 100_000, count=True)

    def abandoned() -> None:
        conns = []
        for i in range(8):
            c = Raw(port)
            big = 64 << 20
            if i % 2:
                c.send(tp.Msg.TENSOR_PUT, 3, tp.encode_put(f"attack/abandoned{i}", big))
                head = tp.HEADER.pack(tp.Msg.TENSOR_DATA, 3, big) + tp.DATA_OFFSET.pack(0)
            else:
                head = tp.HEADER.pack(tp.Msg.X_COMMIT, 3, big)
            c.s.sendall(head + HALF)
            conns.append(c)
        stop.wait(6.0)  # past the server's request_timeout_s: it cuts them
        for c in conns:
            c.close()

    def claims() -> None:
        c = Raw(port)
        for i in range(10):
            if stop.is_set():
                break
            seqs = [(0, [os.urandom(16) for _ in range(64)]) for _ in range(tp.MAX_LOOKUP_SEQS)]
            c.send(tp.Msg.X_LOOKUP, 3 + 2 * i, tp.encode_lookup(seqs, claim=True))
            c.s.recv(1 << 20)
        c.close()

    def staging() -> None:  # segment layer objects, never committed
        puts_of(lambda i: f"attacker/s/{{{os.getpid() * 10**6 + i:032x}}}/0", 2000)

    def commits() -> None:
        c = Raw(port)
        seg = f"attacker/s/{{{int.from_bytes(os.urandom(15), 'big'):032x}}}"
        c.send(tp.Msg.TENSOR_PUT, 3, tp.encode_put(f"{seg}/0", 1))
        c.send(tp.Msg.TENSOR_DATA, 3, tp.DATA_OFFSET.pack(0) + b"x")
        c.send(tp.Msg.TENSOR_DATA_END, 3)
        c.s.recv(4096)
        body = b"".join(bytes(p) for p in tp.encode_commit(f"{seg}/m", MANIFEST))
        for i in range(20):
            if stop.is_set():
                break
            c.send(tp.Msg.X_COMMIT, 5 + 2 * i, body)
            c.s.recv(4096)
        c.close()

    def tiny_puts() -> None:
        c = Raw(port)
        for b in range(0, 20_000, 64):
            if stop.is_set():
                break
            out = []
            for i in range(b, b + 64):
                sid = 3 + 2 * (i % 1000)
                put = tp.encode_put(f"tiny/{os.getpid()}/{i}", 1)
                out += [
                    tp.HEADER.pack(tp.Msg.TENSOR_PUT, sid, len(put)) + put,
                    tp.HEADER.pack(tp.Msg.TENSOR_DATA, sid, 9) + tp.DATA_OFFSET.pack(0) + b"t",
                    tp.HEADER.pack(tp.Msg.TENSOR_DATA_END, sid, 0),
                ]
            c.s.sendall(b"".join(out))
            got = 0
            while got < 64 * tp.HEADER_LEN:  # the acks (ERRORs are longer: enough)
                got += len(c.s.recv(1 << 16))
        c.close()

    def bad_hellos() -> None:
        c = Raw(port, hello=False)
        ext = {"extensions": tp.EXTENSION, "token": "wrong"}
        c.send(tp.Msg.CLIENT_HELLO, 1, tp.Hello(ext=ext).encode())
        c.s.recv(4096)
        c.close()

    def connect_flood() -> None:
        held = [socket.create_connection(("127.0.0.1", port), timeout=2) for _ in range(100)]
        for h in held:
            h.close()

    body: list[Callable[[], None]] = [silent, empty_puts, announced, lookups, flood]
    body += [non_reader] * 8
    body += [abandoned, claims, staging, commits, tiny_puts, bad_hellos, connect_flood]
    return [attacker(stop, b) for b in body if not ONLY or b.__name__ in ONLY]


ONLY: list[str] = []  # --only: these attacks alone (by function name)


def attack(port: int, stop: Any) -> None:
    """The attackers' process: every attack on a thread of its own until ``stop``."""
    for t in attacks(port, stop):
        t.join(timeout=30)


HALF = b"\1" * (32 << 20)
MANIFEST = b"\7" * (48 << 20)


def hellos(port: int, n: int) -> int:
    """Fresh connections of the engine's tenant whose CLIENT_HELLO is answered."""
    ok = 0
    for _ in range(n):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5.0)
            ext = {"extensions": tp.EXTENSION, "token": TOKEN}
            hello = tp.Hello(ext=ext).encode()
            s.sendall(tp.HEADER.pack(tp.Msg.CLIENT_HELLO, 1, len(hello)) + hello)
            head = s.recv(tp.HEADER_LEN, socket.MSG_WAITALL)
            ok += len(head) == tp.HEADER_LEN and head[0] == tp.Msg.SERVER_HELLO
            s.close()
        except OSError:
            pass
    return ok


class Rss:
    """The server's RSS, sampled every 0.1 s while running; its peak, in MiB."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0.0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def now(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.peak = max(self.peak, self.now())

    def stop(self) -> float:
        self._stop.set()
        self._t.join()
        return self.peak


def engine_tier(port: int) -> RemoteTier:
    return RemoteTier(
        RemoteTierConfig(url=f"hurray://127.0.0.1:{port}", name="remote", token=TOKEN),
        "hurray",
    )


async def keep(port: int) -> int:
    """Store the engine's ``KEPT`` objects; how many were stored."""
    t = engine_tier(port)
    try:
        return sum([await t.put(f"kept/{i}", [os.urandom(1 << 20)]) for i in range(KEPT)])
    finally:
        await t.close()


async def kept(port: int) -> int:
    """How many of the engine's ``KEPT`` objects the server still holds."""
    t = engine_tier(port)
    try:
        return sum(n is not None for n in await t.sizes([f"kept/{i}" for i in range(KEPT)]))
    finally:
        await t.close()


async def engine(port: int, n: int) -> tuple[list[float], list[float], int]:
    t = engine_tier(port)
    await t.open()
    data = os.urandom(1 << 20)
    puts, gets, failed = [], [], 0
    try:
        for i in range(n):
            t0 = time.perf_counter()
            ok = await t.put(f"engine/{i % 16}", [data])
            puts.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            got = await t.get(f"engine/{i % 16}")
            gets.append(time.perf_counter() - t0)
            failed += (not ok) + (got is None or bytes(got) != data)
    finally:
        await t.close()
    return puts, gets, failed


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] * 1000 if len(xs) > 1 else xs[0] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ops", type=int, default=200, help="engine puts (and gets) per phase")
    ap.add_argument(
        "--no-quota",
        action="store_true",
        help="give the attackers' tenant no quota (to see what the quota prevents)",
    )
    ap.add_argument(
        "--only",
        nargs="*",
        default=[],
        help="run these attacks only (silent, non_reader, empty_puts, announced, lookups, "
        "flood, abandoned, claims, staging, commits, tiny_puts, bad_hellos, connect_flood)",
    )
    ap.add_argument(
        "--sick-only",
        action="store_true",
        help="run only the rows of a hung server and a tiny-object flood (tools/_bench_sick.py)",
    )
    a = ap.parse_args()
    if a.sick_only:
        _sick_rows()
        return
    ONLY[:] = a.only
    work = Path(tempfile.mkdtemp(prefix="bench-attack-"))
    proc, port = start_server(work, None if a.no_quota else TIER_BYTES // 4)
    rows = []
    try:
        seed = Raw(port)
        big = os.urandom(2 << 20)
        seed.send(tp.Msg.TENSOR_PUT, 3, tp.encode_put("attack/big", len(big)))
        seed.send(tp.Msg.TENSOR_DATA, 3, tp.DATA_OFFSET.pack(0) + big)
        seed.send(tp.Msg.TENSOR_DATA_END, 3)
        seed.s.recv(4096)
        seed.close()
        stored = asyncio.run(keep(port))
        for phase in ("alone", "under attack"):
            rss = Rss(proc.pid)
            before = rss.now()
            ctx = multiprocessing.get_context("fork")
            stop = ctx.Event()
            # The attackers run in a process of their own: the engine's loop here does
            # not wait for their threads' GIL, only the server does (as it would).
            attackers = ctx.Process(target=attack, args=(port, stop)) if phase != "alone" else None
            if attackers is not None:
                attackers.start()
                time.sleep(1.0)
            puts, gets, failed = asyncio.run(engine(port, a.ops))
            answered = hellos(port, 20)
            stop.set()
            if attackers is not None:
                attackers.join(timeout=30)
                time.sleep(8.0)  # past request_timeout_s: the abandoned messages are cut
            mem = (before, rss.stop(), rss.now())
            rows.append(
                (phase, pct(puts, 50), pct(puts, 99), pct(gets, 50), pct(gets, 99), failed)
                + (answered,)
                + mem
            )
            time.sleep(2.0)
        left = asyncio.run(kept(port))
        alive = proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(f"\nengine: {a.ops} puts and gets of 1 MiB through a remote tier; latency in ms\n")
    print(
        "| phase        | put p50 | put p99 | get p50 | get p99 | failed calls "
        "| hellos answered | RSS before / peak / after, MiB |"
    )
    print(
        "|--------------|---------|---------|---------|---------|--------------"
        "|-----------------|--------------------------------|"
    )
    for phase, p50, p99, g50, g99, failed, answered, r0, r1, r2 in rows:
        mem = f"{r0:.0f} / {r1:.0f} / {r2:.0f}"
        print(
            f"| {phase:<12} | {p50:7.2f} | {p99:7.2f} | {g50:7.2f} | {g99:7.2f} | {failed:12d} "
            f"| {answered:>12} of 20 | {mem:>30} |"
        )
    alone, attacked = rows
    print(
        f"\np99 under attack / alone: put {attacked[2] / alone[2]:.1f}x, "
        f"get {attacked[4] / alone[4]:.1f}x (target <= 10x)"
    )
    print(
        f"\nthe flood sent {FLOODED.value >> 20} MiB of puts to a {TIER_BYTES >> 20} MiB tier; "
        f"the engine's objects stored before the attack: {stored} of {KEPT}, still held "
        f"after it: {left}"
    )
    print(f"the server survived the attack: {alive}; exit code on SIGTERM: {proc.returncode}")
    _sick_rows()


def _sick_rows() -> None:
    import _bench_sick

    print("\n| row | reference (same run) | measured | result |")
    print("|---|---|---|---|")
    for row in _bench_sick.rows():
        print(row)


if __name__ == "__main__":
    main()
