"""The engine port (``hurray_store.engine.EnginePort``): lookups and their pins, the read
routes, ordered loads that check before they copy, the bounded save backlog, saves from
lent memory, and the feed of what was stored and removed. Real tiers (disk, cpu)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hurray_store.engine import EnginePort, Save
from hurray_store.tiers.memory import memory_charge


def disk(tmp_path: Path, cap: int = 1 << 20) -> dict[str, Any]:
    return {"type": "disk", "path": str(tmp_path / "d"), "capacity_bytes": cap}


def cpu(cap: int = 1 << 20) -> dict[str, Any]:
    return {"type": "cpu", "capacity_bytes": cap}


@pytest.fixture
def ports() -> Iterator[list[EnginePort]]:
    made: list[EnginePort] = []
    yield made
    for p in made:
        p.close()


def open_port(ports: list[EnginePort], *tiers: dict[str, Any], **kw: Any) -> EnginePort:
    p = EnginePort({"namespace": "t", "tiers": list(tiers)}, **kw)
    ports.append(p)
    return p


def saved(port: EnginePort, items: dict[str, bytes]) -> None:
    assert port.save_lent([list(items.items())]) == [True] * len(items)


def test_a_lookup_counts_the_leading_run_and_takes_no_key_past_the_first_miss(
    tmp_path: Path, ports: list[EnginePort]
) -> None:
    port = open_port(ports, disk(tmp_path))
    saved(port, {"a": b"x" * 10, "b": b"y" * 10, "d": b"z" * 10})
    taken: list[str] = []

    def keys() -> Iterator[str]:
        for k in ("a", "b", "c", "d"):
            taken.append(k)
            yield k

    assert port.lookup(keys()).n == 2 and taken == ["a", "b", "c"]
    taken.clear()
    held = port.lookup(keys(), pin=True)
    assert held.n == 2 and len(held.pins) == 2 and taken == ["a", "b", "c"]
    port.release(held)
    # by handles, the same answer; a handle of an object never stored is a miss
    refs = [port.ref(k) for k in ("a", "b", "c")]
    assert port.lookup(refs).n == 2
    held = port.lookup(refs, pin=True)
    assert held.n == 2
    for p in held.pins:
        port.release_one(p)
    assert port.held_each(["c", "d", "a"]) == [False, True, True]
    assert port.lookup([]).n == 0


def test_a_pinned_object_is_not_evicted_until_it_is_released(ports: list[EnginePort]) -> None:
    port = open_port(ports, cpu(cap=3 * memory_charge(1000)))
    saved(port, {"a": b"a" * 1000, "b": b"b" * 1000})
    held = port.lookup(["a"], pin=True)
    saved(port, {"c": b"c" * 1000, "d": b"d" * 1000})  # room for two more: b goes, not a
    assert port.held_each(["a", "b", "c", "d"]) == [True, False, True, True]
    port.release(held)
    saved(port, {"e": b"e" * 1000})  # a is the oldest now, and free to go
    assert port.held_each(["a", "e"]) == [False, True]


@pytest.mark.parametrize("tier", ["disk", "cpu"])
def test_reads_land_in_the_callers_buffers_on_either_route(
    tmp_path: Path, ports: list[EnginePort], tier: str
) -> None:
    port = open_port(ports, disk(tmp_path) if tier == "disk" else cpu())
    saved(port, {"a": bytes(range(100)), "b": b"b" * 50})
    bufs = [bytearray(10), bytearray(20), bytearray(50), bytearray(5)]
    hashed: list[tuple[int, int]] = []
    got = port.read(
        [
            ("a", [(0, 10), (80, 20)], [memoryview(bufs[0]), memoryview(bufs[1])]),
            ("b", [(0, 50)], [memoryview(bufs[2])]),
            ("nowhere", [(0, 5)], [memoryview(bufs[3])]),
        ],
        lambda j, i, s: hashed.append((j, i)),
    )
    assert got == [True, True, False]
    assert bytes(bufs[0]) == bytes(range(10)) and bytes(bufs[1]) == bytes(range(80, 100))
    assert bytes(bufs[2]) == b"b" * 50 and bytes(bufs[3]) == bytes(5)
    # a disk tier reads on the caller's thread, hashing each range as it comes in; a cpu
    # tier is read on the store's loop
    assert sorted(hashed) == ([(0, 0), (0, 1), (1, 0)] if tier == "disk" else [])
    assert port.size("a") == 100 and port.size("nowhere") is None


@pytest.mark.parametrize("tier", ["disk", "cpu"])
def test_a_load_takes_checked_objects_in_order_and_rejects_the_first_wrong_one(
    tmp_path: Path, ports: list[EnginePort], tier: str
) -> None:
    port = open_port(ports, disk(tmp_path) if tier == "disk" else cpu())
    objs = {f"p{i}": bytes([i]) * 64 for i in range(6)}
    objs["p3"] = b"\xff" * 64  # stored, but not what p3's check wants
    saved(port, objs)
    port.take_events()
    into = torch.zeros(6, 64, dtype=torch.uint8)
    checked: list[int] = []

    def check(j: int, mv: memoryview) -> str:
        checked.append(j)
        return "" if bytes(mv) == bytes([j]) * 64 else f"page {j} holds other bytes"

    def take(j: int, obj: torch.Tensor) -> None:
        assert j not in [k for k in range(6) if into[k].any()], "each page taken once"
        into[j].copy_(obj)

    names = [f"p{i}" for i in range(6)]
    assert port.load(names, 64, check, take) == 3
    assert [bytes(into[j].numpy()) for j in range(3)] == [bytes([j]) * 64 for j in range(3)]
    assert not into[3:].any(), "nothing past the first wrong object reached the engine"
    assert checked == [0, 1, 2, 3]
    # the wrong object left the store, told as a removal for that reason
    assert port.held_each(["p3", "p4"]) == [False, True]
    removed = [(e.name, e.reason) for e in port.take_events() if e.kind == "removed"]
    assert removed == [("p3", "rejected")]
    assert port.stats()["port"]["rejected"] == 1
    # a load of what is not held takes nothing and rejects nothing
    assert port.load(["p3", "p0"], 64, check, take) == 0
    assert port.stats()["port"]["rejected"] == 1


def test_the_save_backlog_drops_the_oldest_waiting_saves_and_never_blocks(
    ports: list[EnginePort],
) -> None:
    port = open_port(ports, cpu(), save_backlog_bytes=250, saves_in_flight=1)
    outcomes: dict[str, bool] = {}
    done = threading.Event()

    def on_done(name: str) -> Any:
        def f(ok: bool) -> None:
            outcomes[name] = ok
            if len(outcomes) == 4:
                done.set()

        return f

    port.save([Save(n, n.encode() * 100, 100, on_done(n)) for n in ("a", "b", "c")])
    port.save([Save("big", b"x" * 300, 300, on_done("big"))])  # more than the whole backlog
    assert done.wait(10)
    assert outcomes == {"a": False, "b": True, "c": True, "big": False}
    port.flush()
    assert port.held_each(["a", "b", "c", "big"]) == [False, True, True, False]
    st = port.stats()["port"]
    assert st["saves_dropped"] == 2 and st["saves_saved"] == 2
    assert st["saves_pending_bytes"] == 0


def test_a_save_of_an_object_already_saving_is_not_made_twice(ports: list[EnginePort]) -> None:
    port = open_port(ports, cpu(), saves_in_flight=1)
    seen: list[bool] = []
    port.save([Save("a", b"1" * 10, 10, seen.append), Save("a", b"2" * 10, 10, seen.append)])
    port.flush()
    assert seen == [True] and not port.saving("a")
    assert port.call(port.store.get_object("a")) == b"1" * 10


def test_events_tell_each_object_stored_and_removed_with_its_tier_and_reason(
    tmp_path: Path, ports: list[EnginePort]
) -> None:
    port = open_port(ports, cpu(cap=int(2.5 * memory_charge(1000))), disk(tmp_path))
    saved(port, {"a": b"a" * 1000, "b": b"b" * 1000})
    got = [(e.kind, e.tier, e.name, e.reason) for e in port.take_events()]
    assert sorted(got) == sorted(
        [("stored", t, n, "write") for t in ("cpu", "disk") for n in ("a", "b")]
    )
    saved(port, {"c": b"c" * 1000})  # the cpu tier evicts a
    got = [(e.kind, e.tier, e.name, e.reason) for e in port.take_events()]
    assert ("removed", "cpu", "a", "evict") in got and ("stored", "cpu", "c", "write") in got
    assert port.delete("b") and not port.delete("b")
    got = [(e.kind, e.tier, e.name, e.reason) for e in port.take_events()]
    assert sorted(got) == [("removed", "cpu", "b", "delete"), ("removed", "disk", "b", "delete")]
    assert port.take_events() == []
    seqs = []
    saved(port, {"d": b"d"})
    seqs = [e.seq for e in port.take_events()]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def test_an_event_feed_nobody_drains_keeps_the_newest_and_counts_what_it_lost(
    ports: list[EnginePort],
) -> None:
    port = open_port(ports, cpu(), events_kept=3)
    saved(port, {f"o{i}": b"x" for i in range(5)})
    events = port.take_events()
    assert [e.name for e in events] == ["o2", "o3", "o4"]
    assert port.stats()["port"]["events_dropped"] == 2


def test_a_port_sees_what_another_process_on_its_folder_stored_and_removed(
    tmp_path: Path, ports: list[EnginePort]
) -> None:
    a = open_port(ports, disk(tmp_path))
    b = open_port(ports, disk(tmp_path))
    saved(a, {"x": b"x" * 100, "y": b"y" * 100})
    assert b.lookup(["x", "y"]).n == 2
    found = [(e.kind, e.name, e.reason) for e in b.take_events()]
    assert sorted(found) == [("stored", "x", "found"), ("stored", "y", "found")]
    assert a.delete("x")
    assert b.lookup(["x", "y"]).n == 0 and b.held_each(["x", "y"]) == [False, True]
    assert ("removed", "x", "other_process") in [
        (e.kind, e.name, e.reason) for e in b.take_events()
    ]


def test_a_lent_save_returns_once_every_object_is_written_through(
    tmp_path: Path, ports: list[EnginePort]
) -> None:
    port = open_port(ports, cpu(), disk(tmp_path))
    lent = bytearray(b"k" * 4096)

    def steps() -> Iterator[list[tuple[str, Any]]]:
        for s in range(3):
            yield [(f"s{s}.{i}", memoryview(lent)[i * 512 : (i + 1) * 512]) for i in range(2)]

    assert port.save_lent(steps()) == [True] * 6
    lent[:] = b"\0" * 4096  # the engine reuses its memory: the store kept its own bytes
    tiers = port.stats()["tiers"]
    assert tiers["cpu"]["objects"] == 6 and tiers["disk"]["objects"] == 6
    assert port.call(port.store.get_object("s2.1")) == b"k" * 512


def test_a_closed_port_refuses_saves_as_failures_not_hangs(ports: list[EnginePort]) -> None:
    port = open_port(ports, cpu())
    port.close()
    seen: list[bool] = []
    port.save([Save("late", b"x", 1, seen.append)])
    assert seen == [False]


def test_a_closed_port_answers_calls_that_need_its_loop_with_an_error_at_once(
    ports: list[EnginePort],
) -> None:
    port = open_port(ports, cpu())
    saved(port, {"a": b"x" * 10})
    port.close()
    with pytest.raises(RuntimeError, match="closed"):
        port.read([("a", [(0, 10)], [memoryview(bytearray(10))])])  # a cpu tier: the loop's
    with pytest.raises(RuntimeError, match="closed"):
        port.delete("a")


def test_room_reserved_before_a_copy_out_drops_the_oldest_waiting_and_is_given_back(
    ports: list[EnginePort],
) -> None:
    port = open_port(ports, cpu(), save_backlog_bytes=300, saves_in_flight=1)
    seen: dict[str, bool] = {}
    held = threading.Event()  # the store's loop held: no writer starts meanwhile
    port.thread.loop.call_soon_threadsafe(held.wait, 10)
    try:
        port.save(
            [Save(n, n.encode() * 100, 100, lambda ok, n=n: seen.update({n: ok})) for n in "ab"]
        )
        assert port.saves_pending() == (200, 2)
        assert port.reserve(200)  # room for 200 more: the oldest waiting save ("a") goes
        assert seen == {"a": False}
        assert not port.reserve(400)  # more than the whole backlog: refused
        port.unreserve(200)  # the copy-out failed: its room comes back
    finally:
        held.set()
    port.flush()
    assert seen == {"a": False, "b": True}
    assert port.saves_pending() == (0, 0)
    assert port.stats()["port"]["saves_dropped"] == 2


def test_a_closed_port_refuses_loads_and_lent_saves_at_once(
    tmp_path: Path, ports: list[EnginePort]
) -> None:
    """An engine calling after close (SGLang's backend, say) gets an error at once, never
    a wait for a loop that is gone."""
    port = open_port(ports, disk(tmp_path))
    saved(port, {"a": b"x" * 64})
    port.close()
    with pytest.raises(RuntimeError, match="closed"):
        port.save_lent([[("b", b"y" * 64)]])
    with pytest.raises(RuntimeError, match="closed"):
        port.load(["a"], 64, lambda j, mv: "", lambda j, t: None)


def test_what_the_loop_was_handed_before_a_save_runs_before_it(ports: list[EnginePort]) -> None:
    """A writer that just ended a save takes the next only after the loop ran what it
    was handed meanwhile (an engine's touch of an object, then a save that may evict):
    the two take effect in the order the engine made them."""
    port = open_port(ports, cpu(), saves_in_flight=1)
    order: list[str] = []
    done = threading.Event()

    async def write_b() -> bool:
        order.append("b written")
        done.set()
        return True

    def after_a(ok: bool) -> None:  # on the store's loop, inside the writer
        port.thread.loop.call_soon(order.append, "touched")
        port.save([Save("b", None, 1, None, write_b)])

    port.save([Save("a", b"a", 1, after_a)])
    assert done.wait(10)
    assert order == ["touched", "b written"]


def test_what_a_leased_lookup_counted_survives_eviction_until_its_load(
    ports: list[EnginePort],
) -> None:
    """Exists, then other saves fill the tier, then the get: a leased lookup's objects
    are not evicted in between (they used to be: the get delivered fewer than promised);
    the load ends the leases, and later saves evict them again. A lease no load ends
    runs out after ``engine.lease_s``."""
    p = EnginePort(
        {
            "namespace": "t",
            "tiers": [{"type": "cpu", "capacity_bytes": 8 * memory_charge(1024)}],
            "engine": {"lease_s": 0.3},
        }
    )
    ports.append(p)
    first = {f"a{i}": bytes([i]) * 1024 for i in range(4)}
    saved(p, first)
    assert p.lookup(list(first), lease=True).n == 4
    assert p.stats()["port"]["leases"] == 4
    p.save_lent([[(f"b{i}", bytes([9]) * 1024) for i in range(8)]])  # the tier is full
    out: list[bytes] = []
    n = p.load(list(first), 1024, lambda j, b: "", lambda j, t: out.append(bytes(t.numpy())))
    assert n == 4 and out == list(first.values()), "a promised object was evicted"
    assert p.stats()["port"]["leases"] == 0
    p.save_lent([[(f"c{i}", bytes([7]) * 1024) for i in range(8)]])
    assert p.lookup(list(first)).n == 0, "no longer leased: evicted as any other"
    assert p.lookup([f"c{i}" for i in range(8)], lease=True).n > 0
    time.sleep(0.4)
    p.save_lent([[("d", bytes(1024))]])  # any call past the lease's end lets it go
    assert p.stats()["port"]["leases"] == 0 and p.stats()["port"]["leases_expired"] > 0
