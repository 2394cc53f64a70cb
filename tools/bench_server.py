"""Benchmark the cache server: put and retrieve GB/s through `hurray-store serve` from
1, 2 and 4 client processes, beside references measured in the same run.

    python tools/bench_server.py [--objects 64] [--object-mib 4] [--clients 1,2,4]

* ours: each client process opens a ``remote`` tier (a pool of 4 pipelined
  connections) and puts then gets its own ``objects`` objects of ``object-mib`` MiB
  (the size of a layer object of a large segment), in ``rounds`` timed rounds per
  phase. The server keeps them in its cpu tier. GB/s: all clients' bytes over the
  slowest client's median round (the first round after a pause runs slow on this VM,
  for every path alike).
* raw loopback copy: the same bytes from the same number of processes over plain TCP
  sockets to a server process that receives into (or sends from) preallocated memory,
  with no protocol: the ceiling of any socket-based cache server on this machine.
* LMCache ``lmcache_server`` (``lm://``): LMCache 0.5.6's own cache server, fed KV
  chunks of the same byte size through LMCache's RemoteBackend (1 client process;
  LMCache's connector serialises its requests).

Prints a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from _bench import free_port, gbps, table, wait_port  # noqa: E402

# ------------------------------------------------------------------------ clients

OURS = textwrap.dedent(r"""
    import asyncio, json, statistics, sys, time
    from hurray_store.config import load_config
    from hurray_store.tiers import open_tier
    url = sys.argv[1]
    me, n, size, rounds = (int(x) for x in sys.argv[2:6])
    async def main():
        remote = {"type": "remote", "url": url, "connections": 4, "timeout_s": 60}
        cfg = load_config({"tiers": [remote]}, env={}).tiers[0]
        t = open_tier(cfg); await t.open()
        blobs = [bytes([(me * 7 + i) % 251]) * size for i in range(n)]
        dests = [bytearray(size) for _ in range(n)]  # resident, as an engine's buffers are
        for d in dests:
            d[::4096] = b"\0" * len(d[::4096])
        print("ready", flush=True)
        sys.stdin.readline()  # every client is set up: go
        puts, gets, ok = [], [], True
        for r in range(rounds):
            keys = [f"bench/{me}/{r}/{i}" for i in range(n)]
            t0 = time.perf_counter()
            oks = await t.put_many([(k, [b]) for k, b in zip(keys, blobs)])
            puts.append(time.perf_counter() - t0)
            ok = ok and all(oks)
            if r < rounds - 1:
                await t.delete_many(keys)  # untimed: keeps the server's memory bounded
        for r in range(rounds):
            t0 = time.perf_counter()
            reads = (t.get_ranges(k, [(0, size)], [memoryview(d)]) for k, d in zip(keys, dests))
            got = await asyncio.gather(*reads)
            gets.append(time.perf_counter() - t0)
            ok = ok and all(g is not None for g in got)
        ok = ok and all(d == b for d, b in zip(dests, blobs))
        await t.delete_many(keys)
        await t.close()
        med = statistics.median
        print(json.dumps({"put_s": med(puts), "get_s": med(gets), "ok": ok}))
    asyncio.run(main())
""")

RAW_SERVER = textwrap.dedent(r"""
    import socket, sys, threading
    port, n, size = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    srv = socket.create_server(("127.0.0.1", port), backlog=64)
    def handle(c):
        store = bytearray(n * size); store[::4096] = b"\1" * len(store[::4096])
        mv = memoryview(store)
        while True:
            op = c.recv(1)
            if op == b"P":  # receive n objects into preallocated memory, then ack
                pos = 0
                while pos < n * size:
                    pos += c.recv_into(mv[pos:])
                c.sendall(b"k")
            elif op == b"G":  # send n objects from memory
                c.sendall(mv)
            else:
                break
        c.close()
    while True:
        c, _ = srv.accept()
        threading.Thread(target=handle, args=(c,), daemon=True).start()
