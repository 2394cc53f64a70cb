"""Every tool in tools/ imports: a benchmark that names a helper another tool no longer
has fails here, not the next time someone runs it. (bench_sglang imports SGLang, so it
is imported by tests/test_sglang.py's environment only.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP = {"bench_sglang"}


def test_every_tool_imports() -> None:
    names = sorted(p.stem for p in (ROOT / "tools").glob("*.py") if p.stem not in SKIP)
    code = "import importlib\n" + "".join(f"importlib.import_module({n!r})\n" for n in names)
    p = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT / "tools",
        capture_output=True,
        text=True,
        env={**os.environ, "LMCACHE_TRACK_USAGE": "false", "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(names) >= 10
