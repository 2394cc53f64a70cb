"""vLLM when the weights change (issue V item 1): ``reset_prefix_cache(reset_connector=True)``,
which a weight sync in memory and ``pause_generation(clear_cache=True)`` call, reaches the
connector's ``reset_cache``. Real vLLM instances (vLLM's CPU build, from .venv-vllm) on a
tiny model built here; a file of its own so that it runs beside tests/test_vllm.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from hurray_store.tiny_model import build_tiny_model
from tests.test_vllm import _config, _prompts, _vllm, pytestmark  # noqa: F401


@pytest.fixture(scope="module")
def fp32_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("vllm-model") / "llama-fp32"
    build_tiny_model(str(d), dtype="float32")
    return d


def test_a_cache_reset_after_a_weight_update_never_serves_the_old_weights_kv(
    fp32_model: Path, tmp_path: Path
) -> None:
    """vLLM's reset_prefix_cache(reset_connector=True), which a weight sync in memory and
    pause_generation(clear_cache=True) call: the prompt loaded from the store before it
    is not found after it (the connector keys by a new generation of the weights), and
    each reset is a generation of its own."""
    prompts = _prompts(200, [30])
    cfg = _config(tmp_path / "hs.yaml", tmp_path / "cache")
    _vllm(tmp_path, fp32_model, prompts[:1], "--config", str(cfg), split=False)  # stored
    p = prompts[0]
    runs = [{"ids": p}, {"ids": p, "reset_before": True}, {"ids": p, "reset_before": True}]
    got, counts = _vllm(tmp_path, fp32_model, runs, "--config", str(cfg), split=False)  # type: ignore[arg-type]
    assert got[0]["cached"] == 224, "the store's KV before the reset"
    assert got[1]["cached"] == 0, "the old weights' KV was served after the reset"
    assert got[2]["cached"] == 0, "each reset is a generation of its own"
    assert counts["blocks_loaded"] == 7 and counts["blocks_saved"] >= 14, counts


def test_a_mistyped_extra_config_key_stops_vllm_with_an_error_naming_it(
    fp32_model: Path, tmp_path: Path
) -> None:
    """kv_connector_extra_config with "save_backlog_gb" (for "save_backlog_mb"): vLLM does
    not start, and says which key and what it takes (it used to be ignored)."""
    import json
    import os
    import subprocess

    from tests.test_vllm import ROOT, VLLM_PY

    cfg = _config(tmp_path / "hs.yaml", tmp_path / "cache")
    pfile = tmp_path / "p.json"
    pfile.write_text(json.dumps(_prompts(40, [8])))
    cmd = [str(VLLM_PY), "-m", "tests.vllm_run", "--model", str(fp32_model), "--prompts"]
    cmd += [str(pfile), "--config", str(cfg), "--extra", '{"save_backlog_gb": 2}']
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode != 0
    assert "unknown key 'save_backlog_gb' in kv_connector_extra_config" in p.stderr
    assert "did you mean 'save_backlog_mb'" in p.stderr


def test_the_readme_llm_script_runs_as_written(fp32_model: Path, tmp_path: Path) -> None:
    """The README's LLM(...) form, pasted into a script as it is (paths to this test's),
    runs: it prints the tokens, and the prompt is saved to the cache."""
    import os
    import subprocess

    from tests.test_vllm import ROOT, VLLM_PY, _readme_block

    block = _readme_block("In Python, the same connector", "text")
    cfg = _config(tmp_path / "vllm.yaml", tmp_path / "cache")
    script = tmp_path / "readme_llm.py"
    script.write_text(
        block.replace("models/tiny-llama", str(fp32_model)).replace("configs/vllm.yaml", str(cfg))
    )
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false"}
    p = subprocess.run(
        [str(VLLM_PY), str(script)], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600
    )
    assert p.returncode == 0 and "tokens" in p.stdout and "cached 0" in p.stdout, (
        p.stdout + p.stderr
    )[-3000:]
    assert (tmp_path / "cache" / "journal").read_text().count("+") >= 1, "the prompt was saved"
