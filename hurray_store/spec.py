"""KVSpec: the shape of a model's KV cache, and its fingerprint."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import torch

from hurray_store.errors import SpecError

SUPPORTED_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
DTYPES_BY_NAME = {name: dtype for dtype, name in SUPPORTED_DTYPES.items()}
_FINGERPRINT_TAG = b"hurray_store/kvspec/v1"


@dataclass(frozen=True, slots=True)
class KVSpec:
    """What a KV page means: model identity, geometry and dtype.

    Two engines may share cached pages only when their specs are equal; the fingerprint
    (and so every key derived from it) changes with any field.
    """

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    revision: str = ""
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise SpecError(f"model must be a non-empty string, got {self.model!r}")
        if not isinstance(self.revision, str):
            raise SpecError(f"revision must be a string, got {self.revision!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size", "tp_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SpecError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise SpecError(f"tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank!r}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise SpecError(
                f"dtype must be one of {list(SUPPORTED_DTYPES.values())}, got {self.dtype}"
            )

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one role in one layer."""
        return self.page_size * self.num_kv_heads * self.head_dim * self.element_size

    def canonical(self) -> bytes:
        """The canonical encoding the fingerprint hashes (see docs/format.md)."""

        def text(s: str) -> bytes:
            b = s.encode("utf-8")
            return struct.pack("<I", len(b)) + b

        return (
            text(_FINGERPRINT_TAG.decode())
            + text(self.model)
            + text(self.revision)
            + struct.pack(
                "<QQQQ", self.num_layers, self.num_kv_heads, self.head_dim, self.page_size
            )
            + text(SUPPORTED_DTYPES[self.dtype])
            + struct.pack("<QQ", self.tp_rank, self.tp_size)
        )

    def fingerprint(self) -> bytes:
        """SHA-256 of ``canonical()``: 32 bytes, the same on every machine and process."""
        return hashlib.sha256(self.canonical()).digest()
