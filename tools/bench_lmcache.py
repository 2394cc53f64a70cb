#!/usr/bin/env python
"""Benchmark of the LMCache integration.

Part 1, the in-process engine's storage backends (``CreateStorageBackends``):
the same KV chunks go through LMCache's LocalDiskBackend, its Redis RemoteBackend, and
the hurray_store plugin over a disk tier and over a Redis tier. Store means submit until
the backend reports the chunk; retrieve means ``batched_get_blocking`` of all the chunks
(what LMCache's engine calls on a retrieve), and get one by one a ``get_blocking`` of each
chunk in turn. Each backend runs in a process of its own, 3 times (``--turns``), the
backends taken in turn. Reported: GB/s (the median and range of every round) and bytes
stored.

Part 2, ``lmcache server``'s L2 adapters, each under ``lmcache bench l2`` with the same
parameters: LMCache's ``fs`` and ``resp`` adapters, and HurrayL2Adapter over a disk tier
and over a Redis tier. Store and load MB/s, as the tool reports them; beside them, the
same Redis through plain sockets (SET and GET of the same values over 4 connections, no
protocol library, no checks), the most any client of that server gets here.

    LMCACHE_TRACK_USAGE=false .venv/bin/python tools/bench_lmcache.py [--chunks 32] [--layers 8]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _bench import gbps, table  # noqa: E402
from bench_store import LMCacheBackend, chunk_round, dir_bytes  # noqa: E402

from hurray_store import KVSpec  # noqa: E402
from hurray_store.testing.services import RedisProc  # noqa: E402

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")


def run_backend(
    cpu: Any, backend: Any, data: list[torch.Tensor], rounds: int, evict: bool
) -> dict[str, list[float]]:
    """Put every chunk, look them up with pins (then unpin each), get them all in one
    batched get, then one by one, ``rounds`` times, each round under fresh keys; the
    seconds of each step of each round, and the CPU seconds (user, system) the process
    spent on each store.

    With ``evict`` (the disk backends), each round first removes the previous round's
    chunks, as a cache at its capacity evicts as much as it stores (an unmeasured round
    comes first, so every measured one follows a removal): the writes then land in
    page-cache pages the kernel has just freed. This machine's VM hands the
    memory it frees back to the host (free page reporting), and writing 256 MiB into
    pages faulted in afresh from the host ran at 0.5-0.7 GB/s here against 2.9-3.9
    into recycled ones (one 8 MiB ``write`` per file, both ways): without the removals
    that, not the backend, decided which rounds were fast. (LMCache's Redis backend
    cannot remove a key, so neither Redis backend does.)"""

    secs: dict[str, list[float]] = {
        "store": [],
        "lookup": [],
        "retrieve": [],
        "get one by one": [],
    }
    used: dict[str, list[float]] = {"store user": [], "store system": []}
    keys: list[Any] = []
    first = 1 if evict else 0
    for r in range(first + rounds):
        for k in keys if evict else []:
            backend.remove(k)
        keys, objs = chunk_round(cpu, data, r)
        os.sync()
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        backend.batched_submit_put_task(keys, objs)
        while not all(backend.contains(k) for k in keys):
            time.sleep(0.0005)
        secs["store"].append(time.perf_counter() - t0)
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        used["store user"].append(ru1.ru_utime - ru0.ru_utime)
        used["store system"].append(ru1.ru_stime - ru0.ru_stime)
        for o in objs:
            o.ref_count_down()
        # What LMCache's engine does on vLLM's lookup of a prompt: the chunks up to the
        # first miss, pinned, then each let go once the prompt's KV is loaded.
        t0 = time.perf_counter()
        hits = backend.batched_contains(keys, True)
        for k in keys[:hits]:
            backend.unpin(k)
        secs["lookup"].append(time.perf_counter() - t0)
        assert hits == len(keys), "a lookup missed a stored chunk"
        # Each get's chunks are compared with what was stored once both gets are done:
        # ``torch.equal`` is a parallel torch operation, after which torch's OpenMP
        # worker spins on a core for milliseconds (libgomp's default), and a check
        # between the two gets took that core from the second (below, `--omp-passive`).
        gots = []
        for op, get in (
            ("retrieve", backend.batched_get_blocking),
            ("get one by one", lambda ks: [backend.get_blocking(k) for k in ks]),
        ):
            t0 = time.perf_counter()
            got = get(keys)
            secs[op].append(time.perf_counter() - t0)
            gots.append(got)
            assert all(g is not None for g in got), f"{op}: a chunk was not found"
        for got in gots:
            assert all(torch.equal(g.tensor, d) for g, d in zip(got, data, strict=True)), (
                "a chunk came back different"
            )
            for g in got:
                g.ref_count_down()
    return {op: ts[first:] for op, ts in {**secs, **used}.items()}


def child_env(a: argparse.Namespace) -> dict[str, str]:
    """The environment of the processes that run the backends and adapters: with
    ``--omp-passive``, OpenMP's idle threads sleep at once (``OMP_WAIT_POLICY=passive``)
    rather than spin on the cores for a while after each of torch's parallel
    operations, such as the bench's zeroing of its load buffers before each round."""
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1"}
    if a.omp_passive:
        env["OMP_WAIT_POLICY"] = "passive"
    return env


