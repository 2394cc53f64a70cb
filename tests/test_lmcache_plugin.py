"""hurray_store as LMCache 0.5.6's storage plugin, loaded by LMCache's own loader next
to its real LocalCPUBackend."""

from __future__ import annotations

import asyncio
import os
import random
import sys
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import hurray
import pytest
import torch

from hurray_store.tiers.memory import memory_charge

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
lmcache = pytest.importorskip(
    "lmcache", reason="the lmcache extra is not installed (make test installs it)"
)

from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend import CreateStorageBackends  # noqa: E402

from hurray_store.adapters.lmcache import HurrayStoragePlugin  # noqa: E402
from hurray_store.adapters.lmcache import chunks as chunks_module  # noqa: E402

LAYERS, HEADS, DIM = 3, 2, 16


def backends(
    tmp_path: Path,
    *,
    chunk: int = 64,
    heads: int = HEADS,
    page_size: int | None = None,
    lower: str | None = None,
    model_path: Path | None = None,
) -> Any:
    """LMCache's backends with the plugin; its tiers are cpu, then ``lower`` (a tier
    entry in YAML flow style; default: a disk tier under ``tmp_path``)."""
    cfg_file = tmp_path / f"hurray-{os.urandom(4).hex()}.yaml"
    lower = lower or f"{{type: disk, path: {tmp_path / 'cache'}, capacity_bytes: 1073741824}}"
    cfg_file.write_text(f"tiers:\n  - {{type: cpu, capacity_bytes: 67108864}}\n  - {lower}\n")
    extra = {
        "storage_plugin.hurray.module_path": "hurray_store.adapters.lmcache",
        "storage_plugin.hurray.class_name": "HurrayStoragePlugin",
        "storage_plugin.hurray.config": str(cfg_file),
    }
    if page_size:
        extra["storage_plugin.hurray.page_size"] = page_size
    if model_path is not None:
        extra["storage_plugin.hurray.model_path"] = str(model_path)
    cfg = LMCacheEngineConfig.from_dict(
        {
            "chunk_size": chunk,
            "local_cpu": False,
            "max_local_cpu_size": 0.25,
            "storage_plugins": ["hurray"],
            "extra_config": extra,
        }
    )
    md = metadata(chunk, heads)
    import asyncio
    import threading

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return CreateStorageBackends(cfg, md, loop), loop


@pytest.fixture
def opened(tmp_path: Path) -> Iterator[Any]:
    made: list[Any] = []

    def make(**kw: Any) -> Any:
        b, loop = backends(tmp_path, **kw)
        made.append((b, loop))
        return b

    try:
        yield make
    finally:
        for b, loop in made:
            for be in b.values():
                be.close()
            loop.call_soon_threadsafe(loop.stop)


def metadata(chunk: int, heads: int = HEADS) -> LMCacheMetadata:
    """LMCache's metadata of the test model's KV, in chunks of ``chunk`` tokens."""
    return LMCacheMetadata(
        model_name="tiny",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.float16,
        kv_shape=(LAYERS, 2, chunk, heads, DIM),
    )


def plugin_of(b: Any) -> HurrayStoragePlugin:
    found = [be for be in b.values() if isinstance(be, HurrayStoragePlugin)]
    assert found, f"LMCache did not load the plugin (it swallows load errors): {list(b)}"
    return found[0]


def chunk(b: Any, tokens: int, seed: int, heads: int = HEADS) -> Any:
    cpu = b["LocalCPUBackend"]
    obj = cpu.allocate(
        torch.Size([2, LAYERS, tokens, heads * DIM]), torch.float16, MemoryFormat.KV_2LTD
    )
    g = torch.Generator().manual_seed(seed)
    obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=g).half())
    return obj


def key(h: int) -> CacheEngineKey:
    return CacheEngineKey("tiny", 1, 0, h, torch.float16)


def test_two_checkpoints_served_under_one_model_name_never_share_a_chunk(
    opened: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """LMCache names chunks by its ``model_name``; with ``model_path`` the plugin keys
    them by the weights too: another checkpoint under the same name finds nothing, the
    same weights copied to another folder find everything."""
    import shutil

    from hurray_store.tiny_model import build_tiny_model

    build_tiny_model(str(tmp_path / "m1"), layers=1, seed=1)
    build_tiny_model(str(tmp_path / "m2"), layers=1, seed=2)
    shutil.copytree(tmp_path / "m1", tmp_path / "m1-copy")
    a = opened(model_path=tmp_path / "m1")
    pa = plugin_of(a)
    objs = [chunk(a, 64, 21), chunk(a, 64, 22)]
    want = [o.tensor.clone() for o in objs]
    pa.batched_submit_put_task([key(21), key(22)], objs)
    pa.flush()
    other = plugin_of(opened(model_path=tmp_path / "m2"))
    assert other.batched_contains([key(21), key(22)]) == 0
    assert other.get_blocking(key(21)) is None
    same = plugin_of(opened(model_path=tmp_path / "m1-copy"))
    assert same.batched_contains([key(21), key(22)]) == 2
    got = same.batched_get_blocking([key(21), key(22)])
    assert all(g is not None for g in got)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.tensor, w)
        g.ref_count_down()
    # no model_path and a name that is no folder: keyed by the name, with a warning
    with caplog.at_level("WARNING"):
        plugin_of(opened())
    assert "would share KV" in caplog.text


def test_put_get_bit_exact_and_restart(opened: Any) -> None:
    b = opened()
    p = plugin_of(b)
    # Partial last chunks too: of whole pages (32 tokens), and ending in a partial page.
    objs = [chunk(b, 64, 1), chunk(b, 64, 2), chunk(b, 23, 3), chunk(b, 32, 4)]
    want = [o.tensor.clone() for o in objs]
    done: list[Any] = []
    p.batched_submit_put_task(
        [key(i) for i in (1, 2, 3, 4)], objs, on_complete_callback=done.append
    )
    p.flush()
    assert sorted(k.chunk_hash for k in done) == [1, 2, 3, 4]
    assert all(o.get_ref_count() == 1 for o in objs)  # the plugin gave its references back
    for i, w in enumerate(want, 1):
        assert p.contains(key(i))
        got = p.get_blocking(key(i))
        assert got is not None and torch.equal(got.tensor, w)
        got.ref_count_down()
    assert not p.contains(key(9)) and p.get_blocking(key(9)) is None
    p.close()
    b2 = opened()  # a new engine over the same disk tier finds the chunks
    p2 = plugin_of(b2)
    for i, w in enumerate(want, 1):
        assert p2.contains(key(i))
        got = p2.get_blocking(key(i))
        assert got is not None and torch.equal(got.tensor, w)
        got.ref_count_down()
    # Its first pinned lookup makes its entries for them, each with the handle its pin
    # was taken by, already on the copy (the next lookup looks nothing up).
    assert p2.batched_contains([key(i) for i in (1, 2, 3, 4)], pin=True) == 4
    copies = [p2.chunks.entry(key(i)).ref.entry for i in (1, 2, 3, 4)]
    assert all(e is not None and e.ready and e.pins == 1 for e in copies)
    assert all(p2.unpin(key(i)) for i in (1, 2, 3, 4))


