"""The SGLang backend when things go wrong (issue V): eviction between batch_exists and
the get, a hung cache server under it, the weights replaced under it. Real SGLang classes
in their own environment (tests/sglang_cases.py); a file of its own so that it runs
beside tests/test_sglang.py."""

from __future__ import annotations

from pathlib import Path

from tests.test_sglang import disk_config, model, pytestmark, sglang  # noqa: F401


def test_what_batch_exists_counted_is_delivered_though_other_sets_fill_the_tier(
    tmp_path: Path,
) -> None:
    """Exists, then eight other pages set into a cpu tier with room for eight, then the
    get: the four pages exists counted are leased (pinned until their get), so all four
    are read, byte for byte (eviction used to take them: exists promised more than the
    get delivered). The get ends the leases."""
    got = sglang({"model": model(tmp_path / "m", 1), "op": "evict_between"})
    assert got["set"] == [True] * 4 and got["exists"] == 4
    assert got["get"] == [True] * 4 and got["equal"] == [True] * 4
    assert got["more0"] == [True] * 4, "room was made by evicting what no lease held"


def test_a_hung_remote_tier_under_sglang_counts_nothing_and_no_get_waits(
    tmp_path: Path,
) -> None:
    """A cache server SIGSTOPped under the backend for a few seconds: after the first
    exists (before anything failed) every exists is 0 and every get a miss, none
    waiting near the tier's timeout (each used to wait it: exists 64, get 0); the
    sets that no tier took are one warning line, not one per page; resumed, the
    pages are found and read again."""
    from tests.server_helpers import ServerProc

    server = ServerProc(tmp_path / "srv").start()
    try:
        cfg = {"tiers": [server.tier(timeout_s=3.0)], "engine": {"wait_s": 0.2}}
        got = sglang(
            {
                "config": cfg,
                "model": model(tmp_path / "m", 1),
                "op": "down_remote",
                "server_pid": server.proc.pid if server.proc else 0,
                "hang_s": 5.0,
            }
        )
    finally:
        server.resume()
        server.kill()
    assert got["set"] == [True] * 4 and got["exists_before"] == 4
    assert got["exists"][1:] == [0] * (len(got["exists"]) - 1), got["exists"]
    assert not any(got["gets"]) and not any(got["sets"])
    assert got["longest_s"] < 3.0 / 2, "an exists or get waited on the hung server"
    assert got["port"]["calls_late"] == 1
    assert got["log"].count("stored in no tier") <= 1, "one warning per 10 s"
    assert got["not_stored"]["groups"] >= 1
    assert got["exists_after"] == 4 and got["get_after"] == [True] * 4


def test_weights_replaced_in_the_folder_or_a_clear_never_find_the_old_kv(
    tmp_path: Path,
) -> None:
    """The model's weights file is rewritten in place under a running backend: within
    its folder check (1 s) no old page is found (exists 0, every get a miss: they used
    to find all six), the new weights are hashed and keyed by from then on; clear() (a
    weight sync in memory, nothing on disk) starts a new generation: nothing found."""
    got = sglang(
        {"config": disk_config(tmp_path), "model": model(tmp_path / "m", 1), "op": "weights_change"}
    )
    assert got["set"] == [True] * 6 and got["exists_before"] == 6
    assert got["exists_after_replace"] == 0 and got["get_after_replace"] == [False] * 6
    assert got["new_identity"] and got["rehashed"]
    assert got["set_new"] == [True] * 6 and got["exists_new"] == 6
    assert got["exists_after_clear"] == 0 and "+generation:" in got["identity_after_clear"]
