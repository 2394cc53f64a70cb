"""The policy as exact scenario tables: which groups survive, in which order they were
evicted, where puts land, what is promoted."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator

import pytest

from hurray_store.store import ledger as ledger_module
from hurray_store.store.ledger import KeyRef, Ledger
from hurray_store.store.policy import Admission, Policy, TierInfo

MEM = TierInfo("cpu", 100, False)
DISK = TierInfo("disk", 1000, True)


def make(tiers: list[TierInfo], **kw: object) -> Policy:
    return Policy(Ledger(tiers), **kw)  # type: ignore[arg-type]


def take(p: Policy, tier: int, group: str, sizes: dict[str, int], depth: int = 0) -> Admission:
    """Plan a write and apply the plan to the ledger, as the cascade does."""
    with p.ledger.lock:
        adm = p.plan_write(tier, group, sizes, depth=depth)
        if adm.accepted:
            p.ledger.take_room(tier, group, sizes, depth, [v.group for v in adm.victims])
    return adm


def admit(p: Policy, tier: int, group: str, sizes: dict[str, int], depth: int = 0) -> Admission:
    """Plan a write, apply it and complete it (the bytes written)."""
    adm = take(p, tier, group, sizes, depth)
    if adm.accepted:
        p.ledger.complete_write(tier, group, True)
    return adm


def evicted(p: Policy, tier: int, group: str, size: int, depth: int = 0) -> list[str]:
    adm = admit(p, tier, group, {group + "/0": size}, depth=depth)
    assert adm.accepted, adm.reason
    return [v.group for v in adm.victims]  # type: ignore[misc]


def test_lru_order_of_eviction() -> None:
    p = make([MEM])
    table = [  # (group, size, touched before admit, expected victims)
        ("a", 40, [], []),
        ("b", 40, [], []),
        ("c", 40, [], ["a"]),
        ("d", 20, ["b"], []),
        ("e", 30, [], ["c"]),
        ("f", 60, ["d"], ["b", "e"]),
    ]
    for group, size, touched, victims in table:
        p.ledger.touch(touched)
        assert evicted(p, 0, group, size) == victims, group
    assert p.ledger.groups(0) == ["d", "f"] and p.ledger.used_bytes(0) == 80


def test_deeper_groups_go_first_when_ages_tie() -> None:
    p = make([MEM])
    for g, depth in (("prefix", 1), ("mid", 2), ("suffix", 3)):
        evicted(p, 0, g, 30, depth)
    p.ledger.touch(["prefix", "suffix", "mid"])  # one operation: ages tie
    assert p.ledger.groups(0) == ["suffix", "mid", "prefix"]
    assert evicted(p, 0, "new", 50) == ["suffix", "mid"]


def test_pinned_groups_survive_and_a_fully_pinned_tier_refuses() -> None:
    p = make([MEM])
    evicted(p, 0, "a", 50)
    evicted(p, 0, "b", 50)
    p.ledger.pin(["a"])
    assert evicted(p, 0, "c", 50) == ["b"]
    p.ledger.pin(["c"])
    adm = admit(p, 0, "d", {"d/0": 10})
    assert not adm.accepted and "pinned" in adm.reason
    assert p.ledger.groups(0) == ["a", "c"]  # the refusal evicted nothing
    p.ledger.unpin(["a"])
    assert evicted(p, 0, "d", 10) == ["a"]


def test_pins_by_handle_hold_the_copy_found_and_follow_it_when_it_leaves() -> None:
    """``pin_refs`` pins the copy a get finds (the fastest READY one) through a kept
    handle: pinned, its group is never a victim; a handle whose copy left the ledger, or
    is being written again, finds the key anew or stops the prefix there."""
    p = make([MEM, DISK])
    led = p.ledger
    evicted(p, 0, "a", 50)
    evicted(p, 1, "a", 50)
    evicted(p, 0, "b", 50)
    ra, rb, rc = KeyRef("a/0"), KeyRef("b/0"), KeyRef("c/0")
    pins = led.pin_refs([ra, rb, rc])  # no "c": the prefix ends there
    assert pins == [ra.entry, rb.entry] and rc.entry is None
    assert ra.entry is dict(led.entries(0))["a"]  # the faster copy
    assert led.is_pinned("a") and led.is_pinned("b")
    adm = admit(p, 0, "c", {"c/0": 10})  # both pinned: no room in the top tier
    assert not adm.accepted and "pinned" in adm.reason
    for e in pins:
        led.unpin_one(e)
    assert not led.is_pinned("a") and not led.is_pinned("b")
    assert evicted(p, 0, "c", 50) == ["a"]  # let go, "a" is a victim again
    # The copy "ra" held left the top tier: the next pin finds the one on disk.
    (pin,) = led.pin_refs([ra])
    assert pin is ra.entry is dict(led.entries(1))["a"] and led.is_pinned("a")
    led.unpin_one(pin)
    # "b" written again: its old entry is no copy any more; WRITING is none to pin.
    old = rb.entry
    assert take(p, 0, "b", {"b/0": 50}).accepted
    assert old is not None and not old.ready
    assert led.pin_refs([rb]) == [] and rb.entry is old
    led.complete_write(0, "b", True)
    (pin,) = led.pin_refs([rb])
    assert pin is rb.entry is not old and pin.ready
    led.refresh(rc)  # "c" since written: found without a pin
    assert rc.entry is dict(led.entries(0))["c"] and not led.is_pinned("c")
    rz = KeyRef("z/0")
    led.refresh(rz)  # never written: nothing to find
    assert rz.entry is None and led.pin_refs([rz]) == []


def test_a_handle_whose_key_moved_to_another_group_pins_the_new_one() -> None:
    """A key written again in another group of the same tier: a handle holding the old
    group's entry, still READY for its other keys, pins the key's new group."""
    p = make([DISK])
    led = p.ledger
    admit(p, 0, "g1", {"k": 10, "g1/0": 10})
    rk, rg = KeyRef("k"), KeyRef("g1/0")
    led.refresh(rk)
    led.refresh(rg)
    first = rk.entry
    assert first is rg.entry is dict(led.entries(0))["g1"]
    admit(p, 0, "g2", {"k": 10})  # "k" is g2's now; g1 keeps "g1/0"
    (pin,) = led.pin_refs([rk])
    assert pin is rk.entry is dict(led.entries(0))["g2"] and pin is not first
    assert led.is_pinned("g2") and not led.is_pinned("g1")
    (pin2,) = led.pin_refs([rg])  # g1's own key: g1, found again by its key
    assert pin2 is first and first.ready and led.is_pinned("g1")


def test_placement_skips_tiers_too_small_for_the_group() -> None:
    p = make([MEM, DISK])
    assert p.place(100) == 0
    assert p.place(101) == 1
    assert p.place(1001) is None
    assert not admit(p, 0, "big", {"big/0": 101}).accepted


@pytest.mark.parametrize(
    ("mode", "top", "through"),
    [("through", 0, [1, 2]), ("through", 1, [2]), ("through", 2, []), ("back", 0, [])],
)
def test_write_through_targets(mode: str, top: int, through: list[int]) -> None:
    p = make([MEM, MEM, DISK], write_mode=mode)
    assert p.write_through_targets(top) == through


def test_write_back_demotes_victims_one_tier_down() -> None:
    p = make([MEM, DISK], write_mode="back")
    evicted(p, 0, "a", 60)
    adm = admit(p, 0, "b", {"b/0": 60})
    assert [(v.group, v.demote_to) for v in adm.victims] == [("a", 1)]
    admit(p, 1, "b", {"b/0": 60})  # b also below: no demotion when it leaves the top
    adm = admit(p, 0, "c", {"c/0": 60})
    assert [(v.group, v.demote_to) for v in adm.victims] == [("b", None)]


def test_write_through_victims_are_not_demoted() -> None:
    p = make([MEM, DISK], write_mode="through")
    evicted(p, 0, "a", 60)
    assert [v.demote_to for v in admit(p, 0, "b", {"b/0": 60}).victims] == [None]


def test_promotion_targets() -> None:
    p = make([MEM, MEM, DISK])
    admit(p, 2, "g", {"g/0": 10})
    admit(p, 0, "g", {"g/0": 10})
    assert p.promote_targets(2, "g") == [1]
    assert p.promote_targets(0, "g") == []
    assert make([MEM, DISK], promote_on_hit=False).promote_targets(1, "g") == []


def test_flush_targets_in_write_back() -> None:
    p = make([MEM, DISK], write_mode="back")
    admit(p, 0, "a", {"a/0": 10})
    admit(p, 0, "b", {"b/0": 10})
    admit(p, 1, "b", {"b/0": 10})
    assert p.flush_targets() == [("a", 0, 1)]
    assert make([MEM, DISK]).flush_targets() == []


def test_books_follow_keys_and_groups() -> None:
    p = make([MEM, DISK])
    admit(p, 0, "s", {"s/0": 10, "s/m": 2})
    p.ledger.add_ready(1, "s", {"s/0": 10, "s/m": 2})
    assert p.ledger.holders("s/m") == [0, 1] and p.ledger.group_of(0, "s/0") == "s"
    assert p.ledger.num_objects(0) == 2 and p.ledger.used_bytes(0) == 12
    assert p.ledger.forget(0, "s") == {"s/0": 10, "s/m": 2}
    assert p.ledger.holders("s/m") == [1] and p.ledger.used_bytes(0) == 0


def test_readmitting_a_group_replaces_its_bytes() -> None:
    p = make([MEM])
    admit(p, 0, "a", {"a/0": 80})
    assert admit(p, 0, "a", {"a/0": 90}).victims == ()
    assert p.ledger.used_bytes(0) == 90


def test_unbounded_tier_never_evicts() -> None:
    p = make([TierInfo("redis", None, True)])
    for i in range(100):
        assert admit(p, 0, f"g{i}", {f"g{i}/0": 1 << 40}).victims == ()


def test_a_group_being_written_is_unreadable_and_never_a_victim() -> None:
    p = make([MEM])
    led = p.ledger
    assert take(p, 0, "w", {"w/0": 60, "w/m": 10}).accepted
    assert led.holders("w/m") == [] and led.group_holders("w") == [], (
        "not readable before its bytes exist"
    )
    assert led.used_bytes(0) == 70, "its room is taken at once"
    adm = take(p, 0, "x", {"x/0": 40})
    assert not adm.accepted and "being written" in adm.reason, (
        "the only candidate victim is being written"
    )
    led.complete_write(0, "w", True)
    assert led.holders("w/m") == [0] and led.group_holders("w") == [0]
    assert [v.group for v in take(p, 0, "x", {"x/0": 40}).victims] == ["w"]


def test_a_failed_write_leaves_no_trace_in_the_books() -> None:
    p = make([MEM])
    assert take(p, 0, "w", {"w/0": 60}).accepted
    p.ledger.complete_write(0, "w", False)
    assert (
        p.ledger.groups(0) == []
        and p.ledger.used_bytes(0) == 0
        and p.ledger.group_of(0, "w/0") is None
    )


def test_a_group_cannot_be_written_twice_into_one_tier_at_once() -> None:
    p = make([MEM])
    assert take(p, 0, "w", {"w/0": 10}).accepted
    assert not take(p, 0, "w", {"w/0": 10}).accepted


@pytest.mark.parametrize(
    ("tiers_read", "source"),
    [
        ({1}, 1),
        ({2}, 2),
        ({0}, None),
        ({None}, None),
        ({1, None}, None),
        ({1, 2}, None),
        (set(), None),
    ],
)
def test_promotion_after_a_read(tiers_read: set[int | None], source: int | None) -> None:
    assert make([MEM, MEM, DISK]).promote_after_read(tiers_read) == source


def test_read_whole_only_when_every_page_is_wanted_and_it_will_be_promoted() -> None:
    p = make([MEM, DISK])
    admit(p, 1, "g", {"g/0": 10})
    assert p.read_whole(1, "g", every_page=True, on_device=False)
    assert not p.read_whole(1, "g", every_page=False, on_device=False)
    assert not p.read_whole(1, "g", every_page=True, on_device=True)
    admit(p, 0, "g", {"g/0": 10})
    assert not p.read_whole(1, "g", every_page=True, on_device=False), "already above: no promotion"


def test_verification_and_scans_follow_the_tier_kind() -> None:
    trusted = TierInfo("cpu", 100, False, trusted=True)
    shared = TierInfo("remote", None, True, shared=True)
    p = make([trusted, DISK, shared])
    assert [p.verify_reads(i) for i in range(3)] == [False, True, True]
    assert [p.scan_at_open(i) for i in range(3)] == [False, True, False]


def test_flush_skips_groups_still_being_written() -> None:
    p = make([MEM, DISK], write_mode="back")
    admit(p, 0, "a", {"a/0": 10})
    assert take(p, 0, "b", {"b/0": 10}).accepted
    assert p.flush_targets() == [("a", 0, 1)]


def test_pin_ready_pins_the_ready_prefix_only() -> None:
    p = make([MEM])
    evicted(p, 0, "a", 10)
    evicted(p, 0, "b", 10)
    assert take(p, 0, "w", {"w/0": 10}).accepted  # WRITING: no get finds it yet
    assert p.ledger.pin_ready(["a/0", "b/0", "w/0", "a/0"]) == ["a", "b"]  # the pins
    assert p.ledger.is_pinned("a") and p.ledger.is_pinned("b")
    assert not p.ledger.is_pinned("w")
    assert p.ledger.pin_ready(["nowhere", "a/0"]) == []
    p.ledger.unpin(["a"])
    assert not p.ledger.is_pinned("a")


def test_pin_ready_takes_no_key_past_the_first_miss() -> None:
    """Engines look up every new prompt, most of them misses: the keys may be made
    lazily, and none is asked for past the first miss."""
    p = make([MEM])
    evicted(p, 0, "a", 10)
    taken: list[str] = []

    def keys() -> Iterator[str]:
        for k in ["a/0", "nowhere", "a/0", "a/0"]:
            taken.append(k)
            yield k

    assert p.ledger.pin_ready(keys()) == ["a"]
    assert taken == ["a/0", "nowhere"]


def test_pins_let_go_are_counted_off_by_the_next_pin_and_never_pile_up() -> None:
    """``unpin`` takes no lock and only notes the pin let go: the next reader of the
    pins counts it off, and so does the next pin, when no write reads them."""
    p = make([MEM])
    evicted(p, 0, "a", 10)
    led = p.ledger
    led.pin(["a", "a"])
    led.unpin(["a"])
    assert led.is_pinned("a")  # one pin of two let go
    led.unpin(["a"])
    assert not led.is_pinned("a")
    for _ in range(5000):  # lookups and their unpins, with no write in between
        led.unpin(led.pin_ready(["a/0"]))
    assert len(led._released) <= ledger_module._RELEASED_KEPT  # not five thousand
    assert not led.is_pinned("a")
    assert take(p, 0, "b", {"b/0": 95}).victims  # and "a" is a victim again


def test_a_group_pinned_from_another_thread_is_never_a_victim() -> None:
    """Engines' threads pin from the ledger while the store's loop evicts: a group is
    either pinned before the policy chooses (then it stays) or off the ledger before
    the pin is tried (then the pin misses), never chosen after a pin succeeded."""
    p = make([MEM])
    led = p.ledger
    held: set[str] = set()  # groups this thread holds a pin on: a subset of the ledger's pins
    stop = threading.Event()
    pinned_count = [0]

    def pinner() -> None:
        while not stop.is_set():
            with led.lock:  # the next victim: the least recently used group
                g = next(iter(led.groups(0)), None)
            if g is not None and led.pin_ready([g + "/0"]):
                held.add(g)
                pinned_count[0] += 1
                time.sleep(0)
                held.discard(g)
                led.unpin([g])

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # hand the GIL over as often as it can
    t = threading.Thread(target=pinner)
    t.start()
    try:
        for n in range(20000):
            adm = take(p, 0, f"g{n}", {f"g{n}/0": 30})
            assert adm.accepted, adm.reason
            assert not {v.group for v in adm.victims} & held  # type: ignore[misc]
            led.complete_write(0, f"g{n}", True)
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
    assert pinned_count[0] > 0  # the thread did pin, often


def test_a_plan_alone_changes_nothing_in_the_books() -> None:
    """``plan_write`` decides; the ledger changes only when the plan is applied."""
    p = make([TierInfo("mem", 100, False)])
    evicted(p, 0, "a", 60)
    adm = p.plan_write(0, "b", {"b/0": 60})
    assert adm.accepted and [v.group for v in adm.victims] == ["a"]
    assert p.ledger.groups(0) == ["a"] and p.ledger.used_bytes(0) == 60, "untouched"
    p.ledger.take_room(0, "b", {"b/0": 60}, 0, ["a"])
    assert p.ledger.groups(0) == ["b"] and p.ledger.is_writing(0, "b")