@pytest.mark.parametrize(
    "shape, dtype",
    [
        ([2, LAYERS, 32, (HEADS + 1) * DIM], torch.float16),  # another width
        ([2, LAYERS + 1, 32, HEADS * DIM], torch.float16),  # another layer count
        ([2, LAYERS, 32, HEADS * DIM], torch.bfloat16),  # another dtype
    ],
)
def test_a_chunk_of_another_layout_is_refused_and_nothing_stored(
    opened: Any, shape: list[int], dtype: torch.dtype
) -> None:
    b = opened()
    p = plugin_of(b)
    obj = b["LocalCPUBackend"].allocate(torch.Size(shape), dtype, MemoryFormat.KV_2LTD)
    with pytest.raises(ValueError, match="expected a KV_2LTD chunk"):
        p.batched_submit_put_task([key(1)], [obj])
    p.flush()
    assert obj.get_ref_count() == 1  # the plugin kept no reference
    assert not p.contains(key(1)) and not p.exists_in_put_tasks(key(1))


def test_a_chunk_is_stored_under_the_documented_key(opened: Any, tmp_path: Path) -> None:
    """The key scheme docs/lmcache.md gives (a negative chunk hash as its 64 bits): a
    cache written by an earlier version is found after an upgrade only if it holds."""
    b = opened()
    p = plugin_of(b)
    obj = chunk(b, 64, 1)
    p.batched_submit_put_task([CacheEngineKey("tiny", 1, 0, -5, torch.float16)], [obj])
    p.flush()
    name = f"lmc/{p.fingerprint[:8].hex()}/tiny@1@0@fffffffffffffffb@float16/c"
    assert p.store.held(name)
    on_disk = [unquote(f.name) for f in (tmp_path / "cache" / "objects").glob("*/*")]
    assert [n for n in on_disk if n.endswith(f"/o/{name}")], on_disk
    assert not p.store.held(name.replace("@float16", "@bfloat16"))
    obj.ref_count_down()


def test_chunks_of_other_tags_are_kept_apart(opened: Any) -> None:
    """LMCache's keys differ by their tags (``lmcache.tag.*`` request configs, such as
    one per tenant): a chunk stored under one tag is a miss under another, or none."""
    b = opened()
    p = plugin_of(b)

    def tagged(user: str | None) -> CacheEngineKey:
        cfg = {} if user is None else {"lmcache.tag.user": user}
        return CacheEngineKey("tiny", 1, 0, 9, torch.float16, request_configs=cfg)

    obj = chunk(b, 64, 9)
    p.batched_submit_put_task([tagged("alice")], [obj])
    p.flush()
    assert p.contains(tagged("alice")) and p.contains(tagged("alice"), pin=True)
    assert not p.contains(tagged("bob")) and not p.contains(tagged(None))
    assert p.get_blocking(tagged("bob")) is None and p.get_blocking(tagged(None)) is None
    got = p.get_blocking(tagged("alice"))
    assert got is not None and torch.equal(got.tensor, obj.tensor)
    got.ref_count_down()
    assert p.unpin(tagged("alice")) and not p.unpin(tagged("bob"))
    obj.ref_count_down()


def _tagged(user: str | None, h: int = 9) -> CacheEngineKey:
    """A new key object for chunk hash ``h`` under tenant ``user`` (no tag: None)."""
    cfg = {} if user is None else {"lmcache.tag.user": user}
    return CacheEngineKey("tiny", 1, 0, h, torch.float16, request_configs=cfg)


def test_keys_of_one_chunk_hash_keep_their_own_names_and_pins(opened: Any) -> None:
    """The plugin finds its entry for a chunk by the key's chunk hash; keys that share
    one (the same tokens under other tags) keep their own names and pins, whichever
    holds the hash's place, found by equal keys as well as by the same objects."""
    b = opened()
    p = plugin_of(b)
    users = ["alice", "bob", None]
    objs = [chunk(b, 64, s) for s in (1, 2, 3)]
    p.batched_submit_put_task([_tagged(u) for u in users], objs)
    p.flush()
    assert len({p.chunks.name(_tagged(u)) for u in users}) == 3
    led = p.store.cascade.ledger

    def pinned(user: str | None) -> bool:
        p.flush()
        return led.is_pinned(p.store.objects.key(p.chunks.name(_tagged(user))))

    # Fresh key objects each time, as LMCache's engine makes them on every lookup.
    assert all(p.batched_contains([_tagged(u)], pin=True) == 1 for u in users)
    assert [pinned(u) for u in users] == [True, True, True]
    assert p.unpin(_tagged(None)) and not p.unpin(_tagged(None))
    assert [pinned(u) for u in users] == [True, True, False]
    # The first key's entry leaves (it held the hash's place): the others are found.
    assert p.remove(_tagged("alice")) and not p.contains(_tagged("alice"))
    assert p.chunks.by_hash.get(9) is None and pinned("bob")
    got = p.get_blocking(_tagged("bob"))
    assert got is not None and torch.equal(got.tensor, objs[1].tensor)
    got.ref_count_down()
    assert p.unpin(_tagged("bob")) and not pinned("bob")
    # Put again, the first key takes the free place; the other two stay where they were.
    p.batched_submit_put_task([_tagged("alice")], [objs[0]])
    p.flush()
    assert p.chunks.by_hash[9].key == _tagged("alice") and p.contains(_tagged("alice"), pin=True)
    assert pinned("alice") and p.unpin(_tagged("alice")) and not pinned("alice")
    assert all(p.contains(_tagged(u)) for u in users)
    for o in objs:
        o.ref_count_down()


def test_a_truncated_chunk_object_is_a_miss_and_leaves(opened: Any, tmp_path: Path) -> None:
    b = opened()
    p = plugin_of(b)
    p.batched_submit_put_task([key(8)], [chunk(b, 64, 8)])
    p.flush()
    p.close()
    (victim,) = [f for f in (tmp_path / "cache" / "objects").rglob("*%2Fc") if f.is_file()]
    victim.write_bytes(victim.read_bytes()[:-100])
    p2 = plugin_of(opened())  # finds an object of a size no chunk object has
    assert p2.contains(key(8))
    assert p2.get_blocking(key(8)) is None
    assert not p2.contains(key(8))


@pytest.mark.parametrize("change", [{"chunk": 32}, {"heads": 4}, {"page_size": 8}])
def test_a_layout_change_is_a_miss(opened: Any, change: dict[str, int]) -> None:
    b = opened()
    p = plugin_of(b)
    p.batched_submit_put_task([key(7)], [chunk(b, 32, 7)])
    p.flush()
    p.close()
    p2 = plugin_of(opened(**change))
    assert not p2.contains(key(7)) and p2.get_blocking(key(7)) is None


