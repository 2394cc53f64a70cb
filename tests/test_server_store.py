"""The store's side of the cache server, in-process: commit_segment verifies before it
stores, find_segments hands out the manifests behind a prefix, stored keys map as the
server maps them. Each bad commit by name; nothing of a refused commit is stored."""

from __future__ import annotations

import asyncio

import pytest

from hurray_store import PagedKVPool
from hurray_store import keys as keymod
from hurray_store.config import ServerConfig, load_config
from hurray_store.errors import ChecksumError, FormatError, ProtocolError
from hurray_store.keys import ObjectKey, SegmentKey, SegmentPart, parse_key
from hurray_store.server.access import Op, ServedKey, authorize, served
from hurray_store.server.backing import ServedStore
from hurray_store.server.tenants import Tenant, Tenants
from hurray_store.store import TieredStore
from tests import server_client as sc


def _cpu() -> TieredStore:
    return TieredStore(
        load_config({"tiers": [{"type": "cpu", "capacity_bytes": 64 << 20}]}, env={})
    )


def _served(store: TieredStore, cfg: ServerConfig | None = None) -> ServedStore:
    """The server's view of ``store``; with no tenants configured, one admin tenant of
    the store's namespace (``.tenants.all[0]``)."""
    return ServedStore(store, Tenants(cfg or ServerConfig(), store.namespace, store.groups))


async def _segment(client: int = 0) -> tuple[SegmentKey, bytes, dict[str, bytes], list[list[int]]]:
    """A committed segment's key, manifest and layer objects, built by a store."""
    async with _cpu() as builder:
        seqs = sc.batches(client, 1)[0]
        pool = PagedKVPool(sc.SPEC, 512)
        await builder.put(pool, seqs, sc.fill(pool, seqs))
        (seg,) = builder.catalog.segments()
        m = builder.catalog.cached_manifest(seg)
        assert m is not None
        objs = {lay.key: bytes(await builder.tiers[0].get(lay.key)) for lay in m.layers}  # type: ignore[arg-type]
        return builder.catalog.key(seg), m.to_bytes(), objs, seqs


async def test_a_good_commit_is_stored_and_found_by_prefix() -> None:
    seg, manifest, objs, seqs = await _segment()
    async with _cpu() as store:
        server = _served(store)
        me = server.tenants.all[0]
        assert await server.commit_segment(seg, manifest, objs, me)
        assert await server.commit_segment(seg, manifest, objs, me), (
            "a second commit of it is a no-op"
        )
        hashes = [keymod.page_hashes(sc.SPEC, t) for t in seqs]
        matched, manifests = await server.find_segments([(0, hs) for hs in hashes], 1 << 20, me)
        assert matched == [len(hs) for hs in hashes] and manifests == [manifest]
        matched, manifests = await server.find_segments(
            [(len(hs), hs) for hs in hashes], 1 << 20, me
        )
        assert manifests == [], "nothing past what the asker has"
        matched, manifests = await server.find_segments([(0, hs) for hs in hashes], 10, me)
        assert manifests == [] and matched == [0] * len(seqs), (
            "a match stops where the manifests that fit stop"
        )
        assert server.stats()["tiers"]["cpu"]["objects"] == len(objs) + 1


@pytest.mark.parametrize(
    "case",
    [
        "missing_layer",
        "extra_object",
        "flipped_page_byte",
        "truncated_object",
        "garbage_manifest",
        "other_namespace",
        "wrong_segment_key",
    ],
)
async def test_a_bad_commit_raises_and_stores_nothing(case: str) -> None:
    seg, manifest, objs, _ = await _segment()
    first = next(iter(objs))
    if case == "missing_layer":
        del objs[first]
    elif case == "extra_object":
        objs[first.rsplit("/", 1)[0] + "/99"] = b"x"
    elif case == "flipped_page_byte":
        b = bytearray(objs[first])
        b[-1] ^= 0x40
        objs[first] = bytes(b)
    elif case == "truncated_object":
        objs[first] = objs[first][:-1]
    elif case == "garbage_manifest":
        manifest = b"HSMF" + bytes(64)
    elif case == "other_namespace":
        seg = SegmentKey("other", seg.segment_id)
    elif case == "wrong_segment_key":
        seg = SegmentKey("hurray", bytes.fromhex("ab" * 8))
    released = []
    async with _cpu() as store:
        server = _served(store)
        me = server.tenants.all[0]
        with pytest.raises(FormatError) as e:
            await server.commit_segment(seg, manifest, objs, me, release=lambda: released.append(1))
        if case == "flipped_page_byte":
            assert isinstance(e.value, ChecksumError)
        assert released == [1], "the caller's buffers are given back"
        assert store.stats()["tiers"]["cpu"]["objects"] == 0 and len(store.catalog.segments()) == 0


