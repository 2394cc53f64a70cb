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
