"""A byte-level tokenizer shipped with the package: no hub, no vocabulary
file. Token ids: 0 pad, 1 begin-of-sequence, 2 end-of-sequence, 3 + b for each UTF-8
byte b. Any text round-trips; the tiny demo model is built with this vocabulary."""

from __future__ import annotations

from collections.abc import Sequence

PAD, BOS, EOS = 0, 1, 2
OFFSET = 3
VOCAB_SIZE = OFFSET + 256


def encode(text: str, *, bos: bool = True) -> list[int]:
    ids = [b + OFFSET for b in text.encode("utf-8")]
    return [BOS, *ids] if bos else ids


def decode(ids: Sequence[int]) -> str:
    return bytes(i - OFFSET for i in ids if OFFSET <= i < VOCAB_SIZE).decode(
        "utf-8", errors="replace"
    )
