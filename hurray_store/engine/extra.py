"""The keys an engine's own config hands an adapter (vLLM's ``kv_connector_extra_config``,
SGLang's storage ``extra_config``, LMCache's ``extra_config`` and L2 ``adapter_params``),
checked at start: a mistyped key is one error naming it and what is accepted, never a
silently ignored setting (a mistyped ``config`` used to open the embedded default store)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def check_keys(given: Iterable[str], accepted: Iterable[str], who: str, where: str) -> None:
    """ValueError naming the first of ``given`` not in ``accepted`` (and the nearest
    accepted key, when one is near)."""
    ok = sorted(set(accepted))
    unknown = sorted(k for k in given if k not in ok)
    if not unknown:
        return
    near = difflib.get_close_matches(unknown[0], ok, 1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise ValueError(f"{who}: unknown key {unknown[0]!r} in {where}{hint}; it takes {ok}")
