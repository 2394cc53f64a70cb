#!/usr/bin/env python
"""What a store through LMCache's in-process backends costs the engine's own thread.

The main thread runs a small torch operation (``add_`` on 64 floats) in a loop,
standing for an engine's thread, while another thread stores chunks through the backend
(``batched_submit_put_task``, then polls ``contains`` until every chunk is stored).
Compared, on disk: LMCache's LocalDiskBackend, and the hurray_store plugin over a disk
tier with its default writer threads (one fewer than the cores) and with as many as
Python's default pool (CPU count + 4); on a Redis this script starts on a loopback
port: LMCache's RemoteBackend, and the plugin over a redis tier with its default writer
threads (4) and with 1. On Redis each round empties the server first (``FLUSHALL``:
LMCache's Redis backend cannot remove a key), for both. Each runs in a process of its own,
``--turns`` times, the backends taken in turn. Reported per backend (medians over every
round, with their range): the engine thread's operations per second while the store
runs, the 99th percentile of one operation, the operations the store cost it (its
rate alone, measured for 50 ms before each store, times the store's wall time, less
the operations it got through), and the store's time; ratios against
LMCache's backend on the same medium, measured in the same run.

    LMCACHE_TRACK_USAGE=false .venv/bin/python tools/bench_engine_thread.py [--chunks 32]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import table  # noqa: E402
from bench_store import LMCacheBackend, chunk_round  # noqa: E402

from hurray_store import KVSpec  # noqa: E402
from hurray_store.testing.services import RedisProc  # noqa: E402

# Per medium: LMCache's own backend (the reference), the plugin with the tier's default
# writer threads, and with another count: on disk as many as Python's default pool
# (what the disk tier wrote on before), on Redis 1.
_PY_POOL = min(32, (os.cpu_count() or 1) + 4)
CASES = {
    "LMCache LocalDiskBackend": "lmcache:disk",
    "hurray_store plugin, disk tier": "disk:null",
    f"hurray_store plugin, disk tier, write_threads: {_PY_POOL}": f"disk:{_PY_POOL}",
    "LMCache RemoteBackend (Redis)": "lmcache:redis",
    "hurray_store plugin, redis tier": "redis:null",
    "hurray_store plugin, redis tier, write_threads: 1": "redis:1",
}
REFERENCE = {"disk": "LMCache LocalDiskBackend", "redis": "LMCache RemoteBackend (Redis)"}


def backend_config(case: str, work: str, redis_port: int) -> dict[str, Any]:
    kind, arg = case.split(":")
    url = f"redis://127.0.0.1:{redis_port}"
    if kind == "lmcache":
        if arg == "disk":
            return {"local_disk": f"file://{work}/lmc-disk/", "max_local_disk_size": 16.0}
        return {"remote_url": url, "remote_serde": "naive"}
    yaml = Path(work) / "hurray.yaml"
    where = (
        f"path: {work}/h-disk, capacity_bytes: 17179869184" if kind == "disk" else f"url: '{url}'"
    )
    yaml.write_text(f"tiers:\n  - {{type: {kind}, {where}, write_threads: {arg}}}\n")
    return {
        "storage_plugins": ["hurray"],
        "extra_config": {
            "storage_plugin.hurray.module_path": "hurray_store.adapters.lmcache",
            "storage_plugin.hurray.class_name": "HurrayStoragePlugin",
            "storage_plugin.hurray.config": str(yaml),
        },
    }


def store(be: Any, keys: list[Any], objs: list[Any], span: list[float], ev: Any) -> None:
    """Submit the chunks, wait until the backend holds every one; the time in ``span``."""
    t0 = time.perf_counter()
    be.batched_submit_put_task(keys, objs)
    while not all(be.contains(k) for k in keys):
        time.sleep(0.0005)
    span.append(time.perf_counter() - t0)
    ev.set()


def one_case(case: str, a: argparse.Namespace) -> None:
    """The rounds of one backend, in this process; prints them as JSON."""
    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="bench-engine-")
    spec = KVSpec("bench", a.layers, 8, 128, 16, torch.float16)
    lm = LMCacheBackend(spec, 256, backend_config(case, work, a.redis_port))
    # LMCache's Redis backend cannot remove a key: on Redis the last round's go by a
    # FLUSHALL, for both.
    removes = "redis" not in case
    be, cpu = lm.backend, lm.cpu
    data = [torch.randn((2, a.layers, 256, 1024)).half() for _ in range(a.chunks)]
    x = torch.zeros(64)
    rounds: list[dict[str, float]] = []
    keys: list[Any] = []
    for r in range(a.rounds + 1):  # the first warms up
        for k in keys if removes else []:
            be.remove(k)
        if not removes:
            subprocess.run(["redis-cli", "-p", str(a.redis_port), "flushall"], check=True)
        keys, objs = chunk_round(cpu, data, r)
        os.sync()
        time.sleep(0.2)
        # The engine's thread alone for 50 ms: its rate with nothing beside it.
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.05:
            x.add_(1)
            n += 1
        idle = n / (time.perf_counter() - t0)
        done = threading.Event()
        span: list[float] = []
        lat: list[float] = []
        th = threading.Thread(target=store, args=(be, keys, objs, span, done))
        t0 = time.perf_counter()
        th.start()
        while not done.is_set():
            s = time.perf_counter()
            x.add_(1)
            lat.append(time.perf_counter() - s)
        th.join()
        wall = time.perf_counter() - t0
        for o in objs:
            o.ref_count_down()
        lat.sort()
        if r:
            rounds.append(
                {
                    "ops": len(lat) / wall,
                    # what the store cost the engine's thread, in operations
                    "lost": idle * wall - len(lat),
                    "p99": lat[int(len(lat) * 0.99)],
                    "store": span[0],
                }
            )
    print(json.dumps(rounds), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    os._exit(0)  # LMCache leaves non-daemon threads behind


def fmt(v: tuple[float, float, float], unit: str = "") -> str:
    return f"{v[0]:.0f}{unit} ({v[1]:.0f}-{v[2]:.0f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=32, help="256-token chunks per store")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=8, help="stores per process")
    ap.add_argument("--turns", type=int, default=2, help="processes per backend")
    ap.add_argument("--one-case", help=argparse.SUPPRESS)
    ap.add_argument("--redis-port", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one_case:
        one_case(a.one_case, a)
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", "OMP_WAIT_POLICY": "passive"}
    got: dict[str, list[dict[str, float]]] = {name: [] for name in CASES}
    work = Path(tempfile.mkdtemp(prefix="bench-engine-redis-"))
    redis = RedisProc(work / "redis").start()
    port = redis.port
    try:
        for _ in range(a.turns):
            for name, case in CASES.items():
                subprocess.run(["redis-cli", "-p", str(port), "flushall"], capture_output=True)
                argv = [sys.executable, __file__, "--one-case", case, "--redis-port", str(port)]
                for opt in ("chunks", "layers", "rounds"):
                    argv += [f"--{opt}", str(getattr(a, opt))]
                p = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env)
                if p.returncode != 0:
                    raise SystemExit(f"{name} failed: {p.stderr[-2000:]}")
                got[name] += json.loads(p.stdout.strip().splitlines()[-1])
    finally:
        redis.stop()
        shutil.rmtree(work, ignore_errors=True)

    def med(name: str, k: str, scale: float) -> tuple[float, float, float]:
        v = [r[k] * scale for r in got[name]]
        return statistics.median(v), min(v), max(v)

    rows = []
    for name, case in CASES.items():
        ref = REFERENCE[case.split(":")[1] if case.startswith("lmcache") else case.split(":")[0]]
        ref_ops, ref_store = med(ref, "ops", 1)[0], med(ref, "store", 1)[0]
        ops, p99, store = med(name, "ops", 1e-3), med(name, "p99", 1e6), med(name, "store", 1e3)
        lost, ref_lost = med(name, "lost", 1e-3), med(ref, "lost", 1e-3)[0]
        rows.append(
            [
                name,
                fmt(ops, "k"),
                f"{ops[0] * 1e3 / ref_ops:.2f}x",
                fmt(p99),
                fmt(lost, "k"),
                f"{lost[0] / ref_lost:.2f}x",
                fmt(store),
                f"{ref_store * 1e3 / store[0]:.2f}x",
            ]
        )
    print(f"{a.chunks} chunks of 256 tokens x {a.layers} layers a store; {a.turns} processes")
    print(f"per backend, {a.rounds} stores each; medians (range)\n")
    print(
        table(
            [
                "backend",
                "engine ops/s during the store",
                "x LMCache",
                "p99 of one op, us",
                "engine ops lost to the store",
                "x LMCache",
                "store, ms",
                "store speed x LMCache",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
