"""A config key: a dataclass field with its doc string (and units), which the docs'
key table and ``hurray-store config`` print."""

from __future__ import annotations

from dataclasses import MISSING, field
from typing import Any


def documented(text: str, default: Any = MISSING) -> Any:
    if default is MISSING:
        return field(metadata={"doc": text})
    return field(default=default, metadata={"doc": text})