async def test_async_contains_and_get_stop_at_the_first_miss(opened: Any) -> None:
    b = opened()
    p = plugin_of(b)
    p.batched_submit_put_task([key(1), key(2), key(4)], [chunk(b, 64, i) for i in (1, 2, 4)])
    p.flush()
    assert await p.batched_async_contains("req", [key(1), key(2), key(3), key(4)]) == 2
    got = await p.batched_get_non_blocking("req", [key(1), key(2), key(3), key(4)])
    assert len(got) == 2
    for g in got:
        g.ref_count_down()


def _pinned(p: HurrayStoragePlugin, hashes: Sequence[int]) -> list[int]:
    """Which of the chunks ``key(h)`` the store's ledger holds pinned, once the store's
    loop has taken every pin and unpin handed to it (``flush`` waits for it)."""
    p.flush()
    led = p.store.cascade.ledger
    return [h for h in hashes if led.is_pinned(p.store.objects.key(p.chunks.name(key(h))))]


def test_a_pinned_lookup_pins_the_hit_prefix_and_each_unpin_lets_one_pin_go(
    opened: Any,
) -> None:
    b = opened()
    p = plugin_of(b)
    p.batched_submit_put_task([key(1), key(2), key(4)], [chunk(b, 64, i) for i in (1, 2, 4)])
    p.flush()
    # A put leaves the chunk's handle on its copy: the first lookup looks nothing up.
    copies = [p.chunks.entry(key(h)).ref.entry for h in (1, 2, 4)]
    assert all(e is not None and e.ready for e in copies)
    # What LMCache's engine asks on vLLM's lookup: the hits up to the first miss, pinned.
    assert p.batched_contains([key(1), key(2), key(3), key(4)], pin=True) == 2
    assert _pinned(p, [1, 2, 4]) == [1, 2]
    assert p.batched_contains([key(1)], pin=True) == 1  # a second lookup of the prefix
    assert p.unpin(key(1)) and p.unpin(key(2)) and not p.unpin(key(4))
    assert _pinned(p, [1, 2, 4]) == [1]  # key 1's second pin holds
    assert p.unpin(key(1)) and not p.unpin(key(1))
    assert _pinned(p, [1, 2, 4]) == []
    # A forced remove lets its pins go: the chunk put again is not pinned.
    assert p.contains(key(4), pin=True) and not p.remove(key(4), force=False)
    assert p.remove(key(4)) and not p.contains(key(4))
    p.batched_submit_put_task([key(4)], [chunk(b, 64, 4)])
    assert _pinned(p, [4]) == [] and p.contains(key(4))
    assert p.contains(key(4), pin=True) and _pinned(p, [4]) == [4]  # the new copy
    assert p.chunks.entry(key(4)).ref.entry is not copies[2] and p.unpin(key(4))
    assert _pinned(p, [4]) == []
    assert not p.pin(key(3))  # absent: nothing pinned
    assert _pinned(p, [3]) == []
    # A new prompt's lookup: nothing kept for its chunks (their names made lazily, the
    # first only), nothing pinned.
    new = [key(h) for h in range(100, 164)]
    assert p.batched_contains(new, pin=True) == 0
    assert all(p.chunks.find(k) is None for k in new)


async def test_async_lookup_with_pin_pins_the_hit_prefix(opened: Any) -> None:
    b = opened()
    p = plugin_of(b)
    p.batched_submit_put_task([key(1), key(2), key(4)], [chunk(b, 64, i) for i in (1, 2, 4)])
    p.flush()
    assert await p.batched_async_contains("req", [key(1), key(2), key(3), key(4)], pin=True) == 2
    # Taken here through the chunks' handles, as a lookup on LMCache's thread takes them:
    # each pin the ledger's entry of the copy a get finds.
    for h in (1, 2):
        c = p.chunks.find(key(h))
        assert c is not None and list(c) == [c.ref.entry] and c.ref.entry.pins == 1
    assert _pinned(p, [1, 2, 4]) == [1, 2]
    assert p.unpin(key(1)) and p.unpin(key(2))
    assert _pinned(p, [1, 2, 4]) == []


