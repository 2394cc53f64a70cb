"""The SGLang backend's page I/O (no SGLang import): pages read through the engine port,
checked, and copied into the host pool (``PageIO.read_pages``), and pages stored once
from it (``PageIO.write_pages``), with the staging buffer a set uses.
``adapters/sglang/backend.py`` wires it to SGLang's HiCache interface."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from hurray_store.adapters.sglang.pages import (
    LAYOUTS,
    MLA_LAYOUTS,
    PageCodec,
    PageLayoutError,
    page_fingerprint,
)
from hurray_store.engine import EnginePort
from hurray_store.store.objects import Data

log = logging.getLogger(__name__)
SET_STEP = 16  # pages a set copies before their writes start
_SAFE_KEY = re.compile(r"[0-9A-Za-z_-]{1,128}")


@dataclass(frozen=True, slots=True)
class Piece:
    """Pages of another head range a reader's pages can be made of: their ``prefix``
    (what their names and fingerprints hash), their ``codec``, the heads ``take`` of
    them (local) and where those go among the reader's (``put``)."""

    prefix: str
    codec: PageCodec
    take: tuple[int, int]
    put: int

    @property
    def names(self) -> str:
        return _names(self.prefix)


def _names(prefix: str) -> str:
    return f"sgl.{xxhash.xxh3_128_hexdigest(prefix.encode())}."