async def test_served_keys() -> None:
    async with _cpu() as store:
        s = _served(store)
        me = s.tenants.all[0]

        def key(k: str, op: Op = "read") -> ServedKey:
            return served(me, op, k, s.namespaces)

        seg = SegmentKey("hurray", bytes.fromhex("00ff")).layer(3)
        k = key(seg, "write")
        assert k.stored == seg and k.segment == SegmentPart(
            SegmentKey("hurray", bytes.fromhex("00ff")), 3
        ), "a segment key of this namespace is kept as it is"
        assert key("my/tensor").stored == "hurray/o/my/tensor" and key("my/tensor").segment is None
        other = key(SegmentKey("elsewhere", bytes.fromhex("00ff")).layer(3))
        assert other.stored.startswith("hurray/o/") and other.segment is None
        with pytest.raises(FormatError):
            await s.put_key(k, [b"x"], me)  # a segment object is only stored by its commit


def test_every_access_is_decided_by_authorize() -> None:
    alice = Tenant("alice", "alice", admin=False, quota=None)
    ops = Tenant("ops", "ops", admin=True, quota=None)
    spaces = {"alice": alice, "ops": ops}
    manifest = SegmentKey("alice", b"\x01").manifest
    layer = SegmentKey("alice", b"\x01").layer(0)
    assert authorize(alice, "commit", manifest, spaces).allowed
    for op_key in (layer, SegmentKey("ops", b"\x01").manifest, "plain"):
        d = authorize(alice, "commit", op_key, spaces)
        assert not d.allowed and "not a manifest key" in d.why, op_key
    assert not authorize(alice, "stats", None, spaces).allowed
    assert authorize(ops, "stats", None, spaces).allowed
    theirs = "alice/o/x"
    assert served(ops, "read", theirs, spaces).stored == theirs, "an admin reads in full"
    assert served(ops, "delete", theirs, spaces).stored == theirs
    assert served(ops, "write", theirs, spaces).stored == "ops/o/alice/o/x", "never writes"
    assert served(alice, "read", "ops/o/x", spaces).stored == "alice/o/ops/o/x"
    with pytest.raises(ProtocolError):
        served(alice, "commit", layer, spaces)


def test_stored_key_parsing() -> None:
    table = [
        ("ns/s/{0a1b}/12", SegmentPart(SegmentKey("ns", bytes.fromhex("0a1b")), 12)),
        ("a/b/s/{ff}/m", SegmentPart(SegmentKey("a/b", b"\xff"), None)),
        ("ns/o/x/y", ObjectKey("ns", "x/y")),
    ]
    for text, want in table:
        assert parse_key(text) == want, text
    for bad in [
        "ns/s/{XY}/1",
        "ns/s/{ab}/",
        "ns/s/{ab}/x",
        "/s/{ab}/1",
        "ns/s/{}/1",
        "ns/s/ab/1",
        "ns/s/{abc}/1",
        "ns/o/",
        "/o/x",
        "plain",
        "ns/s/{ab}/1x",
        "ns/s/{ab}/99999999999",
    ]:
        assert parse_key(bad) is None, bad
    seg = SegmentKey("ns", bytes.fromhex("0a1b"))
    for k in (seg.layer(0), seg.layer(31), seg.manifest):
        got = parse_key(k)
        assert isinstance(got, SegmentPart) and got.segment == seg


async def test_a_quota_evicts_by_the_stores_own_recency() -> None:
    """One LRU: a tenant's quota takes its groups in the order the store's ledger last
    used them (written, read, found by a lookup), not an order of its own. Of three
    objects written a, b, c, a read of ``a`` leaves ``b`` the least recently used."""
    cfg = ServerConfig(token="ops")
    async with _cpu() as store:
        s = _served(store, cfg)
        me = s.tenants.all[0]
        me.quota = 3 * (1000 + (16 << 10))  # three objects of 1,000 bytes, as charged

        def key(name: str, op: Op = "write") -> ServedKey:
            return served(me, op, name, s.namespaces)

        for name in ("a", "b", "c"):
            assert await s.put_key(key(name), [bytes(1000)], me)
        assert await s.get_key(key("a", "read")) is not None
        assert [g.name for g in store.groups.least_recent(me.namespace)] == ["b", "c", "a"]
        assert await s.put_key(key("d"), [bytes(1000)], me)
        assert me.evicted == 1
        held = {n: await s.key_size(key(n, "read")) for n in "abcd"}
        assert held == {"a": 1000, "b": None, "c": 1000, "d": 1000}


@pytest.mark.parametrize(
    ("host", "token", "warned"),
    [("0.0.0.0", "", True), ("127.0.0.1", "", False), ("0.0.0.0", "s3cret", False)],
    ids=["every_address_no_token", "loopback_no_token", "every_address_token"],
)
def test_a_server_reachable_by_others_with_no_token_says_so_at_start(
    host: str, token: str, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """With no token and no tenants every client is an admin: said once at start when
    the server listens beyond the loopback (it listens for a moment only, nothing is sent)."""
    from hurray_store.server.app import CacheServer, server_store

    cfg = load_config(
        {"tiers": [{"type": "cpu", "capacity_bytes": 1 << 20}], "server": {"token": token}},
        env={},
    )

    async def main() -> None:
        store = server_store(cfg)
        await store.open()
        server = CacheServer(store, cfg.server)
        try:
            await server.start(host, 0, None)
        finally:
            await server.shutdown()
            await store.close()

    with caplog.at_level("WARNING", logger="hurray_store.server.app"):
        asyncio.run(main())
    said = [r.getMessage() for r in caplog.records if "no token and no tenants" in r.getMessage()]
    assert len(said) == int(warned), said