def test_pins_hold_while_the_plugin_forgets_chunk_names(
    opened: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plugin keeps the names of the chunks it saw lately with its pins on them;
    when there are too many it forgets the unpinned ones, never a pin."""
    monkeypatch.setattr(chunks_module, "KEPT", 4)
    b = opened()
    p = plugin_of(b)
    p.batched_submit_put_task([key(1), key(2)], [chunk(b, 64, i) for i in (1, 2)])
    p.flush()
    assert p.batched_contains([key(1), key(2)], pin=True) == 2
    assert p.pin(key(1))
    drops = p.chunks.drops
    more = range(10, 30)
    p.batched_submit_put_task([key(h) for h in more], [chunk(b, 32, h) for h in more])
    p.flush()
    # names forgotten, more than once
    assert p.chunks.drops > drops and len(p.chunks) < 22
    assert _pinned(p, [1, 2]) == [1, 2]
    assert p.unpin(key(1)) and p.unpin(key(1)) and not p.unpin(key(1))
    assert p.unpin(key(2)) and not p.unpin(key(2))
    assert _pinned(p, [1, 2, *more]) == []
    assert all(p.contains(key(h)) for h in (1, 2, *more))  # forgotten names, found again


def test_lookups_unpins_and_removes_on_several_threads_leave_no_pin_behind(
    opened: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engines' threads pin, let go and remove the same chunks at once while the plugin
    forgets names: every pin taken is let go once, none is lost on the way."""
    monkeypatch.setattr(chunks_module, "KEPT", 8)
    b = opened()
    p = plugin_of(b)
    hashes = range(1, 13)
    p.batched_submit_put_task([key(h) for h in hashes], [chunk(b, 32, h) for h in hashes])
    p.flush()
    stop = threading.Event()

    def look(seed: int) -> int:
        rng, n = random.Random(seed), 0
        while not stop.is_set():
            ks = [key(h) for h in rng.sample(hashes, 4)]
            hit = p.batched_contains(ks, pin=True)
            for k in ks[:hit]:
                p.unpin(k)  # False when a remove let the pin go first
            n += hit
        return n

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        with ThreadPoolExecutor(2) as pool:
            lookers = [pool.submit(look, s) for s in (1, 2)]
            for h in [*hashes] * 2:  # remove and put back, under the lookups
                p.remove(key(h))
                p.batched_submit_put_task([key(h)], [chunk(b, 32, h)])
                p.flush()
            stop.set()
            assert all(f.result() > 0 for f in lookers)
    finally:
        sys.setswitchinterval(old)
    assert all(len(c) == 0 for c in p.chunks.entries())  # no pins
    assert _pinned(p, list(hashes)) == []


def test_a_chunk_record_is_the_documented_layout_and_parses_back() -> None:
    """The record a put writes and a get compares with (``chunk_record_of``, one pack)
    is byte for byte the layout records.py documents, and parses back to its fields."""
    import struct

    import xxhash

    from hurray_store.format.records import chunk_record_of, parse_chunk_record

    rng = random.Random(7)
    fp = bytes(rng.randrange(256) for _ in range(32))
    pools = [(rng.randrange(1 << 20), rng.randrange(1 << 20)) for _ in range(LAYERS)]
    sums = [rng.randrange(1 << 64) for _ in range(2 * LAYERS)]
    body = struct.pack("<4sH32sQIQ", b"HSLC", 4, fp, 200, LAYERS, 1 << 21) + b"".join(
        struct.pack("<QQQQ", k, v, sums[2 * i], sums[2 * i + 1]) for i, (k, v) in enumerate(pools)
    )
    documented = body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
    record = chunk_record_of(LAYERS)(fp, 200, 1 << 21, pools, sums)
    assert record == documented
    n, size, layers = parse_chunk_record(record, fp, LAYERS, 256, lambda n: n * 8)
    assert (n, size) == (200, 1 << 21)
    assert [(x.key_pool_offset, x.value_pool_offset) for x in layers] == pools
    assert [s for x in layers for s in (x.key_tokens_checksum, x.value_tokens_checksum)] == sums
    assert chunk_record_of(LAYERS)(fp, 199, 1 << 21, pools, sums) != documented
    swapped = [sums[1], sums[0], *sums[2:]]  # a layer's key and value checksums apart
    assert chunk_record_of(LAYERS)(fp, 200, 1 << 21, pools, swapped) != documented


def test_pin_remove_and_a_corrupt_chunk_is_a_miss(opened: Any, tmp_path: Path) -> None:
    b = opened()
    p = plugin_of(b)
    p.batched_submit_put_task([key(5), key(6)], [chunk(b, 64, 5), chunk(b, 64, 6)])
    p.flush()
    assert p.pin(key(5)) and p.unpin(key(5)) and not p.unpin(key(5))
    assert p.remove(key(5)) and not p.contains(key(5)) and p.get_blocking(key(5)) is None
    p.close()
    # Key 6's chunk is one object, one Hurray stream: per layer a key and a value
    # block-paged descriptor, then the chunk record as a uint8 tensor, last.
    disk = tmp_path / "cache" / "objects"
    (victim,) = [f for f in disk.rglob("*") if f.is_file() and f.name.endswith("%2Fc")]
    raw = bytearray(victim.read_bytes())
    tensors = list(hurray.StreamReader(bytes(raw)))
    assert len(tensors) == 2 * LAYERS + 1
    assert [t.layout.kv_role for t in tensors[:2]] == ["key", "value"]
    assert tensors[0].layout.page_size == 16
    from hurray_store.format.records import chunk_record_bytes, parse_chunk_record

    assert tuple(tensors[-1].shape) == (chunk_record_bytes(LAYERS),)
    _, size, layers = parse_chunk_record(
        raw[-chunk_record_bytes(LAYERS) :], p.fingerprint, LAYERS, 64, lambda n: n * HEADS * DIM * 2
    )
    assert len(raw) == size
    # Flip a byte of layer 1's keys on disk (where its record says they are); a new
    # plugin must not serve the chunk.
    raw[layers[1].key_pool_offset + 10] ^= 0xFF
    victim.write_bytes(bytes(raw))
    p2 = plugin_of(opened())
    assert p2.get_blocking(key(6)) is None
    assert not p2.contains(key(6))  # the bad chunk left the store


def test_batched_gets_from_several_threads_read_disk_at_once_and_a_corrupt_chunk_is_none(
    opened: Any, tmp_path: Path
) -> None:
    b = opened()
    p = plugin_of(b)
    objs = [chunk(b, 64, i) for i in range(1, 6)] + [chunk(b, 23, 6)]
    want = {i: o.tensor.clone() for i, o in enumerate(objs, 1)}
    p.batched_submit_put_task([key(i) for i in want], objs)
    p.flush()
    p.close()
    # Chunk 3's object: a byte of its last layer's values flipped on disk.
    from hurray_store.format.records import chunk_record_bytes, parse_chunk_record

    objects = (tmp_path / "cache" / "objects").rglob("*%2Fc")
    victim = next(f for f in objects if f"{3:016x}%40" in f.name)  # chunk hash 3
    raw = bytearray(victim.read_bytes())
    _, _, layers = parse_chunk_record(
        raw[-chunk_record_bytes(LAYERS) :], p.fingerprint, LAYERS, 64, lambda n: n * HEADS * DIM * 2
    )
    raw[layers[-1].value_pool_offset + 5] ^= 0x01
    victim.write_bytes(bytes(raw))
    # A new engine (its cpu tier empty: every chunk is read from the disk tier, off the
    # store's loop) asked by four threads at once, as LMCache's engine asks on a
    # retrieve: each asks for every chunk, one twice, and one never stored.
    p2 = plugin_of(opened())
    asked = [key(i) for i in (1, 2, 3, 4, 5, 6, 1, 9)]
    with ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(lambda _: p2.batched_get_blocking(asked), range(4)))
    for got in runs:
        assert [g is None for g in got] == [False, False, True, False, False, False, False, True]
        for k, g in zip(asked, got, strict=True):
            if g is not None:
                assert torch.equal(g.tensor, want[k.chunk_hash]) and g.get_ref_count() == 1
                g.ref_count_down()
    assert not p2.contains(key(3))  # the corrupt chunk left the store
    assert p2.contains(key(1)) and p2.contains(key(6))


def test_a_mistyped_key_of_the_plugin_or_the_l2_adapter_is_an_error_naming_it(
    tmp_path: Path,
) -> None:
    """A typo'd ``storage_plugin.hurray.*`` key in LMCache's real config, or in the L2
    adapter's params, is one error naming it and the key meant (it used to be ignored)."""
    from hurray_store.adapters.lmcache.l2 import HurrayL2AdapterConfig

    extra = {
        "storage_plugin.hurray.module_path": "hurray_store.adapters.lmcache",
        "storage_plugin.hurray.class_name": "HurrayStoragePlugin",
        "storage_plugin.hurray.config": str(tmp_path / "h.yaml"),
        "storage_plugin.hurray.modelpath": str(tmp_path),
        "some_other_feature": 1,  # LMCache's and other plugins' keys are theirs
    }
    cfg = LMCacheEngineConfig.from_dict({"storage_plugins": ["hurray"], "extra_config": extra})
    md = metadata(64, HEADS)
    with pytest.raises(ValueError, match="'storage_plugin.hurray.modelpath'.*did you mean"):
        HurrayStoragePlugin(config=cfg, metadata=md)
    with pytest.raises(ValueError, match="unknown key 'confg'.*did you mean 'config'"):
        HurrayL2AdapterConfig.from_dict({"confg": "x.yaml"})


def test_plugin_refuses_to_load_without_a_config(tmp_path: Path) -> None:
    from types import SimpleNamespace

    md = SimpleNamespace(kv_shape=(1, 2, 16, 1, 8), kv_dtype=torch.float16, use_mla=False)
    with pytest.raises(ValueError, match="storage_plugin.hurray.config"):
        HurrayStoragePlugin(config=SimpleNamespace(extra_config={}), metadata=md)


