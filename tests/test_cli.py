"""The hurray-store command line: inspect and demo."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hurray_store.cli import main
from hurray_store.format import encode_layer
from tests.helpers import make_layer
from tests.test_manifest import sample


def test_inspect_layer_object(tmp_path: Path, capsys) -> None:
    p = tmp_path / "layer.hrry"
    p.write_bytes(encode_layer(make_layer([[0, 1, 2], [0, 1, 3], [4]], 5, layer_index=6), quantization="int8"))
    assert main(["inspect", str(p)]) == 0
    out = capsys.readouterr().out
    for needle in ("0x0A (block-paged)", "kv_role        key", "kv_role        value", "layer          6",
                   "dtype          int8", "shape          [28, 2, 8]", "page_size      4", "num_pages      5",
                   "num_seqs       3", "index type     uint32", "PerBlockAffine",
                   "7 block-table entries over 5 distinct pages"):
        assert needle in out, needle


def test_inspect_manifest(tmp_path: Path, capsys) -> None:
    p = tmp_path / "m.manifest"
    p.write_bytes(sample().to_bytes())
    assert main(["inspect", str(p)]) == 0
    out = capsys.readouterr().out
    assert "segment manifest" in out and "sequences      2" in out and "layers         2" in out


def test_inspect_bad_file_prints_one_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.hrry"
    p.write_bytes(encode_layer(make_layer([[0, 1]], 2))[:-3])
    r = subprocess.run([sys.executable, "-m", "hurray_store.cli", "inspect", str(p)], capture_output=True, text=True)
    assert r.returncode == 1
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {p}:")


def test_inspect_missing_file(tmp_path: Path, capsys) -> None:
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_demo_runs_and_checks(capsys) -> None:
    assert main(["codec-demo", "--layers", "2", "--seqs", "3", "--tokens", "64", "--heads", "2", "--dim", "8"]) == 0
    out = capsys.readouterr().out
    assert "distinct pages stored" in out and out.count(" ok") == 2
