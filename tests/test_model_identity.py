"""A model is identified by its weights, not its name or path: a model rebuilt in place
with other weights, or another model of the same geometry, never shares a page; the same
weights from another folder do."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hurray_store.adapters.transformers import check_supported, model_id, spec_for_model
from hurray_store.errors import SpecError
from hurray_store.identity import adapter_id, config_id
from hurray_store.tiny_model import build_tiny_model


def _load(path: Path):  # type: ignore[no-untyped-def]
    return AutoModelForCausalLM.from_pretrained(str(path))


def test_a_model_rebuilt_in_place_gets_another_identity(tmp_path: Path) -> None:
    d = tmp_path / "model"
    build_tiny_model(str(d), seed=0, layers=2)
    first = spec_for_model(_load(d))
    build_tiny_model(str(d), seed=1, layers=2)  # a fine-tune saved over the folder
    second = spec_for_model(_load(d))
    assert first.model != second.model and first.fingerprint() != second.fingerprint()


def test_two_models_of_one_geometry_in_memory_differ(tmp_path: Path) -> None:
    build_tiny_model(str(tmp_path / "a"), seed=0, layers=2)
    build_tiny_model(str(tmp_path / "b"), seed=7, layers=2)
    a, b = _load(tmp_path / "a"), _load(tmp_path / "b")
    a.config.name_or_path = b.config.name_or_path = "same-name"  # names do not matter
    assert model_id(a) != model_id(b)


def test_the_same_weights_from_another_folder_share_an_identity(tmp_path: Path) -> None:
    build_tiny_model(str(tmp_path / "a"), seed=3, layers=2)
    shutil.copytree(tmp_path / "a", tmp_path / "elsewhere")
    a, b = _load(tmp_path / "a"), _load(tmp_path / "elsewhere")
    assert model_id(a) == model_id(b)
    assert spec_for_model(a).fingerprint() == spec_for_model(b).fingerprint()
    with torch.no_grad():
        next(b.parameters()).view(-1)[0] += 1  # one value changed
    assert model_id(a) != model_id(b)


@pytest.mark.parametrize(
    ("model_type", "named"),
    [
        ("deepseek_v2", "multi-head latent attention"),
        ("gemma3n_text", "KV shared across layers"),
        ("qwen3_next", "not attention"),
        ("falcon_h1", "not attention"),
        ("lfm2", "not attention"),
        ("mamba", "not attention"),
        ("jamba", "not attention"),
    ],
)
def test_an_architecture_that_cannot_be_paged_is_refused_by_name(
    model_type: str, named: str
) -> None:
    with pytest.raises(SpecError, match=named) as e:
        check_supported(AutoConfig.for_model(model_type))
    assert repr(model_type) in str(e.value)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "gemma2", "gpt_oss", "phi3"])
def test_attention_architectures_pass(model_type: str) -> None:
    check_supported(AutoConfig.for_model(model_type))


def test_a_config_only_change_that_shapes_kv_gets_another_identity(tmp_path: Path) -> None:
    """The same weights with another rope theta (either spelling of it), rope scaling,
    sliding window or norm epsilon compute other KV: another identity. A field that does
    not shape the KV (a token id, the dtype name) keeps it."""
    d = tmp_path / "model"
    build_tiny_model(str(d), layers=2)
    base = _load(d)
    cfg = AutoConfig.from_pretrained(str(d))
    same = config_id(cfg)
    assert config_id(base.config) == same and model_id(base) == model_id(_load(d))
    changes = [
        {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}},
        {"rope_theta": 5000.0},  # the transformers 4 spelling, set beside the 5 one
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
        {"sliding_window": 64},
        {"rms_norm_eps": 1e-5},
        {"max_position_embeddings": 4096},
    ]
    for change in changes:
        c = AutoConfig.from_pretrained(str(d))
        for k, v in change.items():
            setattr(c, k, v)
        assert config_id(c) != same, change
    c = AutoConfig.from_pretrained(str(d))
    c.eos_token_id = 7
    c.dtype = "bfloat16"
    assert config_id(c) == same
    # The model's identity follows its config: loaded with an override, it is another.
    c = AutoConfig.from_pretrained(str(d))
    c.rope_parameters = {"rope_type": "default", "rope_theta": 5000.0}
    over = AutoModelForCausalLM.from_pretrained(str(d), config=c)
    assert model_id(over) != model_id(base)


def test_the_rope_spellings_of_transformers_4_and_5_hash_alike() -> None:
    """transformers 4 keeps rope_theta at the top and scaling in rope_scaling; 5 keeps
    both in rope_parameters: the same settings give one identity in either."""
    v4 = {"model_type": "llama", "rope_theta": 10000, "rope_scaling": None, "head_dim": 64}
    v5 = {
        "model_type": "llama",
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "head_dim": 64,
    }
    assert config_id(v4) == config_id(v5)
    v4s = {**v4, "rope_scaling": {"type": "linear", "factor": 2.0}}
    v5s = {**v5, "rope_parameters": {"rope_theta": 1e4, "rope_type": "linear", "factor": 2}}
    assert config_id(v4s) == config_id(v5s) != config_id(v4)


def _adapter(path: Path, seed: int) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    g = torch.Generator().manual_seed(seed)
    save_file(
        {"a.lora_A.weight": torch.randn(8, 16, generator=g)}, path / "adapter_model.safetensors"
    )


def test_a_lora_adapter_is_identified_by_its_weights_and_config(tmp_path: Path) -> None:
    """Two adapters differ; a copy elsewhere is the same; the same folder rebuilt in
    place with other weights, or another rank in its config, is another; no folder is
    no identity."""
    _adapter(tmp_path / "a", 0)
    _adapter(tmp_path / "b", 1)
    a = adapter_id(str(tmp_path / "a"))
    assert a is not None and a != adapter_id(str(tmp_path / "b"))
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    assert adapter_id(str(tmp_path / "copy")) == a
    assert adapter_id(str(tmp_path / "a")) == a  # the cached value, the folder unchanged
    _adapter(tmp_path / "a", 2)  # rebuilt in place under the same path
    rebuilt = adapter_id(str(tmp_path / "a"))
    assert rebuilt not in (a, None)
    (tmp_path / "a" / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 32}')
    assert adapter_id(str(tmp_path / "a")) not in (a, rebuilt)
    assert adapter_id(str(tmp_path / "missing")) is None
