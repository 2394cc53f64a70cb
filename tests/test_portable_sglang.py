"""Portable pages in the SGLang backend against SGLang 0.5.23's own host pools on CPU
tensors (each case in a process of the SGLang environment, ``tests/sglang_cases.py``):
pages named by the model's KV heads a rank holds, read by ranks of other TP sizes
(assembled from narrower ranges or sliced from a wider one), replicated heads stored
once, and MLA's latent written by one rank and read by every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.test_sglang import SGLANG_PY, disk_config, keys, model, page_files, sglang

pytestmark = pytest.mark.skipif(
    not SGLANG_PY.exists(), reason=".venv-sglang missing: `make sglang-env` builds it"
)


def test_pages_of_tp2_ranks_are_read_bit_exact_at_tp1_and_the_reverse(tmp_path: Path) -> None:
    """Ranks 0 and 1 of TP=2 each write their head; a TP=1 pool reads both heads,
    assembled from the two ranks' pages; TP=1 pages are read by each TP=2 rank (a slice
    of them) and by each of TP=4's ranks (replicated heads)."""
    cfg, m = disk_config(tmp_path), model(tmp_path / "m", 1)
    a, b = keys("tp2-", 3), keys("tp1-", 3)
    got = sglang(
        {
            "config": cfg,
            "model": m,
            "op": "batch",
            "runs": [
                {"op": "set", "keys": a, "tp_size": 2, "tp_rank": 0},
                {"op": "set", "keys": a, "tp_size": 2, "tp_rank": 1},
                {"op": "set", "keys": b},
                {"op": "get", "keys": a},
                *({"op": "get", "keys": b, "tp_size": 2, "tp_rank": r} for r in range(2)),
                *({"op": "get", "keys": b, "tp_size": 4, "tp_rank": r} for r in range(4)),
            ],
        }
    )["runs"]
    for r in got[3:]:
        assert r["exists"] == 3 and r["get"] == [True] * 3 and all(r["equal"]), r
        assert r["counts"]["pages_assembled"] == 3 and r["counts"]["pages_written"] == 0
    # the objects: one per page per head range, never one per rank
    assert len(page_files(tmp_path)) == 3 * 2 + 3


def test_replicated_heads_are_stored_once_and_a_missing_range_is_a_miss(tmp_path: Path) -> None:
    """TP=4 over 2 KV heads: ranks 0 and 1 hold head 0, ranks 2 and 3 head 1; each
    head range is stored once (count objects). Only head 0 written: a TP=1 reader
    finds nothing and leaves its slots untouched; a head-0 reader finds it all."""
    cfg, m = disk_config(tmp_path), model(tmp_path / "m", 1)
    k = keys("rep", 2)
    got = sglang(
        {
            "config": cfg,
            "model": m,
            "op": "batch",
            "runs": [
                {"op": "set", "keys": k, "tp_size": 4, "tp_rank": 0},
                {"op": "set", "keys": k, "tp_size": 4, "tp_rank": 1},
                {"op": "get", "keys": k},
                {"op": "get", "keys": k, "tp_size": 2, "tp_rank": 0},
                {"op": "get", "keys": k, "tp_size": 2, "tp_rank": 1},
            ],
        }
    )["runs"]
    assert got[0]["counts"]["pages_written"] == 2
    assert got[1]["counts"]["pages_written"] == 0 and got[1]["counts"]["pages_deduplicated"] == 2
    assert len(page_files(tmp_path)) == 2
    assert got[2]["exists"] == 0 and got[2]["get"] == [False] * 2 and all(got[2]["untouched"])
    assert got[3]["exists"] == 2 and all(got[3]["equal"])
    assert got[4]["exists"] == 0 and all(got[4]["untouched"])


