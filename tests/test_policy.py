"""The policy as exact scenario tables: which groups survive, in which order they were
evicted, where puts land, what is promoted."""

from __future__ import annotations

import pytest

from hurray_store.policy import Policy, TierInfo

MEM = TierInfo("cpu", 100, False)
DISK = TierInfo("disk", 1000, True)


def evicted(p: Policy, tier: int, group: str, size: int, depth: int = 0) -> list[str]:
    adm = p.admit(tier, group, {group + "/0": size}, depth=depth)
    assert adm.accepted, adm.reason
    return [v.group for v in adm.victims]


def test_lru_order_of_eviction() -> None:
    p = Policy([MEM])
    table = [  # (group, size, touched before admit, expected victims)
        ("a", 40, [], []),
        ("b", 40, [], []),
        ("c", 40, [], ["a"]),
        ("d", 20, ["b"], []),
        ("e", 30, [], ["c"]),
        ("f", 60, ["d"], ["b", "e"]),
    ]
    for group, size, touched, victims in table:
        p.touch(touched)
        assert evicted(p, 0, group, size) == victims, group
    assert p.groups(0) == ["d", "f"] and p.used_bytes(0) == 80


def test_deeper_groups_go_first_when_ages_tie() -> None:
    p = Policy([MEM])
    for g, depth in (("prefix", 1), ("mid", 2), ("suffix", 3)):
        evicted(p, 0, g, 30, depth)
    p.touch(["prefix", "suffix", "mid"])  # one operation: ages tie
    assert p.groups(0) == ["suffix", "mid", "prefix"]
    assert evicted(p, 0, "new", 50) == ["suffix", "mid"]


def test_pinned_groups_survive_and_a_fully_pinned_tier_refuses() -> None:
    p = Policy([MEM])
    evicted(p, 0, "a", 50)
    evicted(p, 0, "b", 50)
    p.pin(["a"])
    assert evicted(p, 0, "c", 50) == ["b"]
    p.pin(["c"])
    adm = p.admit(0, "d", {"d/0": 10})
    assert not adm.accepted and "pinned" in adm.reason
    assert p.groups(0) == ["a", "c"]  # the refusal evicted nothing
    p.unpin(["a"])
    assert evicted(p, 0, "d", 10) == ["a"]


def test_placement_skips_tiers_too_small_for_the_group() -> None:
    p = Policy([MEM, DISK])
    assert p.place(100) == 0
    assert p.place(101) == 1
    assert p.place(1001) is None
    assert not p.admit(0, "big", {"big/0": 101}).accepted


@pytest.mark.parametrize(
    ("mode", "top", "through"),
    [("through", 0, [1, 2]), ("through", 1, [2]), ("through", 2, []), ("back", 0, [])],
)
def test_write_through_targets(mode: str, top: int, through: list[int]) -> None:
    p = Policy([MEM, MEM, DISK], write_mode=mode)
    assert p.write_through_targets(top) == through


def test_write_back_demotes_victims_one_tier_down() -> None:
    p = Policy([MEM, DISK], write_mode="back")
    evicted(p, 0, "a", 60)
    adm = p.admit(0, "b", {"b/0": 60})
    assert [(v.group, v.demote_to) for v in adm.victims] == [("a", 1)]
    p.admit(1, "b", {"b/0": 60})  # b also below: no demotion when it leaves the top
    adm = p.admit(0, "c", {"c/0": 60})
    assert [(v.group, v.demote_to) for v in adm.victims] == [("b", None)]


def test_write_through_victims_are_not_demoted() -> None:
    p = Policy([MEM, DISK], write_mode="through")
    evicted(p, 0, "a", 60)
    assert [v.demote_to for v in p.admit(0, "b", {"b/0": 60}).victims] == [None]


def test_promotion_targets() -> None:
    p = Policy([MEM, MEM, DISK])
    p.admit(2, "g", {"g/0": 10})
    p.admit(0, "g", {"g/0": 10})
    assert p.promote_targets(2, "g") == [1]
    assert p.promote_targets(0, "g") == []
    assert Policy([MEM, DISK], promote_on_hit=False).promote_targets(1, "g") == []


def test_flush_targets_in_write_back() -> None:
    p = Policy([MEM, DISK], write_mode="back")
    p.admit(0, "a", {"a/0": 10})
    p.admit(0, "b", {"b/0": 10})
    p.admit(1, "b", {"b/0": 10})
    assert p.flush_targets() == [("a", 0, 1)]
    assert Policy([MEM, DISK]).flush_targets() == []


def test_books_follow_keys_and_groups() -> None:
    p = Policy([MEM, DISK])
    p.admit(0, "s", {"s/0": 10, "s/m": 2})
    p.record(1, "s", {"s/0": 10, "s/m": 2})
    assert p.holders("s/m") == [0, 1] and p.group_of(0, "s/0") == "s"
    assert p.num_objects(0) == 2 and p.used_bytes(0) == 12
    assert p.forget(0, "s") == {"s/0": 10, "s/m": 2}
    assert p.holders("s/m") == [1] and p.used_bytes(0) == 0


def test_readmitting_a_group_replaces_its_bytes() -> None:
    p = Policy([MEM])
    p.admit(0, "a", {"a/0": 80})
    assert p.admit(0, "a", {"a/0": 90}).victims == ()
    assert p.used_bytes(0) == 90


def test_unbounded_tier_never_evicts() -> None:
    p = Policy([TierInfo("redis", None, True)])
    for i in range(100):
        assert p.admit(0, f"g{i}", {f"g{i}/0": 1 << 40}).victims == ()
