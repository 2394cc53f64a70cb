"""SGLang's hybrid pools through the v2 calls (``batch_exists_v2``, ``batch_get_v2``,
``batch_set_v2``), each process SGLang's own pool classes on CPU tensors
(``tests/sglang_cases.py``, op ``hybrid``): the KV pool of the full-attention layers, a
sliding window's KV pool (``swa``, the last two pages of a prefix) and a Mamba state
pool (``mamba``, the state at a prefix's last page), as SGLang's hybrid cache controller
registers and hands them. One process sets, another finds and reads every pool's pages
bit-exact; a prefix whose KV is stored without its state counts as not held; a state
object corrupted on disk is read as a miss and leaves the store."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

from tests.test_sglang import pytestmark, sglang  # noqa: F401 - the skip without SGLang


def _spec(tmp_path: Path, **more: object) -> dict[str, object]:
    cfg = tmp_path / "store.yaml"
    cfg.write_text(
        f"tiers:\n  - {{type: disk, path: {tmp_path / 'cache'}, capacity_bytes: 1073741824}}\n"
    )
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"num_key_value_heads": 2}')
    return {"op": "hybrid", "config": str(cfg), "model": str(model), "page_size": 4, **more}


def test_hybrid_pools_set_in_one_process_are_read_bit_exact_in_another(tmp_path: Path) -> None:
    both = ["kv", "swa", "mamba"]
    sets = sglang(_spec(tmp_path, sets=[[["a", "b", "c"], both], [["x", "y"], ["kv", "swa"]]]))
    assert sets["disabled"] == "" and sets["sets"] == [
        {"kv": [True] * 3, "swa": [True] * 2, "mamba": [True]},
        {"kv": [True] * 2, "swa": [True] * 2},  # no Mamba state stored for x, y
    ]
    assert sets["counts"]["states_written"] == 1
    got = sglang(_spec(tmp_path, asks=[["a", "b", "c", "d"], ["x", "y"], ["a", "b"]]))
    full, no_state, short = got["asks"]
    # A prefix of three pages: the KV of each, the window's last two, the state at c.
    assert full["pages"] == 3 and full["hits"] == {"kv": 3, "swa": 3, "mamba": 3}
    assert full["kv"] == [True] * 3 and full["swa"] == [True] * 2 and full["mamba"] == [True]
    assert full["kv_exact"] and full["swa_exact"] and full["mamba_exact"], full
    # The KV and window of x, y are stored, not the state: not held.
    assert no_state["pages"] == 0 and no_state["hits"] == {"kv": 2, "swa": 2}, no_state
    # a, b: their KV is there, but no state at b and no window ending at b.
    assert short["pages"] == 0 and short["hits"] == {"kv": 2}, short
    assert got["counts"]["states_read"] == 1 and got["counts"]["pages_rejected"] == 0


def test_a_corrupt_state_object_is_a_miss_and_leaves_the_store(tmp_path: Path) -> None:
    sets = sglang(
        _spec(tmp_path, sets=[[["a", "b", "c"], ["kv", "swa", "mamba"]]], name_states=["c"])
    )
    name = sets["state_names"]["c"]
    objects = (tmp_path / "cache" / "objects").rglob("*")
    (obj,) = [p for p in objects if p.name.endswith("%2F" + quote(name, safe=""))]
    raw = bytearray(obj.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # inside the state's bytes
    obj.write_bytes(bytes(raw))
    got = sglang(_spec(tmp_path, asks=[["a", "b", "c"], ["a", "b", "c"]]))
    first, again = got["asks"]
    assert first["pages"] == 3 and first["mamba"] == [False], first  # found, then refused
    assert first["kv_exact"] and not first["mamba_exact"]  # the slot was left as it was
    assert again["pages"] == 0 and "mamba" not in again["hits"], again  # it left the store
    assert got["counts"]["pages_rejected"] == 1
