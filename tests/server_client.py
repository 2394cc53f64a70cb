"""One engine process of the multi-client server tests (run as ``python -m
tests.server_client``): it puts batches whose pages are a pure function of their
tokens, retrieves them through a fresh store, and prints a JSON report.

Every page's KV is seeded by its page hash, so any process can say what any page must
hold, and a page put by one client and read by another is checked to the bit."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import torch

from hurray_store import KVSpec, PagedKVPool
from hurray_store import keys as keymod
from hurray_store.config import load_config
from hurray_store.store import TieredStore

SPEC = KVSpec(
    model="server-test", num_layers=2, num_kv_heads=2, head_dim=16, page_size=8, dtype=torch.float16
)
SYSTEM = list(range(1000, 1064))  # 8 pages every client shares


def batches(client: int, rounds: int) -> list[list[list[int]]]:
    """Per round, 3 sequences: the system prompt, a topic shared with the other clients
    (3 topics), then a tail of the client's own."""
    out = []
    for r in range(rounds):
        topic = [2000 + 100 * (r % 3) + i for i in range(24)]
        seqs = []
        for j in range(3):
            tail = [10_000 * (client + 1) + 100 * r + 10 * j + i for i in range(13 + 8 * j)]
            seqs.append(SYSTEM + topic + tail)
        out.append(seqs)
    return out


def page_kv(h: bytes, layer: int) -> torch.Tensor:
    g = torch.Generator().manual_seed((int.from_bytes(h[:8], "little") + layer) & (2**62 - 1))
    return torch.randn((2, SPEC.page_size, SPEC.num_kv_heads, SPEC.head_dim), generator=g).to(
        SPEC.dtype
    )


def fill(pool: PagedKVPool, seqs: list[list[int]]) -> list[list[int]]:
    """Block tables for ``seqs``, equal pages shared, each full page filled from its hash."""
    P = SPEC.page_size
    where: dict[bytes, int] = {}
    tables = []
    for toks in seqs:
        hs = keymod.page_hashes(SPEC, toks)
        row = []
        for h in hs:
            if h not in where:
                where[h] = pool.allocate(1)[0]
                for li in range(SPEC.num_layers):
                    pool.layers[li][:, where[h]] = page_kv(h, li)
            row.append(where[h])
        if len(toks) % P:
            row += pool.allocate(1)
        tables.append(row)
    return tables


def check(
    pool: PagedKVPool, seqs: list[list[int]], tables: list[list[int]], num_tokens: list[int]
) -> int:
    """Pages that differ from what their tokens say they hold."""
    bad = 0
    for toks, row, n in zip(seqs, tables, num_tokens, strict=True):
        for i, h in enumerate(keymod.page_hashes(SPEC, toks)[: n // SPEC.page_size]):
            for li in range(SPEC.num_layers):
                if not torch.equal(pool.layers[li][:, row[i]], page_kv(h, li)):
                    bad += 1
    return bad


async def run(url: str, token: str, client: int, rounds: int, read_clients: int) -> dict[str, Any]:
    remote = {
        "type": "remote",
        "url": url,
        "token": token,
        "backoff_initial_s": 0.05,
        "backoff_max_s": 0.5,
    }
    cfg = load_config(
        {"tiers": [{"type": "gpu", "device": "cpu", "capacity_bytes": 64 << 20}, remote]}, env={}
    )
    report: dict[str, Any] = {
        "client": client,
        "pages_written": 0,
        "bad_pages": 0,
        "short": 0,
        "retrieved_tokens": 0,
    }
    t0 = time.perf_counter()
    async with TieredStore(cfg) as store:
        for seqs in batches(client, rounds):
            pool = PagedKVPool(SPEC, 512)
            r = await store.put(pool, seqs, fill(pool, seqs))
            report["pages_written"] += r.pages_written
        await store.flush()
        report["put_s"] = time.perf_counter() - t0
    # A fresh engine (nothing local) reads every batch of the clients asked for.
    async with TieredStore(cfg) as store:
        for c in range(read_clients):
            for seqs in batches(c if read_clients > 1 else client, rounds):
                dst = PagedKVPool(SPEC, 512)
                res = await store.retrieve(dst, seqs)
                report["bad_pages"] += check(dst, seqs, res.block_tables, res.num_tokens)
                full = [len(t) // SPEC.page_size * SPEC.page_size for t in seqs]
                report["short"] += sum(
                    1 for n, f in zip(res.num_tokens, full, strict=True) if n != f
                )
                report["retrieved_tokens"] += sum(res.num_tokens)
    report["total_s"] = time.perf_counter() - t0
    return report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--token", default="")
    ap.add_argument("--client", type=int, required=True)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument(
        "--read-clients",
        type=int,
        default=1,
        help="1: read back its own batches; N: those of clients 0..N-1",
    )
    a = ap.parse_args()
    print(json.dumps(asyncio.run(run(a.url, a.token, a.client, a.rounds, a.read_clients))))


if __name__ == "__main__":
    main()
