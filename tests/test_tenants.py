"""Tenants of the cache server, against a real `hurray-store serve`: a token is bound to
a namespace; no tenant can read, replace or delete another's KV; an admin token can; a
tenant's quota deletes its own least recently used groups and never another's; the
counts survive a restart."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from hurray_store import PagedKVPool
from hurray_store.config import load_config
from hurray_store.errors import ConfigError
from hurray_store.store import TieredStore
from hurray_store.store.policy import quota_victims
from hurray_store.tiers.remote import RemoteTier
from hurray_store.transport import EXTENSION, Err, Hello, Msg
from tests import server_client as sc
from tests.server_helpers import Raw, ServerProc

TENANTS = [
    {"name": "alice", "token": "alice-token"},
    {"name": "bob", "token": "bob-token", "namespace": "bobs"},
    {"name": "ops", "token": "ops-token", "admin": True},
]


def _engine(srv: ServerProc, who: dict[str, Any]) -> TieredStore:
    """An engine whose only tier is the server, as tenant ``who``."""
    tier = {**srv.tier(), "token": who["token"]}
    ns = who.get("namespace", who["name"])
    return TieredStore(load_config({"namespace": ns, "tiers": [tier]}, env={}))


def _remote(srv: ServerProc, who: dict[str, Any]) -> RemoteTier:
    cfg = load_config({"tiers": [{**srv.tier(), "token": who["token"]}]}, env={}).tiers[0]
    return RemoteTier(cfg)  # type: ignore[arg-type]


async def _put(engine: TieredStore, seqs: list[list[int]], poison: float = 0.0) -> None:
    """Put ``seqs`` with their true KV, or (``poison``) with every value shifted."""
    pool = PagedKVPool(sc.SPEC, 512)
    tables = sc.fill(pool, seqs)
    if poison:
        for t in pool.layers:
            t.add_(poison)
    await engine.put(pool, seqs, tables)
    await engine.flush()


async def _wrong_pages(engine: TieredStore, seqs: list[list[int]]) -> tuple[list[int], int]:
    """Tokens retrieved per sequence, and how many pages differ from the true KV."""
    dst = PagedKVPool(sc.SPEC, 512)
    res = await engine.retrieve(dst, seqs)
    return res.num_tokens, sc.check(dst, seqs, res.block_tables, res.num_tokens)


@pytest.fixture
def server(tmp_path: Path) -> Any:
    srv = ServerProc(tmp_path / "srv", token="", tenants=TENANTS).start()
    yield srv
    srv.kill()


def test_a_tenant_neither_sees_nor_poisons_another_tenants_kv(server: ServerProc) -> None:
    seqs = sc.batches(0, 1)[0]
    full = [len(t) // 8 * 8 for t in seqs]

    async def main() -> None:
        async with _engine(server, TENANTS[0]) as alice, _engine(server, TENANTS[1]) as bob:
            await _put(alice, seqs)
            assert await alice.lookup(sc.SPEC, seqs) == full
            assert await bob.lookup(sc.SPEC, seqs) == [0] * 3, "bob's lookup sees none of it"
            assert (await _wrong_pages(bob, seqs))[0] == [0] * 3
            # Bob commits the same tokens with other KV: his own namespace gets it ...
            await _put(bob, seqs, poison=1.0)
            got, wrong = await _wrong_pages(bob, seqs)
            assert got == full and wrong > 0, "bob reads back what he wrote"
        # ... and a fresh engine of alice's still gets alice's KV, bit for bit.
        async with _engine(server, TENANTS[0]) as fresh:
            assert await _wrong_pages(fresh, seqs) == (full, 0)

    asyncio.run(main())


def test_only_an_admin_token_deletes_another_tenants_segment(server: ServerProc) -> None:
    seqs = sc.batches(1, 1)[0]
    full = [len(t) // 8 * 8 for t in seqs]

    async def main() -> None:
        async with _engine(server, TENANTS[0]) as alice:
            await _put(alice, seqs)
            keys = [alice.catalog.key(s).manifest for s in alice.catalog.segments()]
            assert keys and all(k.startswith("alice/s/{") for k in keys)
        bob, ops = _remote(server, TENANTS[1]), _remote(server, TENANTS[2])
        try:
            assert await bob.sizes(keys) == [None] * len(keys), "bob cannot even see them"
            await bob.delete_many(keys)
            async with _engine(server, TENANTS[0]) as alice:
                assert await _wrong_pages(alice, seqs) == (full, 0), "bob's delete did nothing"
            sizes = await ops.sizes(keys)
            assert all(n is not None and n > 0 for n in sizes), "the admin reads them in full"
            await ops.delete_many(keys)
            async with _engine(server, TENANTS[0]) as alice:
                assert await alice.lookup(sc.SPEC, seqs) == [0] * 3, "the admin's delete did"
        finally:
            await bob.close()
            await ops.close()

    asyncio.run(main())


def test_a_quota_evicts_the_tenants_own_groups_only(tmp_path: Path) -> None:
    # Its segments are ~39 KB of bytes in 6 objects, charged 16 KiB each besides.
    tenants = [{**TENANTS[0], "quota_bytes": 320 << 10}, TENANTS[1], TENANTS[2]]
    srv = ServerProc(tmp_path / "srv", token="", tenants=tenants).start()

    async def main() -> None:
        bob_seqs = sc.batches(7, 1)[0]
        async with _engine(srv, TENANTS[1]) as bob:
            await _put(bob, bob_seqs)
        async with _engine(srv, tenants[0]) as alice:
            for seqs in sc.batches(2, 8):
                await _put(alice, seqs)
        remote = _remote(srv, tenants[0])
        try:
            own = await remote.server_stats()
            assert own is not None and set(own) == {"tenant"}, "a tenant sees its own counts only"
            t = own["tenant"]
            assert t["name"] == "alice" and 0 < t["used_bytes"] <= 320 << 10
            assert t["quota_evictions"] > 0
        finally:
            await remote.close()
        ops = _remote(srv, TENANTS[2])
        try:
            everything = await ops.server_stats()
            assert everything is not None
            assert everything["tenants"]["bob"]["quota_evictions"] == 0
            quota = everything["moves"]["quota"]
            assert sum(q["groups"] for q in quota.values()) >= t["quota_evictions"], quota
            assert everything["tenants"]["alice"]["used_bytes"] == t["used_bytes"]
        finally:
            await ops.close()
        async with _engine(srv, TENANTS[1]) as bob:
            assert await _wrong_pages(bob, bob_seqs) == ([len(s) // 8 * 8 for s in bob_seqs], 0)
        url = f"http://127.0.0.1:{srv.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        assert (
            f'hurray_store_server_tenant_bytes{{tenant="alice"}} {float(t["used_bytes"])}' in text
        )
        assert 'hurray_store_server_tenant_quota_evictions_total{tenant="alice"}' in text
        # The counts survive a restart: the disk tier's scan charges each tenant again.
        assert srv.stop() == 0
        srv.start()
        ops = _remote(srv, TENANTS[2])
        try:
            after = await ops.server_stats()
            assert after is not None
            assert after["tenants"]["alice"]["used_bytes"] == t["used_bytes"]
            assert after["tenants"]["bob"]["used_bytes"] > 0
        finally:
            await ops.close()
        async with _engine(srv, TENANTS[1]) as bob:
            assert (await _wrong_pages(bob, bob_seqs))[1] == 0

    try:
        asyncio.run(main())
    finally:
        srv.kill()


def test_an_object_larger_than_the_quota_is_refused(tmp_path: Path) -> None:
    # A put in flight costs its bytes, its key and the server's per-object overhead.
    tenants = [{**TENANTS[0], "quota_bytes": 64 << 10}]
    srv = ServerProc(tmp_path / "srv", token="", tenants=tenants).start()

    async def main() -> None:
        remote = _remote(srv, tenants[0])
        try:
            assert await remote.put("small", [b"x" * 512])
            assert not await remote.put("big", [b"x" * (128 << 10)]), "NOT_STORED: past the quota"
            assert await remote.sizes(["small", "big"]) == [512, None]
        finally:
            await remote.close()

    try:
        asyncio.run(main())
    finally:
        srv.kill()


@pytest.mark.parametrize(
    "token", ["", "nobody-token", "alice-token "], ids=["empty", "unknown", "near"]
)
def test_a_token_no_tenant_has_is_refused(server: ServerProc, token: str) -> None:
    r = Raw(server.port)
    try:
        r.send(Msg.CLIENT_HELLO, 1, Hello(ext={"extensions": EXTENSION, "token": token}).encode())
        assert r.error()[0] == Err.AUTH_FAILED
        assert r.is_closed()
    finally:
        r.close()


def test_quota_victims_table() -> None:
    groups = [("a", 10), ("b", 20), ("c", 30)]  # least recently used first
    never = lambda g: False  # noqa: E731
    assert quota_victims(groups, 60, 100, 40, never) == []
    assert quota_victims(groups, 60, 100, 45, never) == ["a"]
    assert quota_victims(groups, 60, 100, 65, never) == ["a", "b"]
    assert quota_victims(groups, 60, 100, 75, never) == ["a", "b", "c"]
    assert quota_victims(groups, 60, 100, 65, lambda g: g == "a") == ["b", "c"]
    assert quota_victims(groups, 60, 100, 101, never) is None, "larger than the quota"
    assert quota_victims(groups, 60, 100, 95, lambda g: g == "c") is None, "the rest is pinned"


@pytest.mark.parametrize(
    "case",
    ["duplicate_token", "token_of_server", "duplicate_namespace", "bad_namespace", "no_token"],
)
def test_bad_tenant_configs_are_named(case: str) -> None:
    t = [{"name": "a", "token": "x"}, {"name": "b", "token": "y"}]
    server: dict[str, Any] = {"tenants": t}
    if case == "duplicate_token":
        t[1]["token"] = "x"
    elif case == "token_of_server":
        server["token"] = "y"
    elif case == "duplicate_namespace":
        t[1]["namespace"] = "a"
    elif case == "bad_namespace":
        t[1]["namespace"] = "b/o/c"
    elif case == "no_token":
        t[1]["token"] = ""
    with pytest.raises(ConfigError, match=r"server\.tenants\.b\.(token|namespace)"):
        load_config(
            {"tiers": [{"type": "cpu", "capacity_bytes": 1 << 20}], "server": server}, env={}
        )


def test_a_tenants_token_comes_from_the_environment() -> None:
    cfg = load_config(
        {
            "tiers": [{"type": "cpu", "capacity_bytes": 1 << 20}],
            "server": {"tenants": [{"name": "team_a", "token": "in-the-file"}]},
        },
        env={"HURRAY_STORE__SERVER__TENANTS__TEAM_A__TOKEN": "from-env"},
    )
    (t,) = cfg.server.tenants
    assert (t.token, t.namespace, t.admin, t.quota_bytes) == ("from-env", "team_a", False, None)
