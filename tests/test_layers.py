"""One layer, one job: each outside library is imported by the modules of its layer only
(docs/store.md, "The modules"; README, "Dependencies")."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hurray_store"

# library -> the modules (paths under hurray_store/, as globs) that may import it
OWNERS = {
    "hurray": ["format/*.py"],
    "lmcache": ["adapters/lmcache/*.py"],
    "redis": ["tiers/redis.py", "tiers/redis_*.py"],
    "vllm": ["adapters/vllm.py", "adapters/vllm_*.py"],
    "sglang": ["adapters/sglang.py"],
    # the S3 tier, and the test kit's raw client of a bucket (around the tier, for the
    # medium contract)
    "obstore": ["tiers/s3.py", "tiers/s3_*.py", "testing/services.py"],
}


def _imported(path: Path) -> set[str]:
    """The top-level packages a module imports, at its top or inside functions."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_each_library_is_imported_by_its_layer_only() -> None:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        for lib in _imported(path) & OWNERS.keys():
            if not any(rel.match(g) for g in OWNERS[lib]):
                wrong.append(f"{rel} imports {lib}")
    assert not wrong, wrong


def test_the_rule_sees_an_import_where_it_is_written(tmp_path: Path) -> None:
    # The checker itself: an import inside a function counts, a relative one does not.
    p = tmp_path / "m.py"
    p.write_text("from . import redis\n\ndef f():\n    import lmcache.v1\n    from vllm import x\n")
    assert _imported(p) == {"lmcache", "vllm"}