def test_shipped_lmcache_config_loads_the_plugin_over_the_shipped_tiers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import asyncio
    import threading

    import yaml

    root = Path(__file__).resolve().parent.parent
    monkeypatch.chdir(root)
    cfg = LMCacheEngineConfig.from_file(str(root / "configs/lmcache.yaml"))
    assert cfg.storage_plugins == ["hurray"] and cfg.local_cpu is False
    hurray_cfg = cfg.extra_config["storage_plugin.hurray.config"]
    # The shipped tiers, with the disk moved to a temp folder for the test.
    raw = yaml.safe_load((root / hurray_cfg).read_text())
    raw["tiers"][1]["path"] = str(tmp_path / "cache")
    (tmp_path / "h.yaml").write_text(yaml.safe_dump(raw))
    cfg.extra_config["storage_plugin.hurray.config"] = str(tmp_path / "h.yaml")
    cfg.max_local_cpu_size = 0.25
    md = metadata(256, HEADS)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    b = CreateStorageBackends(cfg, md, loop)
    try:
        p = plugin_of(b)
        assert p.page_size == 16 and p.chunk_size == 256
    finally:
        for be in b.values():
            be.close()
        loop.call_soon_threadsafe(loop.stop)


@pytest.mark.parametrize("tier", ["disk", "redis", "remote"])
def test_l2_adapter_under_lmcache_bench_with_verification(
    tmp_path: Path, tier: str, request: pytest.FixtureRequest
) -> None:
    import json
    import subprocess
    import sys

    from tests.server_helpers import ServerProc

    if tier == "disk":
        lower = f"{{type: disk, path: {tmp_path / 'cache'}, capacity_bytes: 1073741824}}"
    elif tier == "redis":
        r = request.getfixturevalue("redis_fresh")
        lower = f"{{type: redis, url: '{r.url}'}}"
    else:
        srv = ServerProc(tmp_path / "srv").start()
        request.addfinalizer(srv.kill)
        lower = f"{{type: remote, url: '{srv.url}'}}"
    (tmp_path / "h.yaml").write_text(
        f"tiers:\n  - {{type: cpu, capacity_bytes: 67108864}}\n  - {lower}\n"
    )
    spec = {
        "type": "plugin",
        "module_path": "hurray_store.adapters.lmcache",
        "class_name": "HurrayL2Adapter",
        "adapter_params": {"config": str(tmp_path / "h.yaml")},
    }
    lmcache_cli = Path(sys.executable).parent / "lmcache"
    out = subprocess.run(
        [
            str(lmcache_cli),
            "bench",
            "l2",
            "--l2-adapter",
            json.dumps(spec),
            "--no-skip-verify",
            "--num-keys",
            "16",
            "--data-size-kb",
            "128",
            "--rounds",
            "2",
            "--lookup-max-hit-rate",
            "1.0",
        ],
        capture_output=True,
        timeout=300,
        env={**os.environ, "LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1"},
    )
    text = out.stdout.decode() + out.stderr.decode()
    assert out.returncode == 0, text[-3000:]
    assert "Adapter created successfully (HurrayL2Adapter)" in text
    assert "All 16 keys data verified OK" in text, text[-3000:]
    assert "success_keys=16/16" in text


def test_l2_adapter_verifies_every_load_in_lmcaches_buffer(tmp_path: Path) -> None:
    """Stores and loads run every key of a task at once; a load reads straight into
    LMCache's buffer and checks it there against the key's record: a corrupt object is
    a 0 in the bitmap (LMCache then deletes that buffer), and its record is dropped."""
    import select

    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

    from hurray_store.adapters.lmcache import HurrayL2Adapter
    from hurray_store.format.records import L2_RECORD_BYTES, l2_layout

    (tmp_path / "h.yaml").write_text(
        f"tiers:\n  - {{type: disk, path: {tmp_path / 'cache'}, capacity_bytes: 1073741824}}\n"
    )

    def obj(fill: int) -> TensorMemoryObj:
        raw = torch.full((4096,), fill, dtype=torch.uint8)
        return TensorMemoryObj(
            raw, MemoryObjMetadata(torch.Size([4096]), torch.uint8, 0, 4096, 1), None
        )

    def wait(fd: int) -> None:
        assert select.select([fd], [], [], 10)[0], "no completion signalled"
        os.read(fd, 8)

    keys = [ObjectKey(bytes([i]) * 16, "tiny", 0) for i in range(3)]
    a = HurrayL2Adapter({"config": str(tmp_path / "h.yaml")})
    try:
        a.submit_store_task(keys[:2], [obj(1), obj(2)])
        wait(a.get_store_event_fd())
        (res,) = a.pop_completed_store_tasks().values()
        assert res.is_successful() and res.bytes_transferred() == 2 * 4096
        t = a.submit_lookup_and_lock_task(keys, {})
        wait(a.get_lookup_and_lock_event_fd())
        bm = a.query_lookup_and_lock_result(t)
        assert bm is not None and [bm.test(i) for i in range(3)] == [True, True, False]
        a.submit_unlock(keys[:2])
        # Corrupt key 1's bytes on disk: its load must be a 0.
        f = next(
            p
            for p in (tmp_path / "cache" / "objects").rglob("*")
            if p.is_file() and p.name.endswith(bytes([1]).hex() * 16 + "%40")
        )
        raw = bytearray(f.read_bytes())
        # One Hurray stream: LMCache's bytes as a uint8[4096] tensor, then the record.
        data, record = list(hurray.StreamReader(bytes(raw)))
        assert str(data.dtype) == "uint8" and tuple(data.shape) == (4096,)
        assert tuple(record.shape) == (L2_RECORD_BYTES,)
        at, _, size = l2_layout(4096)
        assert len(raw) == size
        raw[at + 100] ^= 0xFF  # in LMCache's bytes, after the descriptor
        f.write_bytes(bytes(raw))
        dst = [obj(0), obj(0), obj(0)]
        t = a.submit_load_task(keys, dst)
        wait(a.get_load_event_fd())
        bm = a.query_load_result(t)
        assert bm is not None and [bm.test(i) for i in range(3)] == [True, False, False]
        assert bool((dst[0].tensor == 1).all())
        t = a.submit_lookup_and_lock_task(keys, {})
        wait(a.get_lookup_and_lock_event_fd())
        bm = a.query_lookup_and_lock_result(t)
        assert bm is not None and [bm.test(i) for i in range(3)] == [True, False, False]
        a.submit_unlock(keys[:1])
    finally:
        a.close()


def _l2_obj(fill: int, n: int = 4096) -> Any:
    from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

    raw = torch.full((n,), fill, dtype=torch.uint8)
    return TensorMemoryObj(raw, MemoryObjMetadata(torch.Size([n]), torch.uint8, 0, n, 1), None)


def _l2_wait(fd: int) -> None:
    import select

    assert select.select([fd], [], [], 20)[0], "no completion signalled"
    os.read(fd, 8)