def run_case(extra: dict[str, Any], a: argparse.Namespace, evict: bool) -> dict[str, list[float]]:
    """One backend in a process of its own (no backend's leftovers slow another: a
    closed LMCache Redis backend leaves a thread blocked in its close), through LMCache's
    own loader; the seconds of each step of each round."""
    argv = [sys.executable, __file__, "--one-case", json.dumps(extra)]
    argv += ["--evict"] if evict else []
    for opt in ("chunks", "layers", "heads", "dim", "chunk_size", "rounds"):
        argv += [f"--{opt.replace('_', '-')}", str(getattr(a, opt))]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=child_env(a))
    if p.returncode != 0:
        raise SystemExit(f"backend run failed: {p.stderr[-2000:]}")
    got: dict[str, list[float]] = json.loads(p.stdout.strip().splitlines()[-1])
    return got


def one_case(extra: dict[str, Any], a: argparse.Namespace) -> None:
    spec = KVSpec("bench", a.layers, a.heads, a.dim, 16, torch.float16)
    lm = LMCacheBackend(spec, a.chunk_size, extra)
    secs = run_backend(lm.cpu, lm.backend, chunk_data(a), a.rounds, a.evict)
    if hasattr(lm.backend, "flush"):
        lm.backend.flush()
    print(json.dumps(secs), flush=True)
    os._exit(0)  # LMCache leaves non-daemon threads behind


def chunk_data(a: argparse.Namespace) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn((2, a.layers, a.chunk_size, a.heads * a.dim), generator=g).half()
        for _ in range(a.chunks)
    ]


def spread(rates: list[float], fmt: str) -> list[str]:
    """The median of ``rates`` and their range, as table cells."""
    return [f"{statistics.median(rates):{fmt}}", f"{min(rates):{fmt}}-{max(rates):{fmt}}"]


def ratios(
    rates: dict[str, dict[str, list[float]]], pairs: tuple[tuple[str, str, str], ...]
) -> list[list[object]]:
    """Per ``(label, reference, ours)``: ours over the reference, median over median, for
    each operation."""
    return [
        [label, *(ratio(rates, ref, ours, op) for op in rates[ref])]
        for label, ref, ours in pairs
        if ref in rates
    ]


def ratio(rates: dict[str, dict[str, list[float]]], ref: str, ours: str, op: str) -> str:
    """``ours`` over ``ref`` for ``op``, median over median ("-" where either is missing)."""
    if ref not in rates or ours not in rates:
        return "-"
    return f"{statistics.median(rates[ours][op]) / statistics.median(rates[ref][op]):.2f}"


