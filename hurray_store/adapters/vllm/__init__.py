"""The vLLM connector, ``HurrayConnector`` (``connector.py``), which vLLM loads by this
package's path (``kv_connector_module_path: hurray_store.adapters.vllm``). Only the
connector's modules import ``vllm``; ``layout`` and ``transfer`` need torch alone, so
the connector is imported on first use of its name (docs/vllm.md, "The modules")."""

from __future__ import annotations

from typing import Any

__all__ = ["HurrayConnector"]


def __getattr__(name: str) -> Any:
    if name == "HurrayConnector":
        from hurray_store.adapters.vllm.connector import HurrayConnector

        return HurrayConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