def test_l2_adapter_tasks_in_flight_at_once_and_unlock_while_loading(tmp_path: Path) -> None:
    """Several store and load tasks submitted before any completes, and keys unlocked
    while their load runs: every task completes once, with its own result, and every
    loaded buffer holds its key's bytes."""
    from lmcache.v1.distributed.api import ObjectKey

    from hurray_store.adapters.lmcache import HurrayL2Adapter

    (tmp_path / "h.yaml").write_text(
        "tiers:\n  - {type: cpu, capacity_bytes: 67108864}\n"
        f"  - {{type: disk, path: {tmp_path / 'cache'}, capacity_bytes: 1073741824}}\n"
    )
    keys = [ObjectKey(bytes([i]) * 16, "tiny", 0) for i in range(40)]
    a = HurrayL2Adapter({"config": str(tmp_path / "h.yaml")})
    try:
        stores = [
            a.submit_store_task(keys[i : i + 10], [_l2_obj(i + j) for j in range(10)])
            for i in range(0, 40, 10)
        ]
        done: dict[int, Any] = {}
        while len(done) < 4:
            _l2_wait(a.get_store_event_fd())
            done.update(a.pop_completed_store_tasks())
        assert sorted(done) == sorted(stores)
        assert all(r.is_successful() and r.bytes_transferred() == 10 * 4096 for r in done.values())
        t = a.submit_lookup_and_lock_task(keys, {})
        _l2_wait(a.get_lookup_and_lock_event_fd())
        bm = a.query_lookup_and_lock_result(t)
        assert bm is not None and all(bm.test(i) for i in range(40))
        dsts = [[_l2_obj(255) for _ in range(10)] for _ in range(4)]
        loads = [a.submit_load_task(keys[i * 10 : i * 10 + 10], dsts[i]) for i in range(4)]
        a.submit_unlock(keys)  # while the loads run
        results: dict[int, Any] = {}
        while len(results) < 4:
            _l2_wait(a.get_load_event_fd())
            for t in loads:
                if t not in results and (r := a.query_load_result(t)) is not None:
                    results[t] = r
        for i, t in enumerate(loads):
            assert all(results[t].test(j) for j in range(10))
            for j in range(10):
                assert bool((dsts[i][j].tensor == i * 10 + j).all())
        assert a.query_load_result(loads[0]) is None, "a result is reported once"
    finally:
        a.close()


def test_l2_adapter_task_that_fails_completes_as_a_failure(tmp_path: Path) -> None:
    """A task whose store calls fail (here: the port closed under it) is still reported
    to LMCache, as nothing loaded, never left pending."""
    from lmcache.v1.distributed.api import ObjectKey

    from hurray_store.adapters.lmcache import HurrayL2Adapter

    (tmp_path / "h.yaml").write_text("tiers:\n  - {type: cpu, capacity_bytes: 67108864}\n")
    keys = [ObjectKey(bytes([i]) * 16, "tiny", 0) for i in range(2)]
    a = HurrayL2Adapter({"config": str(tmp_path / "h.yaml")})
    try:
        a.submit_store_task(keys, [_l2_obj(1), _l2_obj(2)])
        _l2_wait(a.get_store_event_fd())
        a.port.close()  # the store's loop is gone: a load's reads fail
        t = a.submit_load_task(keys, [_l2_obj(0), _l2_obj(0)])
        _l2_wait(a.get_load_event_fd())
        bm = a.query_load_result(t)
        assert bm is not None and [bm.test(i) for i in range(2)] == [False, False]
    finally:
        a.close()


def test_l2_adapter_touch_keeps_keys_from_eviction(tmp_path: Path) -> None:
    """submit_touch (LMCache 0.5.7) feeds the store's eviction order: a touched key
    outlives one stored after it."""
    from lmcache.v1.distributed.api import ObjectKey

    from hurray_store.adapters.lmcache import HurrayL2Adapter

    n = 1 << 20
    cap = 3 * memory_charge(n) + 4096
    (tmp_path / "h.yaml").write_text(f"tiers:\n  - {{type: cpu, capacity_bytes: {cap}}}\n")
    keys = [ObjectKey(bytes([i]) * 16, "tiny", 0) for i in range(4)]
    a = HurrayL2Adapter({"config": str(tmp_path / "h.yaml")})
    try:
        for i in range(3):
            a.submit_store_task([keys[i]], [_l2_obj(i, n)])
            _l2_wait(a.get_store_event_fd())
            a.pop_completed_store_tasks()
        a.submit_touch([keys[0]])  # keys[1] is now the least recently used
        a.submit_store_task([keys[3]], [_l2_obj(3, n)])
        _l2_wait(a.get_store_event_fd())
        a.pop_completed_store_tasks()
        t = a.submit_lookup_and_lock_task(keys, {})
        _l2_wait(a.get_lookup_and_lock_event_fd())
        bm = a.query_lookup_and_lock_result(t)
        assert bm is not None and [bm.test(i) for i in range(4)] == [True, False, True, True]
    finally:
        a.close()


def test_two_engines_share_chunks_through_a_cache_server(opened: Any, tmp_path: Path) -> None:
    """Engine A's plugin stores chunks on the server (cpu -> remote); engine B, with
    nothing of its own, finds and loads them bit-exact."""
    from tests.server_helpers import ServerProc

    srv = ServerProc(tmp_path / "srv").start()
    try:
        remote = f"{{type: remote, url: '{srv.url}', backoff_initial_s: 0.05}}"
        a = opened(lower=remote)
        pa = plugin_of(a)
        objs = [chunk(a, 64, 11), chunk(a, 40, 12)]
        want = [o.tensor.clone() for o in objs]
        pa.batched_submit_put_task([key(11), key(12)], objs)
        pa.flush()
        b = opened(lower=remote)
        pb = plugin_of(b)
        assert pb.contains(key(11)) and pb.contains(key(12)) and not pb.contains(key(13))
        # Lookups of what only the server holds: asked there, up to the first miss.
        assert pb.batched_contains([key(11), key(12), key(13)], pin=True) == 2
        assert pb.unpin(key(11)) and pb.unpin(key(12))
        assert asyncio.run(pb.batched_async_contains("r", [key(12), key(13), key(11)])) == 1
        for k, w in ((key(11), want[0]), (key(12), want[1])):
            got = pb.get_blocking(k)
            assert got is not None and torch.equal(got.tensor, w)
            got.ref_count_down()
    finally:
        srv.kill()