class PageIO:
    """Reads and writes of one host pool's pages (``codec``) through the engine port.
    ``prefix`` is what a page's name and fingerprint hash besides its key; ``failed``
    counts and logs a store error (served as misses); ``counts`` are the backend's.
    ``sources``: other head ranges the pool's pages can be assembled from (each a list
    of pieces, all needed), asked where the pool's own pages fall short."""

    def __init__(
        self,
        port: EnginePort,
        codec: PageCodec,
        prefix: str,
        counts: dict[str, int],
        failed: Callable[[str, BaseException], None],
    ) -> None:
        self.port, self.codec = port, codec
        self.counts, self.failed = counts, failed
        self.set_prefix(prefix)
        self._set_staging: torch.Tensor | None = None
        self._set_lock = threading.Lock()
        self._storage: tuple[tuple[int, int], memoryview] | None = None  # a host pool's bytes

    def set_prefix(self, prefix: str, sources: Sequence[Sequence[Piece]] = ()) -> None:
        """Name (and fingerprint) pages under ``prefix`` from now on, and read other
        head ranges from ``sources``."""
        self.prefix = prefix
        self.names = _names(prefix)
        self.sources = [list(s) for s in sources]

    def name_of(self, key: str) -> str:
        """The store's object name of SGLang's page ``key``."""
        return self.names + _key(key)

    def page_key(self, name: str) -> tuple[bytes, ...]:
        """SGLang's page key of one of our object names, as a KV event's block hash: the
        key's bytes (a hex key decoded); an over-long key was stored under its xxh3-128,
        which stands for it. Empty: not one of this pool's pages."""
        if not name.startswith(self.names):
            return ()
        key = name[len(self.names) :]
        try:
            return (bytes.fromhex(key.removeprefix("h") if len(key) == 33 else key),)
        except ValueError:
            return (key.encode(),)

    def held(self, keys: list[str]) -> int:
        """How many of ``keys``, from the first, a get will find: leased (pinned until
        that get, or ``engine.lease_s``), so eviction does not take them meanwhile. Past
        the pool's own pages, the pages of the source that holds the longest run after
        them (a page counts only where every piece of it is held)."""
        n = self.port.lookup((self.name_of(k) for k in keys), lease=True).n
        if n < len(keys) and self.sources:
            n += self._best_source(keys[n:], lease=True)[1]
        return n

    def _best_source(self, keys: list[str], lease: bool = False) -> tuple[list[Piece], int]:
        """The source whose pieces all hold the longest run of ``keys``, and its length
        (leased, with ``lease``: the pieces' pages up to it)."""
        best: tuple[list[Piece], int] = ([], 0)
        for src in self.sources:
            m = len(keys)
            for piece in src:
                if m == 0:
                    break
                m = min(m, self.port.lookup([piece.names + _key(k) for k in keys[:m]]).n)
            if m > best[1]:
                best = (src, m)
        if lease and best[1]:
            for piece in best[0]:
                self.port.lookup([piece.names + _key(k) for k in keys[: best[1]]], lease=True)
        return best

    # ------------------------------------------------------------------ reads

    def read_pages(self, keys: list[str], dests: list[torch.Tensor]) -> int:
        """Read each key's page object, check it, and copy its pools into the ``[2,
        layers, page_size, heads, head_dim]`` view beside it (``EnginePort.load``);
        how many, from the first, were read, right and copied. Nothing is written into
        the slots of a page that is not among them; a page read that is not its key's
        object leaves the store. Past the pool's own pages, the pages of the source
        that holds the longest run after them, assembled from its pieces."""
        n = self._read_own(keys, dests)
        if n < len(keys) and self.sources:
            n += self._read_source(keys[n:], dests[n:])
        return n

    def _read_own(self, keys: list[str], dests: list[torch.Tensor]) -> int:
        codec = self.codec
        n = self._load(
            self.prefix, self.names, codec, keys, lambda j, obj: copy_page(codec, obj, dests[j])
        )
        self.counts["pages_read"] += n
        return n

    def _load(
        self,
        prefix: str,
        names: str,
        codec: PageCodec,
        keys: list[str],
        take: Callable[[int, torch.Tensor], None],
    ) -> int:
        """Page objects of ``keys`` named under ``names`` and fingerprinted under
        ``prefix``, read in order, each checked before ``take(j, object)``: how many,
        from the first, were (``EnginePort.load``; a wrong one leaves the store)."""
        fps = [page_fingerprint(prefix, k) for k in keys]
        wrong: list[int] = []

        def check(j: int, mv: memoryview) -> str:
            rec = mv[codec.size - codec.record_bytes :]
            why = codec.check(rec, fps[j], codec.pool_sums(mv))
            if why:
                wrong.append(j)
            return why

        try:
            n = self.port.load([names + _key(k) for k in keys], codec.size, check, take)
        except Exception as e:  # noqa: BLE001
            self.failed("get", e)
            return 0
        self.counts["pages_rejected"] += len(wrong)  # the port dropped it, and logged why
        return n

    def _read_source(self, keys: list[str], dests: list[torch.Tensor]) -> int:
        """Pages of ``keys`` assembled from the pieces of the best source: each piece's
        pages read and checked as the pool's own are, their heads copied into a staging
        page, and only the pages every piece delivered copied into ``dests``."""
        src, m = self._best_source(keys)
        if not m:
            return 0
        staged = torch.empty((m, *self.codec.shape), dtype=self.codec.dtype)
        for piece in src:

            def take(j: int, obj: torch.Tensor, piece: Piece = piece) -> None:
                copy_heads(piece, obj, staged[j])

            m = self._load(piece.prefix, piece.names, piece.codec, keys[:m], take)
            if not m:
                return 0
        for j in range(m):
            copy_into(dests[j], staged[j])
        self.counts["pages_read"] += m
        self.counts["pages_assembled"] += m
        return m

    # ------------------------------------------------------------------ writes

    def _staging(self, n: int) -> torch.Tensor:
        """A reused contiguous buffer of ``n`` staging pages (``codec.staging_shape``:
        the object's pools in order) that a set copies its pages into."""
        buf = self._set_staging
        if buf is None or buf.shape[0] < n:
            buf = torch.empty((max(n, 8), *self.codec.staging_shape), dtype=self.codec.dtype)
            self._set_staging = buf
        return buf

    def write_pages(self, keys: list[str], srcs: list[torch.Tensor]) -> list[bool]:
        """Store each page (a ``[2, layers, page_size, heads, head_dim]`` view) under its
        key unless the store holds it; returns once written through every tier (SGLang
        may then reuse the host pages)."""
        names = [self.name_of(k) for k in keys]
        with self._set_lock:
            out, written, held = save_missing(
                self.port, names, lambda todo: self._steps(todo, keys, names, srcs), self.failed
            )
        self.counts["pages_written"] += written
        self.counts["pages_deduplicated"] += held
        return out

    def _steps(
        self, todo: list[int], keys: list[str], names: list[str], srcs: list[torch.Tensor]
    ) -> Iterator[list[tuple[str, Data]]]:
        """The objects of the pages ``todo`` names, ``SET_STEP`` at a time, each built as
        the port asks for it (each pool hashed here) while the step before is written. A
        page whose pools are contiguous in the host pool (``layer_first``,
        ``page_first_direct``, ``page_first``) is written from there; any other is first
        copied into a staging page (numpy's copy, which lets the GIL go and starts no
        OpenMP threads, whose spinning slows the Python beside them)."""
        codec = self.codec
        staging: tuple[torch.Tensor, memoryview] | None = None
        for a in range(0, len(todo), SET_STEP):
            step: list[tuple[str, Data]] = []
            for i, j in enumerate(todo[a : a + SET_STEP], start=a):
                pools = codec.direct_pools(srcs[j], self._bytes_of(srcs[j]))
                if pools is None:
                    if staging is None:
                        buf = self._staging(len(todo))
                        staging = (buf, codec.staging_bytes(buf))
                    copy_into(codec.staging_page(staging[0], i), srcs[j])
                    pools = codec.pool_views(staging[1], i)
                fp = page_fingerprint(self.prefix, keys[j])
                step.append((names[j], codec.encode(pools, fp)))
            yield step

    def _bytes_of(self, page: torch.Tensor) -> memoryview:
        """The bytes of the storage ``page`` is a view of (kept for the last one)."""
        storage = page.untyped_storage()
        at = (storage.data_ptr(), storage.nbytes())
        if self._storage is None or self._storage[0] != at:
            flat = torch.empty(0, dtype=torch.uint8).set_(storage)
            self._storage = (at, memoryview(flat.numpy()))  # type: ignore[arg-type]
        return self._storage[1]