def verify_cost(
    results: dict[str, dict[str, list[float]]],
    floor: dict[str, float],
    writes: dict[str, float],
    l2: dict[str, dict[str, list[float]]],
) -> list[list[object]]:
    """Per row that verification slows: the machine's raw operation hashed over plain
    (measured in this run), and ours over LMCache's own on it (medians)."""
    disk = ("LMCache LocalDiskBackend", "hurray_store plugin, disk tier")
    redis = ("LMCache resp (Redis)", "hurray_store, redis tier")
    rows: list[list[object]] = []
    if floor and writes:
        rows += [
            [
                "page cache write, one thread per core (plugin, disk store)",
                f"{writes['removed, threads + xxh3'] / writes['removed, threads']:.2f}",
                ratio(results, *disk, "store"),
            ],
            [
                "page cache read, one thread per core (plugin, disk retrieve)",
                f"{floor['read + xxh3'] / floor['read']:.2f}",
                ratio(results, *disk, "retrieve"),
            ],
            [
                "page cache read, one file at a time (plugin, disk one by one)",
                f"{floor['one at a time, read + xxh3'] / floor['one at a time, read']:.2f}",
                ratio(results, *disk, "get one by one"),
            ],
        ]
    if _REDIS_FLOOR in l2:
        for op, what in (("store", "SET (L2, Redis store)"), ("load", "GET (L2, Redis load)")):
            rows.append(
                [
                    f"Redis {what}, plain sockets",
                    ratio(l2, _REDIS_FLOOR, _REDIS_FLOOR_H, op),
                    ratio(l2, *redis, op),
                ]
            )
    return rows


def page_cache_floor(files: list[Path], rounds: int = 5) -> dict[str, float]:
    """What this machine allows for reads of ``files`` from the page cache (GB/s, median
    of ``rounds``).

    A batched retrieve, one thread per core: one ``readinto`` per file (what LMCache's
    disk backend does), and reads of 512 KiB each hashed with xxh3 as it comes in (the
    least a verified read costs).

    One file at a time, each into its own buffer (the bench's gets one by one, which keep
    every chunk until the last is in): one ``readinto`` per file from one thread
    (LMCache's get), and the file's 512 KiB pieces hashed as they come in, from one
    thread, and shared by one thread per core (the pieces taken in turn by whichever is
    free, as ours does); the faster of the two hashed ways is the floor of a verified
    get."""
    import xxhash

    bufs = [bytearray(f.stat().st_size) for f in files]
    piece = 512 << 10
    threads = os.cpu_count() or 2

    def plain(i: int) -> None:
        with open(files[i], "rb", buffering=0) as fh:
            fh.readinto(bufs[i])

    def pieces(fd: int, mv: memoryview, offs: Any) -> None:
        for off in offs:
            os.preadv(fd, [mv[off : off + piece]], off)
            xxhash.xxh3_64_intdigest(mv[off : off + piece])

    def hashed(i: int) -> None:
        fd = os.open(files[i], os.O_RDONLY)
        try:
            pieces(fd, memoryview(bufs[i]), range(0, len(bufs[i]), piece))
        finally:
            os.close(fd)

    def shared(i: int, pool: ThreadPoolExecutor) -> None:
        """File ``i``'s pieces taken in turn by the caller and the pool's threads."""
        fd = os.open(files[i], os.O_RDONLY)
        try:
            mv = memoryview(bufs[i])
            offs = iter(range(0, len(mv), piece))  # next() on it is atomic
            helpers = [pool.submit(pieces, fd, mv, offs) for _ in range(threads - 1)]
            pieces(fd, mv, offs)
            for h in helpers:
                h.result()
        finally:
            os.close(fd)

    nbytes = sum(len(b) for b in bufs)
    out = {}
    with ThreadPoolExecutor(threads) as pool:
        for name, fn in (
            ("read", lambda: list(pool.map(plain, range(len(files))))),
            ("read + xxh3", lambda: list(pool.map(hashed, range(len(files))))),
            ("one at a time, read", lambda: [plain(i) for i in range(len(files))]),
            (
                "one at a time, read + xxh3, 1 thread",
                lambda: [hashed(i) for i in range(len(files))],
            ),
            (
                "one at a time, read + xxh3, threads",
                lambda: [shared(i, pool) for i in range(len(files))],
            ),
        ):
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            out[name] = gbps(nbytes, statistics.median(times))
    out["one at a time, read + xxh3"] = max(
        out["one at a time, read + xxh3, 1 thread"], out["one at a time, read + xxh3, threads"]
    )
    return out


