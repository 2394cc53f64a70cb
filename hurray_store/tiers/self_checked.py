"""A ``SelfChecked`` object (``format/self_checked.py``) as a tier writes it: a tier that
writes from a worker thread hashes each part there, just before it writes it
(``SelfCheckedObject.written``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from hurray_store.format.self_checked import SelfChecked
from hurray_store.tiers.base import GroupObject
from hurray_store.tiers.types import Buffer

__all__ = ["SelfChecked", "SelfCheckedObject"]


class SelfCheckedObject(GroupObject):
    """A ``SelfChecked`` object. A tier that writes from a worker thread takes ``written()``
    there: each part hashed just before it is written, while its bytes are still in
    the CPU's cache for the copy, and the record last. Any other takes ``buffers()``,
    hashed on first use."""

    __slots__ = ("checked", "_built")

    def __init__(self, key: str, checked: SelfChecked) -> None:
        super().__init__(key, checked.nbytes)
        self.checked = checked
        self._built: list[Buffer] | None = None

    def written(self) -> Iterator[Buffer]:
        """The parts, each hashed as it is taken, then the closing buffers (once built,
        the same buffers again, hashed no more)."""
        if self._built is not None:
            yield from self._built
            return
        s = self.checked
        sums = list(s.sums)
        for part, at in zip(s.parts, s.sum_at, strict=True):
            if at is not None:
                sums[at] = s.hash(part)
            yield part
        tail = list(s.record_of(sums))
        if sum(memoryview(b).nbytes for b in tail) != s.record_bytes:
            raise ValueError(f"{self.key}: the record is not the {s.record_bytes} bytes promised")
        self._built = [*s.parts, *tail]
        yield from tail

    def buffers(self) -> Sequence[Buffer]:
        if self._built is None:
            for _ in self.written():
                pass
        assert self._built is not None
        return self._built
