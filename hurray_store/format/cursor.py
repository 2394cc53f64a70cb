"""One bounds-checked cursor over a payload, for every reader of the project's own
binary layouts (the manifest, the transport's messages): each read checks the bytes it
needs remain before it slices or allocates, and running short raises the reader's own
error, never an IndexError."""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np

_STRUCTS: dict[str, struct.Struct] = {}


class Cursor:
    __slots__ = ("mv", "pos", "stop", "fail")

    def __init__(
        self,
        data: bytes | bytearray | memoryview,
        fail: Callable[[str], Exception],
        pos: int = 0,
        stop: int | None = None,
    ) -> None:
        """``fail(message)``: the exception a reader raises for bytes that run short
        or do not parse; ``[pos, stop)``: the bytes this cursor may read."""
        self.mv = memoryview(data).cast("B")
        self.pos = pos
        self.stop = self.mv.nbytes if stop is None else stop
        self.fail = fail

    @property
    def remaining(self) -> int:
        return self.stop - self.pos

    def take(self, n: int) -> memoryview:
        if n < 0 or n > self.stop - self.pos:
            raise self.fail(
                f"field of {n} bytes at offset {self.pos}, only {self.stop - self.pos} remain"
            )
        out = self.mv[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> tuple:
        s = _STRUCTS.get(fmt)
        if s is None:
            s = _STRUCTS[fmt] = struct.Struct(fmt)
        return s.unpack(self.take(s.size))

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return int.from_bytes(self.take(2), "little")

    def u32(self) -> int:
        return int.from_bytes(self.take(4), "little")

    def u64(self) -> int:
        return int.from_bytes(self.take(8), "little")

    def count(self, fmt: str, min_item_bytes: int) -> int:
        """A repeat count, refused when even minimal items could not fit what remains."""
        (n,) = self.unpack(fmt)
        if n * min_item_bytes > self.stop - self.pos:
            raise self.fail(
                f"{n} items need at least {n * min_item_bytes} bytes, {self.stop - self.pos} remain"
            )
        return int(n)

    def array(self, dtype: str, n: int) -> np.ndarray:
        dt = np.dtype(dtype)
        return np.frombuffer(self.take(n * dt.itemsize), dtype=dt)

    def short_bytes(self) -> memoryview:
        """``u16 length`` then that many bytes."""
        (n,) = self.unpack("<H")
        return self.take(n)

    def blob(self, limit: int) -> memoryview:
        """``u32 length`` (at most ``limit``) then that many bytes."""
        n = self.u32()
        if n > limit:
            raise self.fail(f"field of {n} bytes; at most {limit}")
        return self.take(n)

    def string(self, limit: int) -> str:
        """``u32 length`` (at most ``limit``) then that many bytes of UTF-8."""
        raw = self.blob(limit)
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"string is not UTF-8: {e}") from None

    def rest(self) -> memoryview:
        return self.take(self.stop - self.pos)

    def done(self) -> None:
        """Every byte was read."""
        if self.pos != self.stop:
            raise self.fail(f"{self.stop - self.pos} bytes after the last field")
