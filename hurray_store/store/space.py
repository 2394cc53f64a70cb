"""ObjectSpace: where objects are built or received before a tier publishes them."""

from __future__ import annotations

from hurray_store.buffers import BufferPool
from hurray_store.tiers import Reservation


class ObjectSpace:
    """Where new objects are built or received in place: space reserved in a tier (one
    reservation per object), else one borrowed resident buffer cut into a view per
    object. ``release()`` gives back what no tier published; it runs once (when the
    last tier write is done, or on the way out of an error). The segment writer and
    the cache server's puts both land their bytes here."""

    def __init__(
        self, buffers: BufferPool, sizes: list[int], reserved: list[Reservation] | None
    ) -> None:
        self.pool = buffers
        self.reserved = reserved
        self.buf: bytearray | None = None
        self.released = False
        if reserved is not None:
            self.views = [r.view for r in reserved]
            return
        self.buf = buffers.acquire(sum(sizes))
        self.views, pos = [], 0
        for size in sizes:
            self.views.append(memoryview(self.buf)[pos : pos + size])
            pos += size

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        if self.buf is not None:
            self.pool.release(self.buf)
        for r in self.reserved or []:
            if not r.committed:
                r.tier.unreserve(r)

    def __enter__(self) -> ObjectSpace:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is not None:
            self.release()
