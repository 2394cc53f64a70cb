"""A connector for the vLLM tests that loses the store between vLLM's lookup and its
load: ``HurrayConnector`` itself, whose scheduler, right after its first lookup hit,
does what ``kv_connector_extra_config["after_first_hit"]`` says, before vLLM allocates
the blocks and the worker loads them:

- ``{"kill": <pid>}``: SIGKILL that process (the cache server);
- ``{"empty": <folder>}``: delete every file under it (a disk tier's folder).

Load it with ``kv_connector="LosingConnector"``,
``kv_connector_module_path="tests.vllm_hooks"``."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from hurray_store.adapters.vllm import HurrayConnector


class LosingConnector(HurrayConnector):
    extra_keys = (*HurrayConnector.extra_keys, "after_first_hit")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._after_first_hit: dict[str, Any] | None = extra.get("after_first_hit")

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        n, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        act, self._after_first_hit = self._after_first_hit, (None if n else self._after_first_hit)
        if n and act:
            if "kill" in act:
                os.kill(int(act["kill"]), signal.SIGKILL)
            for p in Path(act.get("empty", "/nonexistent")).rglob("*"):
                if p.is_file():
                    p.unlink()
        return n, is_async
