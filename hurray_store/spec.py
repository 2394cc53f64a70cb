"""KVSpec: the shape of a model's KV cache, and its fingerprint."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import torch

from hurray_store.errors import SpecError

SUPPORTED_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
DTYPES_BY_NAME = {name: dtype for dtype, name in SUPPORTED_DTYPES.items()}
_FINGERPRINT_TAG = b"hurray_store/kvspec/v2"


def rank_heads(total_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """``(head_start, num_kv_heads)``: the model's KV heads tensor-parallel rank
    ``tp_rank`` of ``tp_size`` holds, as vLLM and SGLang split them: ``total / size``
    consecutive heads each; with more ranks than heads, one head each, every head held by
    ``size / total`` consecutive ranks (replicated heads)."""
    H, r, n = total_kv_heads, tp_rank, tp_size
    if not 0 <= r < n:
        raise SpecError(f"tp_rank must be in [0, tp_size={n}), got {r!r}")
    if n <= H:
        if H % n:
            raise SpecError(f"{H} KV heads do not split over {n} ranks")
        w = H // n
        return r * w, w
    if n % H:
        raise SpecError(f"{n} ranks do not replicate {H} KV heads evenly")
    return r // (n // H), 1


@dataclass(frozen=True, slots=True)
class KVSpec:
    """What a KV page means: model identity, geometry and dtype, and which of the
    model's KV heads it holds.

    Two engines may share cached pages only when their specs are equal; the fingerprint
    (and so every key derived from it) changes with any field. ``num_kv_heads`` heads
    from ``head_start`` of the model's ``total_kv_heads`` (0: ``num_kv_heads``, all of
    them): a tensor-parallel rank's pages are named by the heads they hold, never by the
    rank, so ranks of any TP size that hold the same heads share them
    (``engine/portable.py`` assembles other ranges).
    """

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    revision: str = ""
    head_start: int = 0
    total_kv_heads: int = 0
    fused: bool = False  # an MLA latent: one tensor per layer serves as K and V
    # A part of the model's layers with a KV cache of its own (a hybrid model's KV cache
    # group, e.g. "sliding_window 64: layers 0 1 2"): "" for all of them. Its pages
    # are keyed apart from every other group's.
    group: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise SpecError(f"model must be a non-empty string, got {self.model!r}")
        if not isinstance(self.revision, str):
            raise SpecError(f"revision must be a string, got {self.revision!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SpecError(f"{name} must be a positive int, got {v!r}")
        for name in ("head_start", "total_kv_heads"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise SpecError(f"{name} must be an int >= 0, got {v!r}")
        if self.total_kv_heads == 0:  # all of the model's heads
            if self.head_start:
                raise SpecError("head_start needs total_kv_heads (the model's KV heads)")
            object.__setattr__(self, "total_kv_heads", self.num_kv_heads)
        if not isinstance(self.group, str):
            raise SpecError(f"group must be a string, got {self.group!r}")
        if not isinstance(self.fused, bool):
            raise SpecError(f"fused must be a bool, got {self.fused!r}")
        if self.fused and self.total_kv_heads != 1:
            raise SpecError("a fused (MLA latent) spec holds one head of one")
        if self.head_start + self.num_kv_heads > self.total_kv_heads:
            raise SpecError(
                f"heads [{self.head_start}, {self.head_start + self.num_kv_heads}) are not "
                f"within the model's {self.total_kv_heads} KV heads"
            )
        if self.dtype not in SUPPORTED_DTYPES:
            raise SpecError(
                f"dtype must be one of {list(SUPPORTED_DTYPES.values())}, got {self.dtype}"
            )

    @property
    def heads(self) -> tuple[int, int]:
        """The model's KV heads this spec holds, ``[start, end)``."""
        return self.head_start, self.head_start + self.num_kv_heads

    @property
    def roles(self) -> int:
        """Tensors per layer: a key and a value (2), or one fused latent (1)."""
        return 1 if self.fused else 2

    @property
    def role_names(self) -> tuple[str, ...]:
        return ("fused",) if self.fused else ("key", "value")

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
            + struct.pack("<QQQ", self.head_start, self.total_kv_heads, self.roles)
            + (text(self.group) if self.group else b"")  # all layers: nothing appended
        )

    def fingerprint(self) -> bytes:
        """SHA-256 of ``canonical()``: 32 bytes, the same on every machine and process."""
        return hashlib.sha256(self.canonical()).digest()