def page_cache_writes(folder: Path, files: int, size: int, rounds: int = 6) -> dict[str, float]:
    """Writes of ``files`` files of ``size`` bytes, each from its own source buffer (GB/s,
    median of ``rounds``): from one thread, one ``write`` a file, keeping every round's
    files (each round takes pages the kernel has not used lately: on a VM that reports
    freed memory to its host, they are faulted in afresh) and removing the previous
    round's files first (each round reuses the pages just freed); then, removing the
    last round's, one thread per core, plain and with each MiB hashed with xxh3 just
    before its ``write`` (the least a verified write costs: what the disk tier does)."""
    import xxhash

    bufs = [memoryview(os.urandom(size)) for _ in range(files)]
    step = 1 << 20

    def plain(f: Path, i: int) -> None:
        with open(f, "wb", buffering=0) as fh:
            fh.write(bufs[i])

    def hashed(f: Path, i: int) -> None:
        h = xxhash.xxh3_64()
        with open(f, "wb", buffering=0) as fh:
            for off in range(0, size, step):
                h.update(bufs[i][off : off + step])
                fh.write(bufs[i][off : off + step])

    cores = os.cpu_count() or 2
    out = {}
    for name, recycle, threads, write in (
        ("kept", False, 1, plain),
        ("removed", True, 1, plain),
        ("removed, threads", True, cores, plain),
        ("removed, threads + xxh3", True, cores, hashed),
    ):
        d = folder / "page-cache-writes"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        times, prev = [], []
        with ThreadPoolExecutor(threads) as pool:
            for r in range(rounds):
                for f in prev if recycle else []:
                    f.unlink()
                prev = [d / f"{r}-{i}" for i in range(files)]
                os.sync()
                t0 = time.perf_counter()
                list(pool.map(write, prev, range(files)))
                times.append(time.perf_counter() - t0)
        out[name] = gbps(files * size, statistics.median(times))
        shutil.rmtree(d)
    return out


def redis_floor(
    port: int, keys: int, size: int, rounds: int = 3, conns: int = 4
) -> dict[str, float]:
    """What the same Redis gives a client with no protocol library and no checks: SET
    and GET of ``keys`` values of ``size`` bytes over ``conns`` connections (one thread
    each; 4 was the best of 1-8 here), plain sockets, each value sent from and received
    into preallocated memory (MiB/s, the mean of ``rounds`` rounds' rates, as
    ``lmcache bench l2`` reports), received at most 256 KiB a ``recv_into``; and the
    same with each value hashed with xxh3 (the least verification costs): each value
    just before it is sent, each piece received as it comes in (what the Redis tier
    does)."""
    import itertools
    import socket

    import xxhash

    step = 256 << 10
    src = memoryview(bytearray(os.urandom(size)))
    dst = [memoryview(bytearray(size)) for _ in range(keys)]
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(conns)]

    def line(s: socket.socket) -> bytes:
        got = b""
        while not got.endswith(b"\r\n"):
            got += s.recv(1)
        return got

    def one_round(op: str, names: list[bytes], hashed: bool) -> float:
        todo = itertools.count()

        def work(s: socket.socket) -> None:
            while (i := next(todo)) < len(names):
                k = names[i]
                if op == "store":
                    s.sendall(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(k), k, size))
                    if hashed:
                        xxhash.xxh3_64_intdigest(src)
                    s.sendall(src)
                    s.sendall(b"\r\n")
                    assert line(s) == b"+OK\r\n"
                else:
                    s.sendall(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k))
                    assert line(s) == b"$%d\r\n" % size
                    have, h = 0, xxhash.xxh3_64() if hashed else None
                    while have < size:
                        got = s.recv_into(dst[i][have : have + step])
                        if h is not None:
                            h.update(dst[i][have : have + got])
                        have += got
                    assert s.recv(2, socket.MSG_WAITALL) == b"\r\n"

        t0 = time.perf_counter()
        with ThreadPoolExecutor(conns) as pool:
            list(pool.map(work, socks))
        return keys * size / (time.perf_counter() - t0) / 2**20

    out: dict[str, list[float]] = {}
    try:
        for r in range(rounds):  # plain and hashed rounds alternate
            for hashed in (False, True):
                names = [b"floor-%d-%d-%d" % (r, hashed, i) for i in range(keys)]
                for op in ("store", "load"):
                    name = f"{op} + xxh3" if hashed else op
                    out.setdefault(name, []).append(one_round(op, names, hashed))
    finally:
        for s in socks:
            s.close()
    return {op: statistics.mean(v) for op, v in out.items()}


