"""Every Python block of README.md and docs/*.md runs as written: in order, one namespace
per file, top-level ``await`` allowed, from a folder holding a copy of ``configs/``. So
the documents cannot drift from the code."""

from __future__ import annotations

import ast
import asyncio
import os
import re
import shutil
from pathlib import Path
from types import CodeType

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(path: Path) -> list[tuple[int, str]]:
    text = path.read_text()
    return [(text[: m.start()].count("\n") + 2, m.group(1)) for m in _BLOCK.finditer(text)]


def test_the_documents_hold_python_blocks() -> None:
    assert sum(len(python_blocks(p)) for p in DOCS) >= 5


def test_no_document_speaks_of_issue_letters() -> None:
    pattern = re.compile(r"\bissues? [A-L]\b|\(issue [A-L]\)")
    texts = [*DOCS, *sorted((ROOT / "tools").glob("*.py"))]
    assert [str(p) for p in texts if pattern.search(p.read_text())] == []


def test_the_documents_are_users_documents_not_a_lab_notebook() -> None:
    """No run letters ("run AP", "in runs A-T"), no "sitting", no paths out of the
    repository: a document says what holds now; the history of the runs is in git."""
    patterns = [
        re.compile(r"\bruns? [A-Z]{1,2}\b(?!-\d)"),
        re.compile(r"\bsitting\b"),
        re.compile(r"\.\./|/work/|/root/|/tmp/pytest|\blimits\.md|\bpeers\.md"),
    ]
    found = [
        f"{p.name}: {m.group(0)!r}"
        for p in [*DOCS, *sorted((ROOT / "tools").glob("*.py")), ROOT / "hurray_store/buffers.py"]
        for pat in patterns
        if (m := pat.search(p.read_text()))
    ]
    assert found == []


@pytest.mark.parametrize("path", [p for p in DOCS if python_blocks(p)], ids=lambda p: p.name)
def test_python_blocks_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LMCACHE_TRACK_USAGE", "false")
    namespace: dict[str, object] = {"__name__": "__docs__"}

    async def run_all() -> None:
        for line, src in python_blocks(path):
            code: CodeType = compile(
                src, f"{path.name}:{line}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
            )
            result = eval(code, namespace)  # noqa: S307 - the project's own documents
            if asyncio.iscoroutine(result):
                await result

    asyncio.run(run_all())
    assert os.getcwd() == str(tmp_path)
