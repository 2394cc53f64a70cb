"""The SGLang backend's page I/O (no SGLang import): pages read from the store, checked,
and copied into the host pool (``PageIO.read_pages``), and pages copied out of it and
stored once (``PageIO.write_pages``), with the buffers and the helper thread they use.
``adapters/sglang.py`` wires it to SGLang's HiCache interface."""

from __future__ import annotations

import asyncio
import logging
import queue
import re
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import torch
import xxhash

from hurray_store.adapters.sglang_pages import LAYOUTS, PageCodec, page_fingerprint
from hurray_store.adapters.store_thread import StoreThread

log = logging.getLogger(__name__)
TIMEOUT_S = 60.0  # the longest a call waits for the store before it is a miss
SET_STEP = 16  # pages a set copies before their writes start
HELP_POLL_S = 0.0005  # how often a set that waits for its writes looks for one to take
_SAFE_KEY = re.compile(r"[0-9A-Za-z_-]{1,128}")
ON_THE_LOOP = "not read on the calling thread"  # a page ``_read_on_the_loop`` reads


class PageIO:
    """Reads and writes of one host pool's pages (``codec``) in the store of ``st``.
    ``prefix`` is what a page's name and fingerprint hash besides its key; ``failed``
    counts and logs a store error (served as misses); ``counts`` are the backend's."""

    def __init__(
        self,
        st: StoreThread,
        codec: PageCodec,
        prefix: str,
        counts: dict[str, int],
        failed: Callable[[str, BaseException], None],
    ) -> None:
        self.st, self.store, self.codec, self.prefix = st, st.store, codec, prefix
        self.counts, self.failed = counts, failed
        self.names = f"sgl.{xxhash.xxh3_128_hexdigest(prefix.encode())}."
        self._ahead = ReadAhead(codec.size)
        self._get_staging: torch.Tensor | None = None  # page objects read (uint8)
        self._set_staging: torch.Tensor | None = None
        self._set_lock = threading.Lock()
        self._storage: tuple[tuple[int, int], memoryview] | None = None  # a host pool's bytes

    def name_of(self, key: str) -> str:
        """The store's object name of SGLang's page ``key``."""
        if _SAFE_KEY.fullmatch(key):
            return self.names + key
        return self.names + "h" + xxhash.xxh3_128_hexdigest(key.encode())

    def close(self) -> None:
        self._ahead.close()

    # ------------------------------------------------------------------ reads

    def read_pages(self, keys: list[str], dests: list[torch.Tensor]) -> int:
        """Read each key's page object, check it, and copy its pools into the ``[2,
        layers, page_size, heads, head_dim]`` view beside it; how many, from the first,
        were read, right and copied. Nothing is written into the slots of a page that
        is not among them. A page that was read but is not its key's object is dropped
        from the store.

        Pages a tier reads on the calling thread (a disk tier, a single Redis) are read
        and checked one at a time on a helper thread (``ReadAhead``) while this thread
        copies the ones before them into the pool. From the first page that such a tier
        does not hold, pages are read on the store's loop into a staging buffer, then
        checked and copied."""
        codec, n = self.codec, len(keys)
        names = [self.name_of(k) for k in keys]
        whys: list[str | None] = [None] * n  # None: not read; "": right; else why not
        whole = [(0, codec.size)]

        def read(j: int, into: memoryview) -> str | None:
            if not self.store.read_objects_into_now([(names[j], whole, [into])])[0]:
                return ON_THE_LOOP
            return self._check(keys[j], into) or None

        def take(j: int, obj: torch.Tensor) -> None:
            copy_page(codec, obj, dests[j])

        try:
            at, why = self._ahead.run(n, read, take)
            whys[:at] = [""] * at
            if why is not None:
                whys[at] = why
            if why == ON_THE_LOOP:
                at = self._read_on_the_loop(keys, names, dests, whys, at)
        except Exception as e:  # noqa: BLE001
            self.failed("get", e)
            return 0
        why = whys[at] if at < n else ""
        if why and why != ON_THE_LOOP:
            self.counts["pages_rejected"] += 1
            log.warning("HurrayHiCacheStorage: page %s: %s; dropped, a miss", keys[at], why)
            self._drop(names[at])
        self.counts["pages_read"] += at
        return at

    def _read_on_the_loop(
        self,
        keys: list[str],
        names: list[str],
        dests: list[torch.Tensor],
        whys: list[str | None],
        at: int,
    ) -> int:
        """Pages ``at`` on (up to the first known wrong one) read on the store's loop
        into a staging buffer, each checked, then copied, in order; where the leading
        run copied ends now (``whys`` says why)."""
        end = next(
            (j for j in range(at, len(keys)) if whys[j] not in (None, "", ON_THE_LOOP)), len(keys)
        )
        todo = list(range(at, end))
        objs = self._objects(len(todo))
        mvs = [memoryview(objs[i].numpy()) for i in range(len(todo))]  # type: ignore[arg-type]
        got = self.st.call(self._read_all([names[j] for j in todo], mvs), TIMEOUT_S)
        for i, (j, ok) in enumerate(zip(todo, got, strict=True)):
            if not ok:
                whys[j] = ON_THE_LOOP  # a miss there too
                return j
            whys[j] = why = self._check(keys[j], mvs[i])
            if why:
                return j
            copy_page(self.codec, objs[i], dests[j])
        return end

    def _check(self, key: str, mv: memoryview) -> str:
        """Why the page object read into ``mv`` is not ``key``'s ("" when it is)."""
        codec = self.codec
        rec = mv[codec.size - codec.record_bytes :]
        return codec.check(rec, page_fingerprint(self.prefix, key), codec.pool_sums(mv))

    def _objects(self, n: int) -> torch.Tensor:
        """A reused ``[n, object size]`` uint8 buffer that page objects are read into
        on the store's loop."""
        buf = self._get_staging
        if buf is None or buf.shape[0] < n:
            buf = self._get_staging = torch.empty((max(n, 8), self.codec.size), dtype=torch.uint8)
        return buf

    async def _read_all(self, names: list[str], mvs: list[memoryview]) -> list[bool]:
        whole = [(0, self.codec.size)]
        got = await asyncio.gather(
            *(self.store.read_object_into(n, whole, [m]) for n, m in zip(names, mvs, strict=True)),
            return_exceptions=True,
        )
        return [r is True for r in got]

    def _drop(self, name: str) -> None:
        try:
            self.st.call(self.store.delete_object(name), TIMEOUT_S)
        except Exception as e:  # noqa: BLE001
            self.failed("delete", e)

    # ------------------------------------------------------------------ writes

    def _staging(self, n: int) -> torch.Tensor:
        """A reused contiguous buffer of ``n`` pages, ``[2, layers, page_size, heads,
        head_dim]`` each, that a set copies its pages into."""
        buf = self._set_staging
        if buf is None or buf.shape[0] < n:
            buf = torch.empty((max(n, 8), *self.codec.shape), dtype=self.codec.dtype)
            self._set_staging = buf
        return buf

    def write_pages(self, keys: list[str], srcs: list[torch.Tensor]) -> list[bool]:
        """Store each page (a ``[2, layers, page_size, heads, head_dim]`` view) under its
        key unless the store holds it; returns once written through every tier."""
        names = [self.name_of(k) for k in keys]
        with self._set_lock:
            try:
                held = self.st.call(self._held_each(names), TIMEOUT_S)
                todo = [j for j in range(len(keys)) if not held[j]]
                stored = self._put_steps(todo, keys, names, srcs)
            except Exception as e:  # noqa: BLE001
                self.failed("set", e)
                return [False] * len(keys)
        out = list(held)
        for j, ok in zip(todo, stored, strict=True):
            out[j] = ok
        self.counts["pages_written"] += sum(stored)
        self.counts["pages_deduplicated"] += sum(held)
        return out

    def _put_steps(
        self, todo: list[int], keys: list[str], names: list[str], srcs: list[torch.Tensor]
    ) -> list[bool]:
        """Put the object of each page ``todo`` names, in steps of ``SET_STEP`` pages: a
        step's objects are built on this thread (each pool hashed) and their writes run
        on the store's threads while the next step is built. A page whose pools are
        contiguous in the host pool (``layer_first``, ``page_first_direct``) is written
        from there; any other is first copied into a staging page (numpy's copy, which
        lets the GIL go and starts no OpenMP threads, whose spinning slows the Python
        beside them). Returns once every put ended and the store flushed: SGLang may
        reuse the host pages, and the staging pages are free again."""
        codec = self.codec
        futs: list[Future[list[bool]]] = []
        staging: tuple[torch.Tensor, memoryview] | None = None
        try:
            for a in range(0, len(todo), SET_STEP):
                step = []
                for i, j in enumerate(todo[a : a + SET_STEP], start=a):
                    pools = codec.direct_pools(srcs[j], self._bytes_of(srcs[j]))
                    if pools is None:
                        if staging is None:
                            buf = self._staging(len(todo))
                            staging = (buf, codec.staging_bytes(buf))
                        copy_into(staging[0][i], srcs[j])
                        pools = codec.pool_views(staging[1], i)
                    fp = page_fingerprint(self.prefix, keys[j])
                    step.append((names[j], codec.encode(pools, fp)))
                futs.append(self.st.submit(self._put_all(step)))
            # This thread would only wait now: it writes queued pages itself, the
            # last it copied first (still in its CPU's cache).
            while left := [f for f in futs if not f.done()]:
                if not self.store.help_writes():  # none queued yet: look again soon
                    wait(left, HELP_POLL_S, return_when=FIRST_COMPLETED)
        finally:
            # Every put that started ends before its pages are reused.
            done = [f.result(TIMEOUT_S) for f in futs]
        self.st.call(self.store.flush(), TIMEOUT_S)  # written through every tier
        return [ok for d in done for ok in d]

    def _bytes_of(self, page: torch.Tensor) -> memoryview:
        """The bytes of the storage ``page`` is a view of (kept for the last one)."""
        storage = page.untyped_storage()
        at = (storage.data_ptr(), storage.nbytes())
        if self._storage is None or self._storage[0] != at:
            flat = torch.empty(0, dtype=torch.uint8).set_(storage)
            self._storage = (at, memoryview(flat.numpy()))  # type: ignore[arg-type]
        return self._storage[1]

    async def _held_each(self, names: list[str]) -> list[bool]:
        await self.store.sync()
        out = [self.store.has_object(n) for n in names]
        if self.store.shared and not all(out):
            asks = [self.store.contains_object(n) for n, h in zip(names, out, strict=True) if not h]
            found = iter(await asyncio.gather(*asks))
            out = [h or bool(next(found)) for h in out]
        return out

    async def _put_all(self, items: list[tuple[str, list[memoryview | bytes]]]) -> list[bool]:
        got = await asyncio.gather(
            *(self.store.put_object(n, bufs, self_checked=True) for n, bufs in items),
            return_exceptions=True,
        )
        return [r is True for r in got]


