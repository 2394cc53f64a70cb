#!/usr/bin/env python
"""Benchmark of the tiered store (issue C).

Put and retrieve GB/s per tier on the batch of bench_format/bench_paging (32 sequences
x 2048 tokens, 8 kv heads x 128, fp16, page 16, half of every sequence shared; 4
layers), beside references measured in the same run on the same bytes:

- cpu tier: memcpy of the same bytes into a preallocated buffer;
- disk tier: raw Python file write + read of the same objects, same fsync setting;
- redis tier: raw redis-py (asyncio, the client the tier uses) SET / GET of the same
  objects; the sync client is shown too;
- LMCache 0.5.6's own LocalDiskBackend and Redis RemoteBackend on the same KV, in its
  256-token chunks (keys chain over the prefix, so shared chunks are stored once).

Then bytes stored on a shared-prefix workload (64 requests, a 1500-token system prompt,
each a distinct 500-token tail) against the bytes of its distinct pages and against
LMCache's chunked disk store; and the read amplification of retrieving one sequence of a
32-sequence segment from disk.

    .venv/bin/python tools/bench_store.py [--layers 4] [--seqs 32] [--no-lmcache]

A redis-server is started on a free loopback port (Debian's redis-server must be
installed). Disk numbers read from the page cache (no root to drop it), as LMCache's do.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _bench import gbps, table  # noqa: E402

from hurray_store import KVSpec, PagedKVPool  # noqa: E402
from hurray_store.store import TieredStore, open_store  # noqa: E402

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")


# ---------------------------------------------------------------------- setup


def free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = int(s.getsockname()[1])
        if p < 55000:
            return p


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
    )
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    raise SystemExit("redis-server did not start")


def make_batch(spec: KVSpec, seqs: int, tokens: int) -> tuple[PagedKVPool, list[list[int]], list[list[int]], int]:
    P = spec.page_size
    per_seq = tokens // P
    shared = per_seq // 2
    distinct = shared + seqs * (per_seq - shared)
    rng = np.random.default_rng(0)
    phys = rng.permutation(distinct * 2)[:distinct].tolist()
    tables = [phys[:shared] + phys[shared + s * (per_seq - shared) : shared + (s + 1) * (per_seq - shared)] for s in range(seqs)]
    toks = [list(range(shared * P)) + [10_000 + s] * ((per_seq - shared) * P) for s in range(seqs)]
    pool = PagedKVPool(spec, distinct * 2)
    for t in pool.layers:
        t.normal_()
    return pool, toks, tables, distinct


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ---------------------------------------------------------------------- ours


async def ours(cfg: dict[str, Any], pool: PagedKVPool, toks: list[list[int]], tables: list[list[int]], reopen: bool) -> tuple[float, float, TieredStore]:
    store = await open_store(cfg)
    # Warm up with the same batch under other tokens: the store's staging buffers are
    # resident afterwards, as in a serving process (the references reuse theirs too).
    warm = [[t + 1 for t in seq] for seq in toks]
    await store.put(pool, warm, tables)
    await store.flush()
    t0 = time.perf_counter()
    await store.put(pool, toks, tables)
    await store.flush()
    t_put = time.perf_counter() - t0
    if reopen:
        await store.close()
        store = await open_store(cfg)
    dst = PagedKVPool(pool.spec, pool.num_blocks)
    for t in dst.layers:
        t.zero_()  # resident, as an engine's pool is
    got = await store.retrieve(dst, warm)
    dst.free([p for t in got.block_tables for p in t])
    t0 = time.perf_counter()
    got = await store.retrieve(dst, toks)
    t_get = time.perf_counter() - t0
    assert got.num_tokens == [len(t) for t in toks], got.num_tokens
    # spot-check bytes
    s = len(toks) // 2
    assert torch.equal(dst.layers[0][:, got.block_tables[s][-1]], pool.layers[0][:, tables[s][-1]])
    return t_put, t_get, store


async def segment_objects(store: TieredStore) -> list[bytes]:
    """The bytes of the measured segment's objects (manifest included), for references."""
    out = []
    tier = store.tiers[0]
    for g in store.policy.groups(0)[-1:]:
        for k in store.policy.group_keys(0, g):
            b = await tier.get(k)
            assert b is not None
            out.append(bytes(b) if not isinstance(b, torch.Tensor) else bytes(b.numpy()))
    return out


def ref_memcpy(objs: list[bytes]) -> tuple[float, float]:
    bufs = [bytearray(len(o)) for o in objs]
    for b, o in zip(bufs, objs, strict=True):
        b[:] = o  # fault in
    t0 = time.perf_counter()
    for b, o in zip(bufs, objs, strict=True):
        memoryview(b)[:] = o
    t = time.perf_counter() - t0
    return t, t