def test_a_lookup_hears_what_another_process_on_the_disk_folder_did(opened: Any) -> None:
    """Two stores on one disk folder, as two engines' processes on one host: a lookup
    on LMCache's thread reads what the other committed and removed before it reads the
    ledger, with no operation of its own store in between (the store's operations on its
    loop read the others' changes first; a lookup reads the ledger off the loop)."""
    a, b = opened(), opened()
    pa, pb = plugin_of(a), plugin_of(b)
    objs = [chunk(a, 64, h) for h in (1, 2)]
    want = [o.tensor.clone() for o in objs]
    pa.batched_submit_put_task([key(1), key(2)], objs)
    pa.flush()
    assert pb.batched_contains([key(1), key(2), key(3)]) == 2
    pa.batched_submit_put_task([key(3)], [chunk(a, 64, 3)])
    pa.flush()
    assert pb.batched_contains([key(1), key(2), key(3), key(4)], pin=True) == 3
    pa.batched_submit_put_task([key(4)], [chunk(a, 64, 4)])
    pa.flush()
    assert pb.pin(key(4))
    pa.batched_submit_put_task([key(5)], [chunk(a, 64, 5)])
    pa.flush()
    keys = [key(h) for h in (1, 2, 3, 4, 5)]
    assert asyncio.run(pb.batched_async_contains("r", keys, pin=True)) == 5
    assert _pinned(pb, [1, 2, 3, 4, 5]) == [1, 2, 3, 4, 5]
    for h in (1, 2, 3, 4, 4, 5):
        assert pb.unpin(key(h))
    assert _pinned(pb, [1, 2, 3, 4, 5]) == [1, 2, 3]
    for h in (1, 2, 3):
        assert pb.unpin(key(h))
    got = pb.get_blocking(key(1))
    assert got is not None and torch.equal(got.tensor, want[0])
    got.ref_count_down()
    # Removed by the other: a miss at once, not a hit whose get would fail.
    assert pa.remove(key(2))
    assert not pb.contains(key(2))
    assert pb.batched_contains([key(1), key(2)], pin=True) == 1 and pb.unpin(key(1))
    assert pb.get_blocking(key(2)) is None
    # Removed by the other after this store read of it: a put writes it again, not
    # skipped as held.
    assert pa.remove(key(3))
    pb.batched_submit_put_task([key(3)], [chunk(b, 64, 3)])
    pb.flush()
    got = pb.get_blocking(key(3))
    assert got is not None
    got.ref_count_down()


def test_l2_adapter_restart_finds_every_committed_object(tmp_path: Path) -> None:
    """A new adapter over the same disk tier finds and loads every key the first one
    stored, bit for bit."""
    from lmcache.v1.distributed.api import ObjectKey

    from hurray_store.adapters.lmcache import HurrayL2Adapter

    (tmp_path / "h.yaml").write_text(
        f"tiers:\n  - {{type: disk, path: {tmp_path / 'cache'}, capacity_bytes: 1073741824}}\n"
    )
    keys = [ObjectKey(bytes([i]) * 16, "tiny", 0) for i in range(8)]
    a = HurrayL2Adapter({"config": str(tmp_path / "h.yaml")})
    try:
        a.submit_store_task(keys, [_l2_obj(i) for i in range(8)])
        _l2_wait(a.get_store_event_fd())
        (res,) = a.pop_completed_store_tasks().values()
        assert res.is_successful()
    finally:
        a.close()
    b = HurrayL2Adapter({"config": str(tmp_path / "h.yaml")})
    try:
        t = b.submit_lookup_and_lock_task(keys, {})
        _l2_wait(b.get_lookup_and_lock_event_fd())
        bm = b.query_lookup_and_lock_result(t)
        assert bm is not None and all(bm.test(i) for i in range(8))
        dst = [_l2_obj(255) for _ in range(8)]
        t = b.submit_load_task(keys, dst)
        _l2_wait(b.get_load_event_fd())
        bm = b.query_load_result(t)
        assert bm is not None and all(bm.test(i) for i in range(8))
        assert all(bool((d.tensor == i).all()) for i, d in enumerate(dst))
        b.submit_unlock(keys)
    finally:
        b.close()


def test_l2_adapter_stores_again_what_another_process_on_the_folder_removed(
    tmp_path: Path,
) -> None:
    """Two adapters on one disk folder at once (two servers' processes): a store task
    reads first what the other did, so a key the other removed is written again, not
    skipped as held, and a lookup then finds it."""
    from lmcache.v1.distributed.api import ObjectKey

    from hurray_store.adapters.lmcache import HurrayL2Adapter

    (tmp_path / "h.yaml").write_text(
        f"tiers:\n  - {{type: disk, path: {tmp_path / 'cache'}, capacity_bytes: 1073741824}}\n"
    )
    k = [ObjectKey(b"\x07" * 16, "tiny", 0)]
    a = HurrayL2Adapter({"config": str(tmp_path / "h.yaml")})
    b = HurrayL2Adapter({"config": str(tmp_path / "h.yaml")})

    def store(x: Any, fill: int) -> None:
        x.submit_store_task(k, [_l2_obj(fill)])
        _l2_wait(x.get_store_event_fd())
        (res,) = x.pop_completed_store_tasks().values()
        assert res.is_successful()

    try:
        store(a, 7)
        store(b, 7)  # held already: read from the other's changes
        a.delete(k)
        store(b, 7)
        t = b.submit_lookup_and_lock_task(k, {})
        _l2_wait(b.get_lookup_and_lock_event_fd())
        bm = b.query_lookup_and_lock_result(t)
        assert bm is not None and bm.test(0)
        dst = [_l2_obj(255)]
        t = b.submit_load_task(k, dst)
        _l2_wait(b.get_load_event_fd())
        bm = b.query_load_result(t)
        assert bm is not None and bm.test(0) and bool((dst[0].tensor == 7).all())
        b.submit_unlock(k)
    finally:
        a.close()
        b.close()


def test_the_documented_lmcache_server_command_runs_with_the_adapter(tmp_path: Path) -> None:
    """docs/lmcache.md's `lmcache server` command, as written (ports and tiers file
    swapped for the test's): the server comes up with HurrayL2Adapter as its one L2
    adapter, which opens the store's tiers, and shuts down cleanly on Ctrl-C."""
    import json
    import shlex
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    from hurray_store.testing.services import free_port

    doc = (Path(__file__).parent.parent / "docs" / "lmcache.md").read_text()
    start = doc.index("```sh\n", doc.index("## The multiprocess server")) + len("```sh\n")
    cmd = doc[start : doc.index("```", start)].replace("\\\n", " ")
    port, http = free_port(), free_port()
    (tmp_path / "tiers.yaml").write_text(
        f"tiers:\n  - {{type: disk, path: {tmp_path / 'cache'}, capacity_bytes: 1073741824}}\n"
    )
    cmd = cmd.replace("--port 5555", f"--port {port} --http-port {http}")
    cmd = cmd.replace("--l1-size-gb 4", "--l1-size-gb 0.25")
    cmd = cmd.replace("configs/lmcache-hurray.yaml", str(tmp_path / "tiers.yaml"))
    argv = shlex.split(cmd)
    env = dict(os.environ, LMCACHE_DISABLE_BANNER="1")
    for a in [x for x in argv if "=" in x and x.split("=")[0].isupper()]:
        env[a.split("=", 1)[0]] = a.split("=", 1)[1]
        argv.remove(a)
    assert argv[:2] == ["lmcache", "server"], argv
    argv[0] = str(Path(sys.executable).parent / "lmcache")
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 120
            status: dict[str, Any] = {}
            while not status:
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "the server did not come up"
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{http}/status", timeout=2) as r:
                        status = json.loads(r.read())
                except OSError:
                    time.sleep(0.5)
            (sc,) = status["storage_manager"]["store_controllers"].values()
            assert status["is_healthy"] and sc["num_active_adapters"] == 1, status
            url = f"http://127.0.0.1:{http}/config/adapters"
            with urllib.request.urlopen(url, timeout=5) as r:
                (adapter,) = json.loads(r.read())["adapters"]
            assert adapter["type_name"] == "plugin"
            assert (tmp_path / "cache" / "journal").exists(), "the adapter opened the tiers"
        finally:
            proc.send_signal(signal.SIGINT)  # Ctrl-C: the server stops its parts
            rc = proc.wait(timeout=60)
    text = log.read_text()
    assert rc in (0, 130), text[-3000:]  # 130: the CLI's exit code after Ctrl-C
    assert "Traceback" not in text, text[-3000:]


