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
    # the connector's modules; its data path (layout.py, transfer.py) needs torch alone
    "vllm": [
        f"adapters/vllm/{m}.py"
        for m in ("connector", "events", "kv_events", "probe", "scheduler", "spec", "warmup")
    ],
    "sglang": ["adapters/sglang/backend.py"],
    # the S3 tier, and the test kit's raw client of a bucket (around the tier, for the
    # medium contract)
    "obstore": ["tiers/s3.py", "tiers/s3_*.py", "testing/services.py"],
    # KV events for routers: the publisher and vLLM's wire format
    "zmq": ["events/*.py"],
    "msgspec": ["events/*.py"],
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


# The package's own layers (docs/architecture: "Layers"): a module imports only from its
# own layer or lower. Module paths under hurray_store/, by prefix (the longest wins).
LAYER_OF = {
    "errors": 0,
    "spec": 0,
    "batches": 0,
    "buffers": 0,
    "tokenizer": 0,
    "metrics": 0,
    "throttle": 0,
    "config": 1,
    "format": 1,
    "keys": 1,
    "identity": 1,
    "transport": 1,
    "synthetic": 1,
    "tiny_model": 1,
    "paging": 2,
    "page_io": 2,
    "store.index": 2,
    "store.ledger": 2,
    "store.policy": 2,
    "tiers.base": 2,
    "tiers.types": 2,
    "tiers.helpers": 2,
    "tiers.self_checked": 2,
    "tiers": 3,
    "events": 3,
    "store": 4,
    "engine": 4,
    "adapters": 5,
    "server": 5,
    "cli": 5,
    "warmup": 5,
    "testing": 5,
}
NAMES = {
    ".".join(q for q in p.relative_to(PACKAGE).with_suffix("").parts if q != "__init__")
    for p in PACKAGE.rglob("*.py")
}


def _layer(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if (at := LAYER_OF.get(".".join(parts[:n]))) is not None:
            return at
    raise AssertionError(f"hurray_store.{module} is in no layer: add it to LAYER_OF")


def _own_imports(path: Path) -> set[str]:
    """The package's modules ``path`` imports (``from hurray_store import x`` names the
    module ``x``), but not those under ``if TYPE_CHECKING:`` (types only)."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
        for n in ast.walk(node)
    }
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "hurray_store":
                continue
            mod = node.module.removeprefix("hurray_store").removeprefix(".")
            for a in node.names:
                sub = f"{mod}.{a.name}".lstrip(".")
                out.add(sub if sub in NAMES else mod)
        elif isinstance(node, ast.Import):
            out.update(
                a.name.removeprefix("hurray_store.")
                for a in node.names
                if a.name.startswith("hurray_store.")
            )
    out.discard("")  # the package's face (hurray_store/__init__.py)
    return out


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    upward = []
    for name in sorted(NAMES - {""}):
        path = PACKAGE / (name.replace(".", "/") + ".py")
        if not path.exists():
            path = PACKAGE / name.replace(".", "/") / "__init__.py"
        for dep in _own_imports(path):
            if _layer(dep) > _layer(name):
                upward.append(f"{name} (L{_layer(name)}) imports {dep} (L{_layer(dep)})")
    assert not upward, upward


def test_the_package_has_no_import_cycle() -> None:
    graph = {}
    for name in NAMES - {""}:
        path = PACKAGE / (name.replace(".", "/") + ".py")
        if not path.exists():
            path = PACKAGE / name.replace(".", "/") / "__init__.py"
        graph[name] = {d for d in _own_imports(path) if d in NAMES and d != name}
    # a package's __init__ re-exports its modules: importing a module of a package runs
    # its __init__ first, which is no cycle of the module's making
    for name, deps in graph.items():
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    cycles, done, stack = [], set(), []

    def visit(n: str) -> None:
        if n in stack:
            cycles.append(stack[stack.index(n) :] + [n])
            return
        if n in done:
            return
        stack.append(n)
        for d in sorted(graph[n]):
            visit(d)
        stack.pop()
        done.add(n)

    for n in sorted(graph):
        visit(n)
    assert not cycles, cycles


def test_the_layer_rule_sees_an_upward_import(tmp_path: Path) -> None:
    p = tmp_path / "m.py"
    p.write_text(
        "from typing import TYPE_CHECKING\nfrom hurray_store.store import TieredStore\n"
        "if TYPE_CHECKING:\n    from hurray_store.adapters import vllm\n"
    )
    assert _own_imports(p) == {"store"}
    assert _layer("store.cascade") == 4 and _layer("tiers.base") == 2 and _layer("tiers.disk") == 3