class ReadAhead:
    """A get's pages read and checked on a thread of its own, each into one of a few
    reused buffers of one page object, while the caller copies the pages before it
    into the host pool, in order: a page's bytes are still in the CPU's cache when
    they are hashed and copied, and the reads, hashes and copies (all of which let
    the GIL go) run on two cores."""

    def __init__(self, object_bytes: int, buffers: int = 3) -> None:
        self.pool = ThreadPoolExecutor(1, "hurray-sglang-get")
        self.buffers = [torch.empty(object_bytes, dtype=torch.uint8) for _ in range(buffers)]

    def run(
        self,
        n: int,
        read: Callable[[int, memoryview], str | None],
        take: Callable[[int, torch.Tensor], None],
    ) -> tuple[int, str | None]:
        """``read(j, into)`` of pages ``0 .. n - 1`` in order on the helper thread
        (None: read and right, else why not), ``take(j, buffer)`` of each right one on
        the caller's, in order, up to the first that is not: how many were taken, and
        why the next one was not (None: all were)."""
        free: queue.SimpleQueue[int] = queue.SimpleQueue()
        ready: queue.SimpleQueue[tuple[int, int, str | None] | BaseException] = queue.SimpleQueue()
        for i in range(len(self.buffers)):
            free.put(i)
        stop = threading.Event()
        views = [memoryview(b.numpy()) for b in self.buffers]  # type: ignore[arg-type]

        def reader() -> None:
            try:
                for j in range(n):
                    i = free.get()
                    if stop.is_set():
                        return
                    why = read(j, views[i])
                    ready.put((j, i, why))
                    if why is not None:
                        return
            except BaseException as e:  # handed to the caller
                ready.put(e)

        done = self.pool.submit(reader)
        taken, why = 0, None
        try:
            while taken < n:
                got = ready.get()
                if isinstance(got, BaseException):
                    raise got
                j, i, why = got
                if why is not None:
                    break
                take(j, self.buffers[i])
                free.put(i)
                taken += 1
        finally:
            stop.set()
            free.put(0)  # wakes a reader waiting for a buffer; it sees stop
            done.result()
        return taken, why

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def copy_into(dest: torch.Tensor, src: torch.Tensor) -> None:
    """``dest.copy_(src)`` (same shape and dtype) by numpy: on this thread alone, the
    GIL let go."""
    np.copyto(dest.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())