def redis_bytes(port: int) -> int:
    out = subprocess.run(
        ["redis-cli", "-p", str(port), "--scan"], capture_output=True, text=True
    ).stdout.split()
    total = 0
    for k in out:
        total += int(
            subprocess.run(
                ["redis-cli", "-p", str(port), "strlen", k], capture_output=True, text=True
            ).stdout.strip()
            or 0
        )
    return total


_REDIS_FLOOR = "plain sockets to the Redis (4 conns)"
_REDIS_FLOOR_H = "the same, each value hashed (xxh3)"
# The reference of each of our backends in the lookup table.
_LOOKUP_REF = {
    "hurray_store plugin, disk tier": "LMCache LocalDiskBackend",
    "hurray_store plugin, redis tier": "LMCache RemoteBackend (Redis)",
}


def bench_l2(spec: dict[str, Any], args: argparse.Namespace, work: Path) -> dict[str, float]:
    out = work / "l2.json"
    cmd = [
        str(Path(sys.executable).parent / "lmcache"),
        "bench",
        "l2",
        "--l2-adapter",
        json.dumps(spec),
        "--no-skip-verify",
        "--num-keys",
        str(args.l2_keys),
        "--data-size-kb",
        str(args.l2_kb),
        "--rounds",
        "3",
        "--format",
        "json",
        "--output",
        str(out),
        "-q",
    ]
    p = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env=child_env(args),
        timeout=600,
    )
    if p.returncode != 0:
        raise SystemExit(f"lmcache bench l2 failed for {spec['type']}: {p.stderr[-2000:]}")
    m = json.loads(out.read_text())["metrics"]
    ops = {v["operation"]: v for k, v in m.items() if k.startswith("op_")}
    return {
        "store": ops["Store"]["throughput_avg_mbps"],
        "load": ops["Load"]["throughput_avg_mbps"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--l2-keys", type=int, default=32)
    ap.add_argument("--l2-kb", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3, help="put+get rounds per backend (part 1)")
    ap.add_argument(
        "--turns", type=int, default=3, help="runs of each backend, taken in turn (part 1)"
    )
    ap.add_argument("--l2-runs", type=int, default=5, help="`lmcache bench l2` runs per adapter")
    ap.add_argument(
        "--part", choices=["1", "2", "both"], default="both", help="in-process (1), L2 (2)"
    )
    ap.add_argument(
        "--omp-passive",
        action="store_true",
        help="run every backend and adapter with OMP_WAIT_POLICY=passive (idle OpenMP "
        "threads sleep instead of spinning after torch's parallel operations)",
    )
    ap.add_argument("--one-case", help=argparse.SUPPRESS)  # a child's backend (JSON)
    ap.add_argument("--evict", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one_case:
        one_case(json.loads(a.one_case), a)
    nbytes = a.chunks * 2 * a.layers * a.chunk_size * a.heads * a.dim * 2
    # Which LMCache the references are (a run from .venv-lmcache-next measures its
    # release candidate's own backends and adapters).
    print(f"LMCache {importlib.metadata.version('lmcache')} as the reference", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-lmcache-"))
    redis = RedisProc(work / "redis").start()
    port = redis.port
    rows: list[list[object]] = []
    results: dict[str, dict[str, list[float]]] = {}  # backend -> op -> GB/s per round
    floor: dict[str, float] = {}
    writes: dict[str, float] = {}
    cpu_ms: dict[str, dict[str, list[float]]] = {}  # backend -> user/system -> ms per store
    lookup_us: dict[str, dict[str, list[float]]] = {}  # backend -> "lookup" -> us each
    chunks: list[Path] = []
    try:
        plugin = {
            "storage_plugins": ["hurray"],
            "extra_config": {
                "storage_plugin.hurray.module_path": "hurray_store.adapters.lmcache",
                "storage_plugin.hurray.class_name": "HurrayStoragePlugin",
                "storage_plugin.hurray.config": str(work / "h.yaml"),
            },
        }
        cases = (
            []
            if a.part == "2"
            else [
                (
                    "LMCache LocalDiskBackend",
                    "disk",
                    {"local_disk": f"file://{work}/lmc-disk/", "max_local_disk_size": 16.0},
                    None,
                ),
                (
                    "hurray_store plugin, disk tier",
                    "disk",
                    plugin,
                    f"  - {{type: disk, path: {work}/h-disk, capacity_bytes: 17179869184}}\n",
                ),
                (
                    "LMCache RemoteBackend (Redis)",
                    "redis",
                    {"remote_url": f"redis://127.0.0.1:{port}", "remote_serde": "naive"},
                    None,
                ),
                (
                    "hurray_store plugin, redis tier",
                    "redis",
                    plugin,
                    f"  - {{type: redis, url: 'redis://127.0.0.1:{port}/0'}}\n",
                ),
            ]
        )
        # Each turn takes every backend in turn (each run in a fresh folder and an
        # empty Redis), so a slow spell of the machine falls on all of them alike.
        stored: dict[str, int] = {}
        for _ in range(a.turns if cases else 0):
            for name, tier, extra, tiers in cases:
                subprocess.run(["redis-cli", "-p", str(port), "flushall"], capture_output=True)
                for d in ("lmc-disk", "h-disk"):
                    shutil.rmtree(work / d, ignore_errors=True)
                if tiers:
                    (work / "h.yaml").write_text("tiers:\n" + tiers)
                secs = run_case(extra, a, evict=tier == "disk")
                stored[name] = (  # on disk the last round's chunks (each removes the last's)
                    redis_bytes(port) // a.rounds
                    if tier == "redis"
                    else dir_bytes(work / ("lmc-disk" if "LMCache" in name else "h-disk"))
                )
                if name == "hurray_store plugin, disk tier" and not floor:
                    chunks = sorted((work / "h-disk" / "objects").rglob("*%2Fc"))[: a.chunks]
                    floor = page_cache_floor(chunks)
                    writes = page_cache_writes(work, a.chunks, nbytes // a.chunks)
                for what in ("store user", "store system"):
                    cpu_ms.setdefault(name, {}).setdefault(what, []).extend(
                        t * 1e3 for t in secs.pop(what)
                    )
                lookup_us.setdefault(name, {}).setdefault("lookup", []).extend(
                    t * 1e6 for t in secs.pop("lookup")
                )
                for op, ts in secs.items():
                    results.setdefault(name, {}).setdefault(op, []).extend(
                        gbps(nbytes, t) for t in ts
                    )
        for name, ops in results.items():
            rows.append(
                [
                    name,
                    *(c for rates in ops.values() for c in spread(rates, ".2f")),
                    f"{stored[name] / 2**20:.1f}",
                ]
            )
        ratio_rows = ratios(
            results,
            (
                ("disk", "LMCache LocalDiskBackend", "hurray_store plugin, disk tier"),
                ("redis", "LMCache RemoteBackend (Redis)", "hurray_store plugin, redis tier"),
            ),
        )
        l2_rows: list[list[object]] = []
        l2: dict[str, dict[str, list[float]]] = {}
        (work / "l2.yaml").write_text(
            f"tiers:\n  - {{type: disk, path: {work}/l2-disk, capacity_bytes: 17179869184}}\n"
        )
        (work / "l2r.yaml").write_text(
            f"tiers:\n  - {{type: redis, url: 'redis://127.0.0.1:{port}/0'}}\n"
        )
        adapters = (
            ()
            if a.part == "1"
            else (
                ("LMCache fs", {"type": "fs", "base_path": str(work / "l2-fs")}),
                (
                    "hurray_store, disk tier",
                    {
                        "type": "plugin",
                        "module_path": "hurray_store.adapters.lmcache",
                        "class_name": "HurrayL2Adapter",
                        "adapter_params": {"config": str(work / "l2.yaml")},
                    },
                ),
                ("LMCache resp (Redis)", {"type": "resp", "host": "127.0.0.1", "port": port}),
                (
                    "hurray_store, redis tier",
                    {
                        "type": "plugin",
                        "module_path": "hurray_store.adapters.lmcache",
                        "class_name": "HurrayL2Adapter",
                        "adapter_params": {"config": str(work / "l2r.yaml")},
                    },
                ),
            )
        )
        # Runs alternate between the adapters (fs, ours on disk, resp, ours on Redis,
        # then again), so a slow spell of the machine falls on all of them alike.
        for _ in range(a.l2_runs):
            for name, spec in adapters:
                subprocess.run(["redis-cli", "-p", str(port), "flushall"], capture_output=True)
                shutil.rmtree(work / "l2-fs", ignore_errors=True)
                shutil.rmtree(work / "l2-disk", ignore_errors=True)
                got = bench_l2(spec, a, work)
                for op in ("store", "load"):
                    l2.setdefault(name, {}).setdefault(op, []).append(got[op])
            if not adapters:
                break
            # The same Redis through plain sockets, in the same turn: the server's limit.
            subprocess.run(["redis-cli", "-p", str(port), "flushall"], capture_output=True)
            got = redis_floor(port, a.l2_keys, a.l2_kb << 10)
            for op in ("store", "load"):
                l2.setdefault(_REDIS_FLOOR, {}).setdefault(op, []).append(got[op])
                l2.setdefault(_REDIS_FLOOR_H, {}).setdefault(op, []).append(got[f"{op} + xxh3"])
        for name, ops in l2.items():
            l2_rows.append([name, *spread(ops["store"], ".0f"), *spread(ops["load"], ".0f")])
        l2_ratio = ratios(
            l2,
            (
                ("disk", "LMCache fs", "hurray_store, disk tier"),
                ("redis", "LMCache resp (Redis)", "hurray_store, redis tier"),
            ),
        )
        l2_floor = ratios(
            l2,
            (
                ("LMCache resp", _REDIS_FLOOR, "LMCache resp (Redis)"),
                ("hurray_store, redis tier", _REDIS_FLOOR, "hurray_store, redis tier"),
            ),
        )
    finally:
        redis.stop()
        shutil.rmtree(work, ignore_errors=True)
    if a.omp_passive:
        print("\nevery backend and adapter ran with OMP_WAIT_POLICY=passive")
    if rows:
        print(
            f"\n{a.chunks} chunks of [2, {a.layers}, {a.chunk_size}, {a.heads * a.dim}] fp16 "
            f"({nbytes / 2**20:.0f} MiB); "
            f"in-process storage backends; median of {a.turns} runs x {a.rounds} rounds "
            "under fresh keys (on disk each after removing the last), the backends taken "
            "in turn, and their range\n"
        )
        print(
            table(
                [
                    "backend",
                    "store GB/s",
                    "store range",
                    "retrieve GB/s",
                    "retrieve range",
                    "one by one GB/s",
                    "one by one range",
                    "MiB stored per round",
                ],
                rows,
            )
        )
        print(
            "\nCPU time of the backend's process per store round, ms (median and range; "
            "a Redis server's own not included)\n"
        )
        print(
            table(
                ["backend", "user", "user range", "system", "system range"],
                [
                    [name, *(c for ms in use.values() for c in spread(ms, ".0f"))]
                    for name, use in cpu_ms.items()
                ],
            )
        )
        print("\nours x LMCache's own backend on the same tier\n")
        print(table(["tier", "store", "retrieve", "get one by one"], ratio_rows))
        print(
            f"\nlookup of the {a.chunks} stored chunks with pins, then an unpin of each (what "
            "LMCache's engine does on vLLM's lookup; LMCache's Redis backend pins nothing), "
            "us (median and range), and LMCache's own over ours (above 1: ours faster)\n"
        )
        print(
            table(
                ["backend", "us", "range", "LMCache's x ours"],
                [
                    # Times, not rates: ``ratio`` with ours as its reference gives
                    # LMCache's time over ours.
                    [name, *spread(us["lookup"], ".0f"), ratio(lookup_us, name, ref, "lookup")]
                    for name, us in lookup_us.items()
                    for ref in [_LOOKUP_REF.get(name, "")]
                ],
            )
        )
        if floor:
            print(
                f"\nthe machine's page cache, the plugin's {len(chunks)} chunk files, one "
                f"thread per core ({os.cpu_count()}): read {floor['read']:.2f} GB/s, read "
                f"and hashed {floor['read + xxh3']:.2f} GB/s "
                f"({floor['read + xxh3'] / floor['read']:.2f}x); {a.chunks} files of "
                f"{nbytes // a.chunks >> 20} MiB written from one thread: "
                f"{writes['kept']:.2f} GB/s keeping each round's files, "
                f"{writes['removed']:.2f} GB/s removing the last round's first; from one "
                f"thread per core, removing the last round's: {writes['removed, threads']:.2f} "
                f"GB/s, each MiB hashed just before its write "
                f"{writes['removed, threads + xxh3']:.2f} GB/s"
            )
            print(
                "the same files one at a time, each into its own buffer: one read each from one "
                f"thread {floor['one at a time, read']:.2f} GB/s; read and hashed in "
                f"pieces from one thread {floor['one at a time, read + xxh3, 1 thread']:.2f}, "
                f"from one thread per core {floor['one at a time, read + xxh3, threads']:.2f} "
                f"({floor['one at a time, read + xxh3'] / floor['one at a time, read']:.2f}x "
                "for the faster)"
            )
    if l2_rows:
        print(
            "\nlmcache server L2 adapters under `lmcache bench l2 --no-skip-verify` "
            f"({a.l2_keys} keys x {a.l2_kb} KiB, 3 rounds each); median of {a.l2_runs} "
            "runs, taken in turn, and their range\n"
        )
        print(table(["adapter", "store MB/s", "store range", "load MB/s", "load range"], l2_rows))
        print("\nours x LMCache's own adapter on the same medium (medians)\n")
        print(table(["medium", "store", "load"], l2_ratio))
        print("\neach Redis adapter x plain sockets to the same Redis (medians)\n")
        print(table(["adapter", "store", "load"], l2_floor))
    cost = verify_cost(results, floor, writes, l2)
    if cost:
        print(
            "\nwhat verifying costs on this machine: the raw operation with each byte hashed "
            "(xxh3, as ours does) x without, beside ours x LMCache's own (which verifies "
            "nothing)\n"
        )
        print(table(["operation", "raw, hashed x plain", "ours x LMCache's own"], cost))
    os._exit(0)  # LMCache leaves non-daemon threads behind


if __name__ == "__main__":
    main()