def ref_files(objs: list[bytes], root: Path, fsync: bool) -> tuple[float, float]:
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for i, o in enumerate(objs):
        tmp, dst = root / f".tmp{i}", root / f"o{i}"
        with open(tmp, "wb") as f:
            f.write(o)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, dst)
    t_put = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(len(objs)):
        with open(root / f"o{i}", "rb") as f:
            f.read()
    return t_put, time.perf_counter() - t0


async def ref_redis_async(objs: list[bytes], port: int) -> tuple[float, float]:
    import redis.asyncio as aioredis

    r = aioredis.Redis(port=port, socket_read_size=1 << 20)
    t0 = time.perf_counter()
    for i, o in enumerate(objs):
        await r.set(f"ref:{i}", o)
    t_put = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(len(objs)):
        await r.get(f"ref:{i}")
    t_get = time.perf_counter() - t0
    await r.delete(*[f"ref:{i}" for i in range(len(objs))])
    await r.aclose()
    return t_put, t_get


def ref_redis_sync(objs: list[bytes], port: int) -> tuple[float, float]:
    import redis

    r = redis.Redis(port=port)
    t0 = time.perf_counter()
    for i, o in enumerate(objs):
        r.set(f"ref:{i}", o)
    t_put = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(len(objs)):
        r.get(f"ref:{i}")
    t_get = time.perf_counter() - t0
    r.delete(*[f"ref:{i}" for i in range(len(objs))])
    r.close()
    return t_put, t_get


# ---------------------------------------------------------------------- LMCache