def copy_page(codec: PageCodec, obj: torch.Tensor, dest: torch.Tensor) -> None:
    """The pools of the page object in ``obj`` into ``dest``, a ``[2, layers, page_size,
    heads, head_dim]`` view of the host pool (numpy's copy: it lets the GIL go, and
    runs on the calling thread alone, where torch's would start its OpenMP threads)."""
    d = dest.view(torch.uint8)  # [2, layers, page_size, heads, head_dim * itemsize]
    for part, r, li in codec.page_of(obj):
        np.copyto((d if r < 0 else d[r, li]).numpy(), part.numpy())


def unsupported_pool(pool: Any) -> str:
    """Why the backend cannot serve this host pool ("" when it can)."""
    layout = getattr(pool, "layout", None)
    if layout not in LAYOUTS:
        return f"host pool layout {layout!r} (supported: {', '.join(LAYOUTS)})"
    for attr in ("kv_buffer", "layer_num", "head_num", "head_dim", "page_size", "dtype"):
        if not hasattr(pool, attr):
            return f"a host pool without {attr} ({type(pool).__name__}: MHA pools only)"
    if getattr(pool, "v_head_dim", pool.head_dim) != pool.head_dim:
        return f"V head size {pool.v_head_dim} differs from K's {pool.head_dim}"
    kv = pool.kv_buffer
    if not isinstance(kv, torch.Tensor) or kv.device.type != "cpu":
        return "a host pool that is not a CPU tensor"
    if kv.dtype != pool.dtype:
        return f"a host pool of {kv.dtype} for a KV of {pool.dtype}"
    try:
        PageCodec(1, int(pool.head_num), int(pool.head_dim), int(pool.page_size), pool.dtype)
    except (ValueError, TypeError) as e:
        return str(e)
    return ""
