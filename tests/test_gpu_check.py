"""``tools/gpu_check.py``, the GPU check prepared for a CUDA machine, runs its every
check on the CPU here (``--device cpu``), and on CUDA where there is one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ["layouts", "transfers", "store", "speed", "prefill"]


def _run(tmp_path: Path, *args: str) -> str:
    out = tmp_path / "report.md"
    p = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_check.py"), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    report = out.read_text()
    for name in CHECKS:
        assert f"- PASS {name} " in report, report
    assert "FAIL" not in report, report
    return report


def test_the_gpu_check_passes_on_the_cpu(tmp_path: Path) -> None:
    report = _run(tmp_path, "--device", "cpu", "--quick")
    assert "same top token" in report and "GB/s" in report


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gpu_check_passes_on_cuda(tmp_path: Path) -> None:
    report = _run(tmp_path, "--device", "cuda")
    assert "pinned" in report