def test_mla_pages_written_by_one_rank_are_read_by_every_rank_of_every_tp_size(
    tmp_path: Path,
) -> None:
    """SGLang's MLA host pool (``MLATokenToKVPoolHost`` on CPU tensors), in each of its
    layouts: the latent is the same on every rank, so rank 0 of TP=2 (SGLang's storage
    writer) writes it once and ranks 0 and 1 of TP=2, TP=1 and rank 3 of TP=4 read it
    bit-exact, in the other per-layer host layout too (``page_first``'s token-major
    pages are named apart, as an MHA pool's are); one object per page. An MHA pool of
    the same model never reads the latent as K and V."""
    cfg, m = disk_config(tmp_path), model(tmp_path / "m", 1)
    runs: list[dict[str, Any]] = []
    for layout in ("layer_first", "page_first", "page_first_direct"):
        k = keys(f"mla-{layout}-", 3)
        other = {"layer_first": "page_first_direct", "page_first_direct": "layer_first"}
        o = other.get(layout, layout)
        runs += [
            {"op": "set", "keys": k, "tp_size": 2, "tp_rank": 0, "layout": layout},
            {"op": "get", "keys": k, "tp_size": 2, "tp_rank": 0, "layout": layout},
            {"op": "get", "keys": k, "tp_size": 2, "tp_rank": 1, "layout": o},
            {"op": "get", "keys": k, "tp_size": 1, "layout": layout},
            {"op": "get", "keys": k, "tp_size": 4, "tp_rank": 3, "layout": o},
            {"op": "get", "keys": k, "tp_size": 1, "layout": layout, "mla": False},
        ]
    got = sglang({"config": cfg, "model": m, "mla": True, "op": "batch", "runs": runs})["runs"]
    for a in range(0, len(got), 6):
        assert got[a]["disabled"] == "" and got[a]["set"] == [True] * 3, got[a]
        for r in got[a + 1 : a + 5]:
            assert r["exists"] == 3 and r["get"] == [True] * 3 and all(r["equal"]), r
        assert got[a + 5]["exists"] == 0 and all(got[a + 5]["untouched"])
    assert len(page_files(tmp_path)) == 3 * 3


def test_a_corrupt_mla_page_is_a_miss_and_the_legacy_calls_carry_the_latent(
    tmp_path: Path,
) -> None:
    cfg, m = disk_config(tmp_path), model(tmp_path / "m", 1)
    k = keys("mlc", 3)
    base = {"config": cfg, "model": m, "mla": True, "keys": k}
    assert sglang({**base, "op": "set", "legacy": True})["set"] is True
    (victim,) = [f for f in page_files(tmp_path) if f.name.endswith(k[1])]
    raw = bytearray(victim.read_bytes())
    raw[-400] ^= 0x40  # a byte of the last layer's latent
    victim.write_bytes(bytes(raw))
    got = sglang({**base, "op": "get", "legacy": True})
    assert got["get"] == [True, False, False]
    assert got["equal"][0] and got["untouched"][1:] == [True, True]


def test_a_corrupt_piece_is_a_miss_for_its_page_and_the_pages_after(tmp_path: Path) -> None:
    """Both TP=2 ranks' pages set; a byte of page 1's objects flipped: a TP=1 reader
    gets page 0 (assembled), and page 1 and after are misses, its slots untouched."""
    cfg, m = disk_config(tmp_path), model(tmp_path / "m", 1)
    k = keys("cp", 3)
    base = {"config": cfg, "model": m, "keys": k}
    sets = [{"op": "set", "tp_size": 2, "tp_rank": r} for r in range(2)]
    sglang({**base, "op": "batch", "runs": sets})
    victims = [f for f in page_files(tmp_path) if f.name.endswith(k[1])]
    assert len(victims) == 2  # one per head range
    for victim in victims:
        raw = bytearray(victim.read_bytes())
        raw[-400] ^= 0x40  # a byte of the last layer's value pool
        victim.write_bytes(bytes(raw))
    got = sglang({**base, "op": "get"})
    assert got["get"] == [True, False, False]
    assert got["equal"][0] and got["untouched"][1:] == [True, True]
    assert got["counts"]["pages_rejected"] == 1 and got["counts"]["pages_assembled"] == 1