def page_starts(host_indices: Any, n: int, page_size: int) -> list[int]:
    """The host index each of ``n`` pages starts at (page ``i`` at ``host_indices[i *
    page_size]``, its indices consecutive), as SGLang hands a call's pages over; raises
    PageLayoutError when the indices do not name ``n`` pages of ``page_size``."""
    P = page_size
    if not isinstance(host_indices, torch.Tensor):
        raise PageLayoutError("no host indices")
    if host_indices.dtype.is_floating_point or host_indices.dtype == torch.bool:
        raise PageLayoutError(f"host indices of {host_indices.dtype}, not integers")
    if host_indices.numel() != n * P:
        raise PageLayoutError(f"{host_indices.numel()} host indices for {n} pages of {P}")
    pages = host_indices.reshape(n, P).to(torch.int64)
    if n and not torch.equal(pages - pages[:, :1], torch.arange(P).expand(n, P)):
        raise PageLayoutError("a page's host indices are not consecutive")
    return [int(i) for i in pages[:, 0].tolist()]


def save_missing(
    port: EnginePort,
    names: list[str],
    steps: Callable[[list[int]], Iterator[list[tuple[str, Data]]]],
    failed: Callable[[str, BaseException], None],
    what: str = "set",
) -> tuple[list[bool], int, int]:
    """Store the objects ``names`` the store does not hold yet (``steps(todo)`` yields
    theirs, a step at a time, as the port asks); returns once written through: per
    name whether it is stored (held or written), how many were written and how many
    held. A store error is ``failed(what, error)`` and nothing stored, never raised."""
    try:
        held = port.held_each(names)
        todo = [j for j, h in enumerate(held) if not h]
        stored = port.save_lent(steps(todo))
    except Exception as e:  # noqa: BLE001 - not stored, never an error into the engine
        failed(what, e)
        return [False] * len(names), 0, 0
    out = list(held)
    for j, ok in zip(todo, stored, strict=True):
        out[j] = ok
    return out, sum(stored), sum(held)


def _key(key: str) -> str:
    """An SGLang page key as the last part of an object name."""
    if _SAFE_KEY.fullmatch(key):
        return key
    return "h" + xxhash.xxh3_128_hexdigest(key.encode())


def copy_heads(piece: Piece, obj: torch.Tensor, dest: torch.Tensor) -> None:
    """The heads ``piece.take`` of the page object of another head range read into
    ``obj`` into heads from ``piece.put`` of ``dest`` (a ``[2, layers, page_size,
    heads, head_dim]`` page)."""
    a, b = piece.take
    d = dest.view(torch.uint8)[:, :, :, piece.put : piece.put + b - a]
    for part, r, li in piece.codec.page_of(obj):
        src = part[..., a:b, :]
        (d if r < 0 else d[r, li]).copy_(src)


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


def unsupported_mla_pool(pool: Any) -> str:
    """Why the backend cannot serve this MLA host pool ("" when it can)."""
    attrs = ("kv_buffer", "layer_num", "kv_cache_dim", "page_size", "dtype")
    why = _unsupported(pool, MLA_LAYOUTS, attrs, "an MLA host pool")
    if why:
        return why
    kv = pool.kv_buffer
    if kv.dim() not in (4, 5) or kv.shape[-2] != 1 or kv.shape[-1] != pool.kv_cache_dim:
        return f"an MLA host pool of shape {tuple(kv.shape)} (one latent row per token)"
    return _codec_why(1, pool.kv_cache_dim, pool, fused=True)


def unsupported_pool(pool: Any) -> str:
    """Why the backend cannot serve this host pool ("" when it can)."""
    attrs = ("kv_buffer", "layer_num", "head_num", "head_dim", "page_size", "dtype")
    why = _unsupported(pool, LAYOUTS, attrs, "an MHA host pool")
    if why:
        return why
    if getattr(pool, "v_head_dim", pool.head_dim) != pool.head_dim:
        return f"V head size {pool.v_head_dim} differs from K's {pool.head_dim}"
    return _codec_why(pool.head_num, pool.head_dim, pool)


def _unsupported(pool: Any, layouts: Sequence[str], attrs: Sequence[str], what: str) -> str:
    """What the two pools' checks share: the layout, the attributes, a CPU tensor of
    the KV's dtype."""
    layout = getattr(pool, "layout", None)
    if layout not in layouts:
        return f"{what}'s layout {layout!r} (supported: {', '.join(layouts)})"
    for attr in attrs:
        if getattr(pool, attr, None) is None:
            return f"{what} without {attr} ({type(pool).__name__})"
    kv = pool.kv_buffer
    if not isinstance(kv, torch.Tensor) or kv.device.type != "cpu":
        return "a host pool that is not a CPU tensor"
    if kv.dtype != pool.dtype:
        return f"a host pool of {kv.dtype} for a KV of {pool.dtype}"
    return ""


def _codec_why(heads: Any, head_dim: Any, pool: Any, fused: bool = False) -> str:
    try:
        PageCodec(1, int(heads), int(head_dim), int(pool.page_size), pool.dtype, fused=fused)
    except (ValueError, TypeError) as e:
        return str(e)
    return ""
