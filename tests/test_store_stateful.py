"""A hypothesis state machine drives a store (cpu + disk) beside a plain model: the set
of stored page-hash chains and a dict of objects. Restarts included."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import tempfile

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from hurray_store import PagedKVPool
from hurray_store.keys import page_hashes
from hurray_store.store import TieredStore, open_store
from tests.store_helpers import spec

SP = spec(num_layers=2, page_size=2)
P = SP.page_size
tokens_st = st.lists(
    st.integers(0, 2), min_size=0, max_size=9
)  # small alphabet: many shared prefixes


def page_content(tokens: list[int], i: int) -> torch.Tensor:
    """The KV an engine would compute for page i: a function of tokens[: (i+1)P]."""
    seed = int.from_bytes(hashlib.sha256(bytes(tokens[: (i + 1) * P])).digest()[:8], "little")
    g = torch.Generator().manual_seed(seed)
    return torch.randn((SP.num_layers, 2, P, SP.num_kv_heads, SP.head_dim), generator=g).to(
        SP.dtype
    )


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.dir = tempfile.mkdtemp()
        self.cfg = {
            "tiers": [
                {"type": "cpu", "capacity_bytes": 1 << 30},
                {"type": "disk", "path": self.dir, "capacity_bytes": 1 << 30},
            ]
        }
        self.store: TieredStore = self.run(open_store(self.cfg))
        self.stored: set[bytes] = set()
        self.objects: dict[str, bytes] = {}

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

    def expected(self, tokens: list[int]) -> int:
        n = 0
        for h in page_hashes(SP, tokens):
            if h not in self.stored:
                break
            n += 1
        return n * P

    @rule(batch=st.lists(tokens_st, min_size=1, max_size=4))
    def put(self, batch: list[list[int]]) -> None:
        pool = PagedKVPool(SP, 64)
        tables = []
        for toks in batch:
            n = -(-len(toks) // P)
            table = pool.allocate(n)
            for i in range(len(toks) // P):
                c = page_content(toks, i)
                for li in range(SP.num_layers):
                    pool.layers[li][:, table[i]] = c[li]
            tables.append(table)
        before = set(self.stored)
        r = self.run(self.store.put(pool, batch, tables))
        new = {h for toks in batch for h in page_hashes(SP, toks)} - before
        # Pages behind a stored prefix are written again only when an earlier page
        # was missing; with nothing evicted, exactly the new hashes are written.
        assert r.pages_written == len(new)
        self.stored |= new

    @rule(batch=st.lists(tokens_st, min_size=1, max_size=3))
    def retrieve(self, batch: list[list[int]]) -> None:
        assert self.run(self.store.lookup(SP, batch)) == [self.expected(t) for t in batch]
        pool = PagedKVPool(SP, 64)
        got = self.run(self.store.retrieve(pool, batch))
        assert got.num_tokens == [self.expected(t) for t in batch]
        for toks, table in zip(batch, got.block_tables, strict=True):
            for i, page in enumerate(table):
                c = page_content(toks, i)
                for li in range(SP.num_layers):
                    assert torch.equal(pool.layers[li][:, page], c[li])

    @rule(key=st.sampled_from(["a", "b", "c/d"]), data=st.binary(max_size=64))
    def put_object(self, key: str, data: bytes) -> None:
        assert self.run(self.store.put_object(key, data))
        self.objects[key] = data

    @rule(key=st.sampled_from(["a", "b", "c/d"]))
    def get_or_delete_object(self, key: str) -> None:
        got = self.run(self.store.get_object(key))
        assert (None if got is None else bytes(got)) == self.objects.get(key)
        self.run(self.store.delete_object(key))
        self.objects.pop(key, None)

    @rule()
    def restart(self) -> None:
        self.run(self.store.close())
        self.store = self.run(open_store(self.cfg))

    @invariant()
    def index_size_matches_the_model(self) -> None:
        assert len(self.store.catalog.index) == len(self.stored)

    def teardown(self) -> None:
        self.run(self.store.close())
        self.loop.close()
        shutil.rmtree(self.dir, ignore_errors=True)


StoreMachine.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStoreMachine = StoreMachine.TestCase
