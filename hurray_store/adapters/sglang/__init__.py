"""The SGLang HiCache backend, ``HurrayHiCacheStorage`` (``backend.py``), which SGLang
loads by this package's path (``module_path: hurray_store.adapters.sglang``). Only
``backend.py`` imports ``sglang``; the page format (``pages``) and the page I/O
(``page_io``) need torch alone, so the backend is imported on first use of its names."""

from __future__ import annotations

from typing import Any

__all__ = ["HurrayHiCacheStorage", "cpu_host_pool", "cpu_mamba_host_pool", "cpu_mla_host_pool"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from hurray_store.adapters.sglang import backend

        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