_L2_WRITER = """
import os, sys, time
import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj
from hurray_store.adapters.lmcache import HurrayL2Adapter

n = 1 << 20
a = HurrayL2Adapter({"config": sys.argv[1]})
keys = [ObjectKey(bytes([i]) * 16, "tiny", 0) for i in range(int(sys.argv[2]))]
objs = []
for i in range(len(keys)):
    raw = torch.full((n,), i % 251, dtype=torch.uint8)
    meta = MemoryObjMetadata(torch.Size([n]), torch.uint8, 0, n, 1)
    objs.append(TensorMemoryObj(raw, meta, None))
a.submit_store_task(keys, objs)
print("submitted", flush=True)
time.sleep(60)  # killed before this ends
"""


def test_l2_adapter_killed_mid_store_leaves_no_record_without_its_object(
    tmp_path: Path,
) -> None:
    """A process storing 128 keys through the adapter is SIGKILLed while it writes. A
    new adapter over the same folder: every key a lookup finds loads and verifies,
    bit for bit; none is found without its bytes."""
    import signal
    import subprocess
    import sys
    import time

    from lmcache.v1.distributed.api import ObjectKey

    from hurray_store.adapters.lmcache import HurrayL2Adapter

    cfg = tmp_path / "h.yaml"
    cfg.write_text(
        f"tiers:\n  - {{type: disk, path: {tmp_path / 'cache'}, capacity_bytes: 1073741824}}\n"
    )
    n_keys = 128  # 128 MiB: still being written when the third key commits
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false")
    p = subprocess.Popen(
        [sys.executable, "-c", _L2_WRITER, str(cfg), str(n_keys)],
        stdout=subprocess.PIPE,
        env=env,
        cwd=Path(__file__).parent.parent,
    )
    assert p.stdout is not None and p.stdout.readline().strip() == b"submitted"
    journal = tmp_path / "cache" / "journal"
    deadline = time.monotonic() + 30
    while not (journal.exists() and journal.read_text().count("+") >= 3):
        assert time.monotonic() < deadline, "the writer stored nothing"
        time.sleep(0.001)
    p.send_signal(signal.SIGKILL)  # mid-task: some keys written, some not
    p.wait()
    keys = [ObjectKey(bytes([i]) * 16, "tiny", 0) for i in range(n_keys)]
    b = HurrayL2Adapter({"config": str(cfg)})
    try:
        t = b.submit_lookup_and_lock_task(keys, {})
        _l2_wait(b.get_lookup_and_lock_event_fd())
        found = b.query_lookup_and_lock_result(t)
        assert found is not None
        hits = [i for i in range(n_keys) if found.test(i)]
        assert hits, "keys committed before the kill are found"
        assert len(hits) < n_keys, "the kill came in the middle of the task"
        dst = [_l2_obj(255, 1 << 20) for _ in hits]
        t = b.submit_load_task([keys[i] for i in hits], dst)
        _l2_wait(b.get_load_event_fd())
        loaded = b.query_load_result(t)
        assert loaded is not None and all(loaded.test(j) for j in range(len(hits)))
        assert all(bool((d.tensor == i % 251).all()) for i, d in zip(hits, dst, strict=True))
        b.submit_unlock([keys[i] for i in hits])
    finally:
        b.close()


def test_l2_adapter_publishes_kv_events_keyed_by_lmcaches_chunk_hashes(tmp_path: Path) -> None:
    """With ``events`` in the store's YAML, each object the L2 adapter stores is a
    ``BlockStored`` keyed by LMCache's own chunk hash, in the cpu tier's medium and,
    written through, the disk tier's."""
    from lmcache.v1.distributed.api import ObjectKey

    from hurray_store.adapters.lmcache import HurrayL2Adapter
    from hurray_store.events.subscriber import Subscriber
    from hurray_store.testing.services import free_port

    ep, rep = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    (tmp_path / "h.yaml").write_text(
        "tiers:\n  - {type: cpu, capacity_bytes: 67108864}\n"
        f"  - {{type: disk, path: {tmp_path / 'cache'}, capacity_bytes: 1073741824}}\n"
        f"events: {{endpoint: '{ep}', replay_endpoint: '{rep}', topic: l2-test}}\n"
    )
    keys = [ObjectKey(bytes([i]) * 16, "tiny", 0) for i in range(3)]
    a = HurrayL2Adapter({"config": str(tmp_path / "h.yaml")})
    sub = Subscriber(ep, "l2-test", rep)
    try:
        a.submit_store_task(keys, [_l2_obj(i) for i in range(3)])
        _l2_wait(a.get_store_event_fd())
        assert a.pop_completed_store_tasks()
        a.port.flush()
        a.port.relay.send()
        assert a.port.relay.publisher.flush()
        evs = [e for r in sub.replay(0) for e in r.batch.events]
    finally:
        sub.close()
        a.close()
    got = {(e.medium, bytes(e.block_hashes[0])) for e in evs if type(e).__name__ == "BlockStored"}
    assert got == {(m, bytes([i]) * 16) for m in ("CPU", "STORAGE") for i in range(3)}


def test_lmcaches_clear_after_a_weight_update_never_finds_the_old_chunks(
    opened: Any, tmp_path: Path
) -> None:
    """LMCache's storage manager clears every backend (as after a weight update): the
    plugin's chunks stored before are not found after it (a new generation of the
    weights' identity names chunks), pins held across it are let go, and chunks put
    after it are found."""
    from hurray_store.tiny_model import build_tiny_model

    build_tiny_model(str(tmp_path / "m1"), layers=1, seed=1)
    b = opened(model_path=tmp_path / "m1")
    p = plugin_of(b)
    objs = [chunk(b, 64, 31), chunk(b, 64, 32)]
    p.batched_submit_put_task([key(31), key(32)], objs)
    p.flush()
    assert p.batched_contains([key(31), key(32)], pin=True) == 2
    cleared = p.clear()
    assert cleared == 0 and "+generation:" in p.identity
    assert p.batched_contains([key(31), key(32)]) == 0
    assert p.get_blocking(key(31)) is None
    assert not p.unpin(key(31)), "its pin was let go at the clear"
    again = [chunk(b, 64, 31)]
    want = again[0].tensor.clone()
    p.batched_submit_put_task([key(31)], again)
    p.flush()
    got = p.get_blocking(key(31))
    assert got is not None and torch.equal(got.tensor, want)
    got.ref_count_down()
