"""The store's side of the cache server, in-process: commit_segment verifies before it
stores, find_segments hands out the manifests behind a prefix, stored keys map as the
server maps them. Each bad commit by name; nothing of a refused commit is stored."""

from __future__ import annotations

import pytest

from hurray_store import PagedKVPool
from hurray_store import keys as keymod
from hurray_store.config import load_config
from hurray_store.errors import ChecksumError, FormatError
from hurray_store.store import TieredStore
from tests import server_client as sc


def _cpu() -> TieredStore:
    return TieredStore(load_config({"tiers": [{"type": "cpu", "capacity_bytes": 64 << 20}]}, env={}))


async def _segment(client: int = 0) -> tuple[str, bytes, dict[str, bytes], list[list[int]]]:
    """A committed segment's manifest key, manifest and layer objects, built by a store."""
    async with _cpu() as builder:
        seqs = sc.batches(client, 1)[0]
        pool = PagedKVPool(sc.SPEC, 512)
        await builder.put(pool, seqs, sc.fill(pool, seqs))
        (m,) = builder._manifests.values()
        objs = {lay.key: bytes(await builder.tiers[0].get(lay.key)) for lay in m.layers}  # type: ignore[arg-type]
        return builder._manifest_key(m.segment_id.hex()), m.to_bytes(), objs, seqs


async def test_a_good_commit_is_stored_and_found_by_prefix() -> None:
    mkey, manifest, objs, seqs = await _segment()
    async with _cpu() as server:
        assert await server.commit_segment(mkey, manifest, objs)
        assert await server.commit_segment(mkey, manifest, objs), "a second commit of it is a no-op"
        hashes = [keymod.page_hashes(sc.SPEC, t) for t in seqs]
        matched, manifests = await server.find_segments([(0, hs) for hs in hashes], 1 << 20)
        assert matched == [len(hs) for hs in hashes] and manifests == [manifest]
        matched, manifests = await server.find_segments([(len(hs), hs) for hs in hashes], 1 << 20)
        assert manifests == [], "nothing past what the asker has"
        matched, manifests = await server.find_segments([(0, hs) for hs in hashes], 10)
        assert manifests == [] and matched == [0] * len(seqs), "a match stops where the manifests that fit stop"
        assert server.stats()["tiers"]["cpu"]["objects"] == len(objs) + 1


@pytest.mark.parametrize(
    "case", ["missing_layer", "extra_object", "flipped_page_byte", "truncated_object", "garbage_manifest", "other_namespace", "wrong_segment_key"],
)
async def test_a_bad_commit_raises_and_stores_nothing(case: str) -> None:
    mkey, manifest, objs, _ = await _segment()
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
        mkey = "other" + mkey[mkey.index("/") :]
    elif case == "wrong_segment_key":
        mkey = keymod.manifest_key("hurray", "ab" * 8)
    released = []
    async with _cpu() as server:
        with pytest.raises(FormatError) as e:
            await server.commit_segment(mkey, manifest, objs, release=lambda: released.append(1))
        if case == "flipped_page_byte":
            assert isinstance(e.value, ChecksumError)
        assert released == [1], "the caller's buffers are given back"
        assert server.stats()["tiers"]["cpu"]["objects"] == 0 and len(server.index) == 0


async def test_storage_keys() -> None:
    async with _cpu() as s:
        seg = keymod.layer_key("hurray", "00ff", 3)
        assert s.storage_key(seg) == seg, "a segment key of this namespace is kept as it is"
        assert s.storage_key("my/tensor") == "hurray/o/my/tensor"
        assert s.storage_key(keymod.layer_key("elsewhere", "00ff", 3)).startswith("hurray/o/")
        with pytest.raises(FormatError):
            await s.put_key(seg, [b"x"])  # a segment object is only stored by its commit


def test_segment_key_parsing() -> None:
    assert keymod.parse_segment_key("ns/s/{0a1b}/12") == ("ns", "0a1b", "12")
    assert keymod.parse_segment_key("a/b/s/{ff}/m") == ("a/b", "ff", "m")
    for bad in ["ns/o/x", "ns/s/{XY}/1", "ns/s/{ab}/", "ns/s/{ab}/x", "/s/{ab}/1", "ns/s/{}/1", "ns/s/ab/1"]:
        assert keymod.parse_segment_key(bad) is None, bad
