"""Objects whose bytes end in a record of checksums of some of them (chunk and page
objects, the L2 adapter's objects), described before they are written: which parts are
hashed where, and how the record that closes the object is made from those sums (pure:
the tiers write them, ``tiers/self_checked.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class SelfChecked:
    """An object's bytes that end in a record of checksums of some of them (the LMCache
    plugin's chunks): ``parts`` in order, ``sum_at[i]`` where part ``i``'s checksum goes
    in the record's list (None: not hashed), ``sums`` that list with the entries known
    already, and ``record_of(sums)`` the buffers that close the object (``record_bytes``
    long). ``hash`` hashes one part."""

    parts: Sequence[Buffer]
    sum_at: Sequence[int | None]
    sums: Sequence[int]
    record_of: Callable[[list[int]], Sequence[Buffer]]
    record_bytes: int
    hash: Callable[[Buffer], int]

    @property
    def nbytes(self) -> int:
        """The object's size: its parts and its record."""
        return sum(memoryview(b).nbytes for b in self.parts) + self.record_bytes