""")

RAW_CLIENT = textwrap.dedent(r"""
    import json, socket, statistics, sys, time
    port, me, n, size, rounds = (int(x) for x in sys.argv[1:6])
    buf = bytearray(n * size); buf[::4096] = b"\1" * len(buf[::4096])
    mv = memoryview(buf)
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    print("ready", flush=True)
    sys.stdin.readline()
    times = {"P": [], "G": []}
    for op in "PG":
        for r in range(rounds):
            t0 = time.perf_counter()
            if op == "P":
                s.sendall(b"P"); s.sendall(mv); s.recv(1)
            else:
                s.sendall(b"G"); pos = 0
                while pos < n * size:
                    pos += s.recv_into(mv[pos:])
            times[op].append(time.perf_counter() - t0)
    s.sendall(b"Q")
    med = statistics.median
    print(json.dumps({"put_s": med(times["P"]), "get_s": med(times["G"])}))
""")


def run_clients(argvs: list[list[str]]) -> list[dict]:
    """Start the client processes, wait until each says it is set up (imports, buffers,
    connections), start them all at once, and collect their JSON reports."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", *a],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
        )
        for a in argvs
    ]
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline()
        if line.strip() != b"ready":
            raise RuntimeError(
                f"a client failed to start: {line!r} "
                f"{p.stderr.read().decode()[-3000:] if p.stderr else ''}"
            )
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(b"go\n")
        p.stdin.flush()
    out = []
    for p in procs:
        o, e = p.communicate(timeout=600)
        if p.returncode:
            raise RuntimeError(e.decode()[-3000:])
        out.append(json.loads(o))
    return out


def bench_ours(url: str, clients: int, n: int, size: int, rounds: int) -> tuple[float, float]:
    res = run_clients([[OURS, url, str(c), str(n), str(size), str(rounds)] for c in range(clients)])
    assert all(r["ok"] for r in res), "a client read back different bytes"
    return _aggregate(res, clients * n * size)


def bench_raw(port: int, clients: int, n: int, size: int, rounds: int) -> tuple[float, float]:
    res = run_clients(
        [[RAW_CLIENT, str(port), str(c), str(n), str(size), str(rounds)] for c in range(clients)]
    )
    return _aggregate(res, clients * n * size)


def _aggregate(res: list[dict], total: int) -> tuple[float, float]:
    """All clients' bytes over the slowest client's median round, per phase."""
    return gbps(total, max(r["put_s"] for r in res)), gbps(total, max(r["get_s"] for r in res))


