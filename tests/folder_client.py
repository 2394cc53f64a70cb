"""One process of the several-processes-on-one-cache-folder tests (run as ``python -m
tests.folder_client``): a store whose only tier is a disk folder other processes use at
the same time. Per round it puts a batch (pages shared with the other clients' batches:
a system prompt and topics), then looks up and retrieves every client's batch of that
round and checks each page it got to the bit (page KV is a pure function of its page
hash, as in ``tests.server_client``). Then it says it is done (``<barrier>/done.<client>``),
waits for every client to say so, and retrieves every batch of every client with the
same store, still open: what the others committed while it ran must all be found. It
prints a JSON report."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from hurray_store import PagedKVPool
from hurray_store.config import load_config
from hurray_store.store import TieredStore
from tests.server_client import SPEC, batches, check, fill


def config(folder: str, capacity: int) -> Any:
    return load_config(
        {"tiers": [{"type": "disk", "path": folder, "capacity_bytes": capacity}]}, env={}
    )


async def run(
    folder: str, barrier: Path, client: int, clients: int, rounds: int, capacity: int
) -> dict[str, Any]:
    report: dict[str, Any] = {
        "client": client,
        "pages_written": 0,
        "bad_pages": 0,
        "overpromised": 0,  # sequences whose lookup said more than the retrieve right after
        "short_at_end": 0,  # sequences of any client not retrieved whole at the end
    }
    async with TieredStore(config(folder, capacity)) as store:
        for r in range(rounds):
            seqs = batches(client, rounds)[r]
            pool = PagedKVPool(SPEC, 512)
            res = await store.put(pool, seqs, fill(pool, seqs))
            report["pages_written"] += res.pages_written
            for c in range(clients):
                theirs = batches(c, rounds)[r]
                promised = await store.lookup(SPEC, theirs)
                dst = PagedKVPool(SPEC, 512)
                got = await store.retrieve(dst, theirs)
                report["bad_pages"] += check(dst, theirs, got.block_tables, got.num_tokens)
                report["overpromised"] += sum(
                    p > n for p, n in zip(promised, got.num_tokens, strict=True)
                )
            await asyncio.sleep(0.05)  # let the others take turns
        await store.flush()
        (barrier / f"done.{client}").touch()
        deadline = time.monotonic() + 120
        while not all((barrier / f"done.{c}").exists() for c in range(clients)):
            if time.monotonic() > deadline:
                raise SystemExit("the other clients did not finish")
            await asyncio.sleep(0.05)
        for c in range(clients):
            for seqs in batches(c, rounds):
                dst = PagedKVPool(SPEC, 512)
                got = await store.retrieve(dst, seqs)
                report["bad_pages"] += check(dst, seqs, got.block_tables, got.num_tokens)
                full = [len(t) // SPEC.page_size * SPEC.page_size for t in seqs]
                report["short_at_end"] += sum(
                    n != f for n, f in zip(got.num_tokens, full, strict=True)
                )
    return report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", required=True)
    ap.add_argument("--barrier", required=True, help="a folder for the done.<client> files")
    ap.add_argument("--client", type=int, required=True)
    ap.add_argument("--clients", type=int, required=True)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--capacity", type=int, default=1 << 30)
    a = ap.parse_args()
    print(
        json.dumps(
            asyncio.run(run(a.folder, Path(a.barrier), a.client, a.clients, a.rounds, a.capacity))
        )
    )


if __name__ == "__main__":
    main()