class LMCacheBackend:
    """LMCache 0.5.6's own storage backend (disk or Redis), driven directly."""

    def __init__(self, spec: KVSpec, chunk: int, extra: dict[str, Any]) -> None:
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend import CreateStorageBackends

        self.spec, self.chunk = spec, chunk
        cfg = LMCacheEngineConfig.from_dict({"chunk_size": chunk, "local_cpu": False, "max_local_cpu_size": 3.0, **extra})
        md = LMCacheMetadata(
            model_name="bench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
            kv_dtype=spec.dtype, kv_shape=(spec.num_layers, 2, chunk, spec.num_kv_heads, spec.head_dim),
        )
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        backends = CreateStorageBackends(cfg, md, self.loop)
        self.cpu = backends["LocalCPUBackend"]
        self.backend = next(v for k, v in backends.items() if k != "LocalCPUBackend")

    def chunks(self, pool: PagedKVPool, toks: list[list[int]], tables: list[list[int]]) -> list[tuple[Any, torch.Tensor]]:
        """(key, [2, L, T, H*D]) per chunk; the key chains over the prefix's tokens, as
        LMCache's token database does, so shared chunks get equal keys."""
        from lmcache.utils import CacheEngineKey

        spec, T, P = self.spec, self.chunk, self.spec.page_size
        out = []
        seen = set()
        for s, tk in enumerate(toks):
            prev = 0
            for c in range(0, len(tk), T):
                n = min(T, len(tk) - c)
                prev = hash((prev, tuple(tk[c : c + n])))
                if prev in seen:
                    continue
                seen.add(prev)
                pages = tables[s][c // P : -(-(c + n) // P)]
                hd = spec.num_kv_heads * spec.head_dim
                kv = torch.stack(
                    [torch.stack([pool.layers[li][r, pages].reshape(-1, hd)[:n] for li in range(spec.num_layers)]) for r in range(2)]
                )
                out.append((CacheEngineKey("bench", 1, 0, prev, spec.dtype), kv))
        return out

    def put(self, chunks: list[tuple[Any, torch.Tensor]]) -> float:
        from lmcache.v1.memory_management import MemoryFormat

        objs = []
        for _, kv in chunks:
            o = self.cpu.allocate(kv.shape, kv.dtype, MemoryFormat.KV_2LTD)
            o.tensor.copy_(kv)
            objs.append(o)
        keys = [k for k, _ in chunks]
        t0 = time.perf_counter()
        self.backend.batched_submit_put_task(keys, objs)
        while not all(self.backend.contains(k) for k in keys):
            time.sleep(0.0005)
        dt = time.perf_counter() - t0
        for o in objs:
            o.ref_count_down()
        return dt

    def get(self, chunks: list[tuple[Any, torch.Tensor]]) -> float:
        t0 = time.perf_counter()
        got = [self.backend.get_blocking(k) for k, _ in chunks]
        dt = time.perf_counter() - t0
        assert all(g is not None for g in got)
        assert torch.equal(got[-1].tensor, chunks[-1][1])
        for g in got:
            g.ref_count_down()
        return dt


# ---------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--no-lmcache", action="store_true")
    a = ap.parse_args()
    spec = KVSpec("bench", a.layers, 8, 128, 16, torch.float16)
    pool, toks, tables, distinct = make_batch(spec, a.seqs, a.tokens)
    nbytes = distinct * spec.page_bytes * 2 * a.layers
    work = Path(tempfile.mkdtemp(prefix="bench-store-"))
    redis_proc, port = start_redis(work)
    rows: list[list[object]] = []

    def row(name: str, t_put: float, t_get: float, ref_put: float, ref_get: float, ref: str) -> None:
        rows.append([name, f"{gbps(nbytes, t_put):.2f}", f"{gbps(nbytes, t_get):.2f}", ref,
                     f"{gbps(nbytes, ref_put):.2f}", f"{gbps(nbytes, ref_get):.2f}",
                     f"{ref_put / t_put:.2f}", f"{ref_get / t_get:.2f}"])

    try:
        big = 1 << 36
        # cpu
        cpu_cfg = {"tiers": [{"type": "cpu", "capacity_bytes": 3 * nbytes, "preallocate": True}]}
        p, g, store = asyncio.run(ours(cpu_cfg, pool, toks, tables, False))
        objs = asyncio.run(segment_objects(store))
        rp, rg = ref_memcpy(objs)
        row("cpu tier", p, g, rp, rg, "memcpy")
        del store
        # disk, with and without fsync
        for fs in (False, True):
            d = work / f"disk-{fs}"
            cfg = {"tiers": [{"type": "disk", "path": str(d), "capacity_bytes": big, "fsync": fs}], "policy": {"promote_on_hit": False}}
            p, g, store = asyncio.run(ours(cfg, pool, toks, tables, True))
            rp, rg = ref_files(objs, work / f"ref-{fs}", fs)
            row(f"disk tier, fsync={str(fs).lower()}", p, g, rp, rg, "file write+read")
            shutil.rmtree(d)
            shutil.rmtree(work / f"ref-{fs}")
        # redis
        cfg = {"tiers": [{"type": "redis", "url": f"redis://127.0.0.1:{port}/0"}], "policy": {"promote_on_hit": False}}
        p, g, store = asyncio.run(ours(cfg, pool, toks, tables, True))
        rp, rg = asyncio.run(ref_redis_async(objs, port))
        row("redis tier", p, g, rp, rg, "redis-py asyncio SET/GET")
        sp_, sg_ = ref_redis_sync(objs, port)
        row("redis tier", p, g, sp_, sg_, "redis-py sync SET/GET")
        subprocess.run(["redis-cli", "-p", str(port), "flushall"], capture_output=True)

        lm_rows: list[list[object]] = []
        if not a.no_lmcache:
            chunk = 256
            lmd = LMCacheBackend(spec, chunk, {"local_disk": f"file://{work}/lmc-disk/", "max_local_disk_size": 16.0})
            chunks = lmd.chunks(pool, toks, tables)
            lm_bytes = sum(kv.numel() * kv.element_size() for _, kv in chunks)
            lp, lg = lmd.put(chunks), lmd.get(chunks)
            d = work / "disk-cmp"
            cfg = {"tiers": [{"type": "disk", "path": str(d), "capacity_bytes": big}], "policy": {"promote_on_hit": False}}
            p, g, _ = asyncio.run(ours(cfg, pool, toks, tables, True))
            lm_rows.append(["disk", f"{gbps(lm_bytes, lp):.2f}", f"{gbps(lm_bytes, lg):.2f}", f"{gbps(nbytes, p):.2f}", f"{gbps(nbytes, g):.2f}",
                            f"{gbps(nbytes, p) / gbps(lm_bytes, lp):.2f}", f"{gbps(nbytes, g) / gbps(lm_bytes, lg):.2f}"])
            lmr = LMCacheBackend(spec, chunk, {"remote_url": f"redis://127.0.0.1:{port}", "remote_serde": "naive"})
            lp, lg = lmr.put(chunks), lmr.get(chunks)
            subprocess.run(["redis-cli", "-p", str(port), "flushall"], capture_output=True)
            cfg = {"tiers": [{"type": "redis", "url": f"redis://127.0.0.1:{port}/0"}], "policy": {"promote_on_hit": False}}
            p, g, _ = asyncio.run(ours(cfg, pool, toks, tables, True))
            lm_rows.append(["redis", f"{gbps(lm_bytes, lp):.2f}", f"{gbps(lm_bytes, lg):.2f}", f"{gbps(nbytes, p):.2f}", f"{gbps(nbytes, g):.2f}",
                            f"{gbps(nbytes, p) / gbps(lm_bytes, lp):.2f}", f"{gbps(nbytes, g) / gbps(lm_bytes, lg):.2f}"])
            subprocess.run(["redis-cli", "-p", str(port), "flushall"], capture_output=True)

        # shared-prefix workload: bytes stored
        wl = shared_prefix_workload(spec, work, not a.no_lmcache)
        # read amplification
        amp = asyncio.run(read_amplification(spec, work))
    finally:
        redis_proc.kill()
        shutil.rmtree(work, ignore_errors=True)

    print(f"\n{a.layers} layers, {a.seqs} seqs x {a.tokens} tokens, fp16 8x128, page 16: "
          f"{distinct} distinct pages, {nbytes / 2**20:.0f} MiB; GB/s of distinct page bytes\n")
    print(table(["tier", "put GB/s", "retrieve GB/s", "reference", "ref put", "ref get", "put x ref", "retrieve x ref"], rows))
    if lm_rows:
        print("\nLMCache 0.5.6's own backend on the same KV (256-token chunks, each distinct chunk once)\n")
        print(table(["tier", "LMCache put", "LMCache get", "ours put", "ours retrieve", "put x LMCache", "retrieve x LMCache"], lm_rows))
    print("\nShared-prefix workload: 64 requests, 1500-token system prompt + distinct 500-token tails\n")
    print(table(["store", "bytes stored", "x distinct pages"], wl))
    print("\nRead amplification: one sequence of a 32-sequence segment, from disk\n")
    print(table(["quantity", "value"], amp))


def shared_prefix_workload(spec: KVSpec, work: Path, lmcache: bool) -> list[list[object]]:
    P = spec.page_size
    n_req, sys_len, tail = 64, 1500, 500
    total = sys_len + tail
    shared_full = sys_len // P
    own = -(-total // P) - shared_full
    pool = PagedKVPool(spec, shared_full + n_req * own)
    for t in pool.layers:
        t.normal_()
    shared = pool.allocate(shared_full)
    toks, tables = [], []
    for r in range(n_req):
        toks.append(list(range(sys_len)) + [20_000 + r * tail + i for i in range(tail)])
        tables.append(shared + pool.allocate(own))
    distinct_full = shared_full + n_req * (total // P - shared_full)
    distinct_bytes = distinct_full * spec.page_bytes * 2 * spec.num_layers
    d = work / "wl"

    async def run() -> int:
        cfg = {"tiers": [{"type": "disk", "path": str(d), "capacity_bytes": 1 << 36}]}
        async with await open_store(cfg) as store:
            for r in range(n_req):  # requests arrive one by one
                await store.put(pool, [toks[r]], [tables[r]])
        return dir_bytes(d / "objects")

    ours_bytes = asyncio.run(run())
    rows: list[list[object]] = [
        ["distinct full pages (reference)", f"{distinct_bytes / 2**20:.1f} MiB", "1.00"],
        ["hurray_store disk tier (objects + manifests)", f"{ours_bytes / 2**20:.1f} MiB", f"{ours_bytes / distinct_bytes:.3f}"],
    ]
    if lmcache:
        lm = LMCacheBackend(spec, 256, {"local_disk": f"file://{work}/wl-lmc/", "max_local_disk_size": 16.0})
        chunks = lm.chunks(pool, toks, tables)
        lm.put(chunks)
        lb = dir_bytes(work / "wl-lmc")
        rows.append(["LMCache LocalDiskBackend (256-token chunks)", f"{lb / 2**20:.1f} MiB", f"{lb / distinct_bytes:.3f}"])
    return rows


async def read_amplification(spec: KVSpec, work: Path) -> list[list[object]]:
    pool, toks, tables, _ = make_batch(spec, 32, 2048)
    d = work / "amp"
    cfg = {"tiers": [{"type": "disk", "path": str(d), "capacity_bytes": 1 << 36}], "policy": {"promote_on_hit": False}}
    async with await open_store(cfg) as store:
        r = await store.put(pool, toks, tables)
        assert r.segments == 1
    async with await open_store(cfg) as store:
        dst = PagedKVPool(spec, 256)
        got = await store.retrieve(dst, [toks[7]])
    return [
        ["pages delivered", str(len(got.block_tables[0]))],
        ["bytes delivered", f"{got.bytes_delivered / 2**20:.2f} MiB"],
        ["bytes read from the tier", f"{got.bytes_read / 2**20:.2f} MiB"],
        ["read amplification (target <= 1.1)", f"{got.bytes_read / got.bytes_delivered:.3f}"],
    ]


if __name__ == "__main__":
    main()
    os._exit(0)  # LMCache's backends keep non-daemon threads