def bench_lmcache(n: int, size: int, rounds: int) -> tuple[float, float]:
    """LMCache's lm:// server through its RemoteBackend, chunks of ``size`` bytes."""
    import torch

    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    from bench_store import LMCacheBackend
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat

    from hurray_store import KVSpec

    port = free_port()
    srv = subprocess.Popen(
        [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_port(port, srv, "lmcache_server")
        heads, dim, layers = 8, 128, 8
        chunk = size // (2 * layers * heads * dim * 2)
        spec = KVSpec(
            model="bench",
            num_layers=layers,
            num_kv_heads=heads,
            head_dim=dim,
            page_size=16,
            dtype=torch.float16,
        )
        lm = LMCacheBackend(
            spec,
            chunk,
            {
                "remote_url": f"lm://127.0.0.1:{port}",
                "remote_serde": "naive",
                "max_local_cpu_size": 4.0,
            },
        )
        puts, gets = [], []
        for r in range(rounds):
            keys = [CacheEngineKey("bench", 1, 0, r * n + i, torch.float16) for i in range(n)]
            objs = []
            for i in range(n):
                o = lm.cpu.allocate(
                    torch.Size([2, layers, chunk, heads * dim]), torch.float16, MemoryFormat.KV_2LTD
                )
                o.tensor.fill_(i % 7)
                objs.append(o)
            t0 = time.perf_counter()
            lm.backend.batched_submit_put_task(keys, objs)
            while not all(lm.backend.contains(k) for k in keys):
                time.sleep(0.0005)
            puts.append(time.perf_counter() - t0)
            for o in objs:
                o.ref_count_down()
        for _ in range(rounds):
            t0 = time.perf_counter()
            for k in keys:
                g = lm.backend.get_blocking(k)
                assert g is not None, "lmcache_server lost a chunk"
                g.ref_count_down()
            gets.append(time.perf_counter() - t0)
        lm.close()
        return gbps(n * size, statistics.median(puts)), gbps(n * size, statistics.median(gets))
    finally:
        srv.kill()
        srv.wait()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--objects", type=int, default=64, help="objects per client process")
    ap.add_argument("--object-mib", type=int, default=4)
    ap.add_argument("--clients", default="1,2,4")
    ap.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="timed rounds per client process and phase; the median is kept",
    )
    ap.add_argument("--no-lmcache", action="store_true")
    a = ap.parse_args()
    size = a.object_mib << 20
    counts = [int(c) for c in a.clients.split(",")]
    with tempfile.TemporaryDirectory() as work:
        port, raw_port = free_port(), free_port()
        cfg = Path(work) / "server.yaml"
        cap = max(counts) * a.objects * size * 2
        cfg.write_text(
            json.dumps(
                {
                    "tiers": [{"type": "cpu", "capacity_bytes": cap, "preallocate": True}],
                    "server": {
                        "port": port,
                        "metrics_port": None,
                        "max_inflight_put_bytes": 2 << 30,
                    },
                }
            )
        )
        srv = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hurray_store.cli",
                "serve",
                "--config",
                str(cfg),
                "--log-level",
                "warning",
            ],
            cwd=ROOT,
        )
        raw = subprocess.Popen(
            [sys.executable, "-c", RAW_SERVER, str(raw_port), str(a.objects), str(size)]
        )
        rows = []
        single: tuple[float, float] | None = None  # ours from 1 client, for the LMCache table
        try:
            wait_port(port, srv, "hurray-store serve")
            wait_port(raw_port, raw, "raw server")
            for c in counts:
                # Each client process times `rounds` rounds per phase and reports its
                # median: the first round after a pause runs slow on this VM for both.
                put, get = bench_ours(f"hurray://127.0.0.1:{port}", c, a.objects, size, a.rounds)
                rput, rget = bench_raw(raw_port, c, a.objects, size, a.rounds)
                if c == 1:
                    single = (put, get)
                rows.append(
                    [
                        f"{c} client process{'es' if c > 1 else ''}",
                        f"{put:.2f}",
                        f"{rput:.2f}",
                        f"{put / rput:.2f}x",
                        f"{get:.2f}",
                        f"{rget:.2f}",
                        f"{get / rget:.2f}x",
                    ]
                )
            if not a.no_lmcache and single is None:
                single = bench_ours(f"hurray://127.0.0.1:{port}", 1, a.objects, size, a.rounds)
        finally:
            srv.send_signal(signal.SIGTERM)
            srv.wait(timeout=60)
            raw.kill()
        print(
            f"\n{a.objects} objects of {a.object_mib} MiB per client; GB/s, all clients together\n"
        )
        print(
            table(
                ["clients", "put ours", "put raw TCP", "ratio", "get ours", "get raw TCP", "ratio"],
                rows,
            )
        )
        if not a.no_lmcache:
            assert single is not None
            lput, lget = bench_lmcache(a.objects, size, a.rounds)
            ours_put, ours_get = single
            print(
                f"\nbeside LMCache's lmcache_server (lm://), 1 client process, {a.objects} "
                f"chunks of {a.object_mib} MiB\n"
            )
            print(
                table(
                    ["path", "put GB/s", "get GB/s"],
                    [
                        [
                            "hurray-store serve, remote tier (the 1-client row)",
                            f"{ours_put:.2f}",
                            f"{ours_get:.2f}",
                        ],
                        [
                            "LMCache lmcache_server, RemoteBackend (lm://)",
                            f"{lput:.2f}",
                            f"{lget:.2f}",
                        ],
                        ["ratio", f"{ours_put / lput:.1f}x", f"{ours_get / lget:.1f}x"],
                    ],
                )
            )


if __name__ == "__main__":
    main()
