"""Fetch one wheel from PyPI (no dependencies) and keep only its Python sources, in a
folder of their own: ``python tools/fetch_wheel_sources.py vllm==0.33.0 DEST``. Does
nothing when DEST already holds that wheel's sources (its ``.fetched`` file names it)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


def main() -> None:
    req, dest = sys.argv[1], Path(sys.argv[2])
    stamp = dest / ".fetched"
    if stamp.exists() and stamp.read_text() == req:
        return
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, req]
        subprocess.run(pip, check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.endswith(".py")]
            z.extractall(dest, names)
    stamp.write_text(req)
    print(f"{req}: {len(names)} Python files in {dest}")


if __name__ == "__main__":
    main()
