"""hurray_store as SGLang's HiCache storage backend (L3), for SGLang 0.5.23 (the only
module that imports ``sglang``).

Loaded by SGLang's backend factory::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
      '{"backend_name": "hurray", "module_path": "hurray_store.adapters.sglang",
        "class_name": "HurrayHiCacheStorage", "interface_v1": 1,
        "config": "/etc/hurray/store.yaml", "model_path": "/models/qwen2.5-0.5b"}'

- ``interface_v1: 1`` selects the zero-copy calls (``batch_exists``, ``batch_get_v1``,
  ``batch_set_v1`` over the registered host pool); without it SGLang uses the legacy
  ``batch_get`` / ``batch_set`` of flat pages, which work too.
- ``config``: a hurray_store YAML (absent: the embedded default, CPU memory and
  ``./.hurray-cache``). ``model_path``: the model's folder, hashed for the key (absent:
  SGLang's ``model_name`` when it is a folder, else the name, with a warning).
  ``salt``: a namespace of its own in the key (absent: the store config's).

Every page is one object (``sglang_pages``); its name is SGLang's page key after a
prefix that hashes everything else the page's bytes depend on: the model's identity
from its weights and config (``identity.model_identity``, the rule vLLM's connector and
the transformers adapter follow), the salt, the KV geometry (layers, heads, head size,
page size, dtype) and the ranks (TP, PP, attention CP). The host pool's layout is not in
it: a page object is the same whichever layout wrote it.

What SGLang relies on: ``batch_exists`` counts the leading run the ledger (or a shared
tier) hold; a get checks every page in a staging buffer before it copies it into the
host pool, and a page that is missing, corrupt or another page's object is False, with
every page after it; a failed check drops the object. The store down, slow or full is
misses and a warning, never an exception into SGLang's threads. A set returns once its
pages are written through every tier (SGLang may reuse the host pages right after).
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from hurray_store.adapters.sglang_pages import (
    LAYOUTS,
    PageCodec,
    PageLayoutError,
    flat_page_view,
    page_fingerprint,
    page_view,
)
from hurray_store.adapters.store_thread import StoreThread, held_prefix
from hurray_store.identity import checkpoint_id, model_identity

log = logging.getLogger(__name__)
_TIMEOUT_S = 60.0  # the longest a call waits for the store before it is a miss
_SAFE_KEY = re.compile(r"[0-9A-Za-z_-]{1,128}")
_WARN_EVERY_S = 10.0  # a failing store is logged at most this often
_SET_STEP = 16  # pages a set copies before their writes start


def _identity(model_path: str | None, model_name: str | None) -> str:
    """The model's identity from its folder (weights and KV-shaping config)."""
    folder = model_path or model_name or ""
    if not folder:
        raise ValueError(
            "HurrayHiCacheStorage: no model to key by: set model_path in "
            "--hicache-storage-backend-extra-config"
        )
    cfg: dict[str, Any] = {}
    p = Path(folder)
    if p.is_dir() and (p / "config.json").is_file():
        try:
            cfg = json.loads((p / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"HurrayHiCacheStorage: {p / 'config.json'}: {e}") from e
    elif not model_path:
        log.warning(
            "HurrayHiCacheStorage: model_name %r is not a model folder; set model_path "
            "so the key names the weights",
            folder,
        )
    return model_identity(checkpoint_id(folder), cfg)


class HurrayHiCacheStorage(HiCacheStorage):
    """SGLang's L3 HiCache storage on a hurray_store TieredStore (see the module doc)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        if storage_config.is_mla_model:
            # SGLang stores an MLA model's latent once for all TP ranks (one writer);
            # this backend keys per rank and has not been tested on MLA pools.
            raise ValueError(
                "HurrayHiCacheStorage: MLA models are not supported (the latent KV is "
                "shared by every TP rank); serve this model with another L3 backend"
            )
        if storage_config.should_split_heads:
            raise ValueError(
                "HurrayHiCacheStorage: tp_lcm_size (pages split by heads across "
                "heterogeneous TP) is not supported"
            )
        self.storage_config = storage_config
        self.identity = _identity(extra.get("model_path"), storage_config.model_name)
        self.st = StoreThread(extra.get("config"), "hurray-sglang")
        self.store = self.st.store
        self.salt = str(extra.get("salt", "")) or self.store.config.salt
        c = storage_config
        self.ranks = (
            f"tp{c.tp_rank}/{c.tp_size}.pp{c.pp_rank}/{c.pp_size}"
            f".cp{c.attn_cp_rank}/{c.attn_cp_size}"
        )
        self.codec: PageCodec | None = None
        self.layout = ""
        self.disabled = "no host pool registered"
        self.prefix = ""  # what a page's name and fingerprint hash besides its key
        self._names = ""  # the names' prefix
        self._get_staging: torch.Tensor | None = None  # page objects read (uint8)
        self._ahead: _ReadAhead | None = None
        self._set_staging: torch.Tensor | None = None
        self._get_lock = threading.Lock()  # SGLang's prefetch and backup threads
        self._set_lock = threading.Lock()
        self._warned = 0.0
        self.counts = {
            "pages_read": 0,
            "pages_written": 0,
            "pages_deduplicated": 0,  # a set of pages the store already held
            "pages_rejected": 0,  # read, but not this page's object (dropped)
            "store_errors": 0,
        }
        # SGLang's StorageMetrics, per call since the last get_stats
        self._prefetch: list[tuple[int, float]] = []  # (pages, GB/s)
        self._backup: list[tuple[int, float]] = []

    # ------------------------------------------------------------------ the pool

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pool = mem_pool_host
        why = _unsupported(pool)
        if why:
            self.disabled = why
            log.warning("HurrayHiCacheStorage: every page a miss: %s", why)
            return
        self.layout = str(pool.layout)
        self.codec = PageCodec(
            int(pool.layer_num),
            int(pool.head_num),
            int(pool.head_dim),
            int(pool.page_size),
            pool.dtype,
        )
        fields = {
            "model": self.identity,
            "salt": self.salt,
            "layers": self.codec.layers,
            "heads": self.codec.heads,
            "head_dim": self.codec.head_dim,
            "page_size": self.codec.page_size,
            "dtype": str(self.codec.dtype),
            "ranks": self.ranks,
        }
        self.prefix = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        self._names = f"sgl.{xxhash.xxh3_128_hexdigest(self.prefix.encode())}."
        if self._ahead is not None:
            self._ahead.close()
        self._ahead = _ReadAhead(self.codec.size)
        self.disabled = ""
        log.info(
            "HurrayHiCacheStorage: host pool %s, %d layers x %d heads x %d, pages of %d "
            "tokens (%d KiB), %s",
            self.layout,
            self.codec.layers,
            self.codec.heads,
            self.codec.head_dim,
            self.codec.page_size,
            self.codec.page_bytes >> 10,
            self.ranks,
        )

    def name_of(self, key: str) -> str:
        """The store's object name of SGLang's page ``key``."""
        if _SAFE_KEY.fullmatch(key):
            return self._names + key
        return self._names + "h" + xxhash.xxh3_128_hexdigest(key.encode())

    def _page_views(
        self, n: int, host_indices: torch.Tensor, call: str
    ) -> list[torch.Tensor] | None:
        """The host pool's ``[2, layers, page_size, heads, head_dim]`` view of each of
        ``n`` pages (page ``i`` starts at ``host_indices[i * page_size]``); None, logged,
        when the indices do not name ``n`` pages of the pool."""
        assert self.codec is not None
        P = self.codec.page_size
        try:
            if host_indices.numel() < n * P:
                raise PageLayoutError(f"{host_indices.numel()} host indices for {n} pages of {P}")
            starts = [int(i) for i in host_indices[: n * P : P].tolist()]
            return [page_view(self.mem_pool_host.kv_buffer, self.layout, P, s) for s in starts]
        except PageLayoutError as e:
            log.error("HurrayHiCacheStorage: %s: %s", call, e)
            return None

    def _staging(self, n: int) -> torch.Tensor:
        """A reused contiguous buffer of ``n`` pages, ``[2, layers, page_size, heads,
        head_dim]`` each, that a set copies its pages into."""
        assert self.codec is not None
        buf = self._set_staging
        if buf is None or buf.shape[0] < n:
            buf = torch.empty((max(n, 8), *self.codec.shape), dtype=self.codec.dtype)
            self._set_staging = buf
        return buf

    def _failed(self, what: str, e: BaseException) -> None:
        self.counts["store_errors"] += 1
        now = time.monotonic()
        if now - self._warned >= _WARN_EVERY_S:
            self._warned = now
            log.warning("HurrayHiCacheStorage: %s failed, served as misses: %r", what, e)

    # ------------------------------------------------------------------ exists

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many of ``keys``, from the first, a get will find."""
        if self.disabled or not keys:
            return 0
        try:
            names = [self.name_of(k) for k in keys]
            return int(self.st.call(held_prefix(self.store, names), _TIMEOUT_S))
        except Exception as e:  # noqa: BLE001 - a miss, never an error into SGLang
            self._failed("exists", e)
            return 0

    # ------------------------------------------------------------------ gets

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read pages into the host pool at ``host_indices`` (page ``i`` at
        ``host_indices[i * page_size]``): True for each page read and checked, up to
        the first that is not."""
        out = [False] * len(keys)
        if self.disabled or not keys:
            return out
        assert self.codec is not None
        t0 = time.perf_counter()
        dests = self._page_views(len(keys), host_indices, "batch_get_v1")
        if dests is None:
            return out
        with self._get_lock:
            n = self._read_pages(keys, dests)
            for i in range(n):
                out[i] = True
        self._note(self._prefetch, n, time.perf_counter() - t0)
        return out

    def _read_pages(self, keys: list[str], dests: list[torch.Tensor]) -> int:
        """Read each key's page object, check it, and copy its pools into the ``[2,
        layers, page_size, heads, head_dim]`` view beside it; how many, from the first,
        were read, right and copied. Nothing is written into the slots of a page that
        is not among them. A page that was read but is not its key's object is dropped
        from the store.

        Pages a tier reads on the calling thread (a disk tier, a single Redis) are read
        and checked one at a time on a helper thread (``_ReadAhead``) while this thread
        copies the ones before them into the pool. From the first page that such a tier
        does not hold, pages are read on the store's loop into a staging buffer, then
        checked and copied."""
        assert self.codec is not None and self._ahead is not None
        codec, n = self.codec, len(keys)
        names = [self.name_of(k) for k in keys]
        whys: list[str | None] = [None] * n  # None: not read; "": right; else why not
        whole = [(0, codec.size)]

        def read(j: int, into: memoryview) -> str | None:
            if not self.store.read_objects_into_now([(names[j], whole, [into])])[0]:
                return _ON_THE_LOOP
            return self._check(keys[j], into) or None

        def take(j: int, obj: torch.Tensor) -> None:
            _copy_page(codec, obj, dests[j])

        try:
            at, why = self._ahead.run(n, read, take)
            whys[:at] = [""] * at
            if why is not None:
                whys[at] = why
            if why == _ON_THE_LOOP:
                at = self._read_on_the_loop(keys, names, dests, whys, at)
        except Exception as e:  # noqa: BLE001
            self._failed("get", e)
            return 0
        why = whys[at] if at < n else ""
        if why and why != _ON_THE_LOOP:
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
        assert self.codec is not None
        end = next(
            (j for j in range(at, len(keys)) if whys[j] not in (None, "", _ON_THE_LOOP)), len(keys)
        )
        todo = list(range(at, end))
        objs = self._objects(len(todo))
        mvs = [memoryview(objs[i].numpy()) for i in range(len(todo))]  # type: ignore[arg-type]
        got = self.st.call(self._read_all([names[j] for j in todo], mvs), _TIMEOUT_S)
        for i, (j, ok) in enumerate(zip(todo, got, strict=True)):
            if not ok:
                whys[j] = _ON_THE_LOOP  # a miss there too
                return j
            whys[j] = why = self._check(keys[j], mvs[i])
            if why:
                return j
            _copy_page(self.codec, objs[i], dests[j])
        return end

    def _check(self, key: str, mv: memoryview) -> str:
        """Why the page object read into ``mv`` is not ``key``'s ("" when it is)."""
        assert self.codec is not None
        codec = self.codec
        rec = mv[codec.size - codec.record_bytes :]
        return codec.check(rec, page_fingerprint(self.prefix, key), codec.pool_sums(mv))

    def _objects(self, n: int) -> torch.Tensor:
        """A reused ``[n, object size]`` uint8 buffer that page objects are read into
        on the store's loop."""
        assert self.codec is not None
        buf = self._get_staging
        if buf is None or buf.shape[0] < n:
            buf = self._get_staging = torch.empty((max(n, 8), self.codec.size), dtype=torch.uint8)
        return buf

    async def _read_all(self, names: list[str], mvs: list[memoryview]) -> list[bool]:
        assert self.codec is not None
        whole = [(0, self.codec.size)]
        got = await asyncio.gather(
            *(self.store.read_object_into(n, whole, [m]) for n, m in zip(names, mvs, strict=True)),
            return_exceptions=True,
        )
        return [r is True for r in got]

    def _drop(self, name: str) -> None:
        try:
            self.st.call(self.store.delete_object(name), _TIMEOUT_S)
        except Exception as e:  # noqa: BLE001
            self._failed("delete", e)

    # ------------------------------------------------------------------ sets

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store the pages at ``host_indices`` under ``keys``; a page the store holds
        already is not written again. True for each page stored (or held)."""
        out = [False] * len(keys)
        if self.disabled or not keys:
            return out
        assert self.codec is not None
        t0 = time.perf_counter()
        srcs = self._page_views(len(keys), host_indices, "batch_set_v1")
        if srcs is None:
            return out
        out = self._write_pages(keys, srcs)
        self._note(self._backup, sum(out), time.perf_counter() - t0)
        return out

    def _write_pages(self, keys: list[str], srcs: list[torch.Tensor]) -> list[bool]:
        """Store each page (a ``[2, layers, page_size, heads, head_dim]`` view) under its
        key unless the store holds it; returns once written through every tier."""
        assert self.codec is not None
        codec = self.codec
        names = [self.name_of(k) for k in keys]
        with self._set_lock:
            try:
                held = self.st.call(self._held_each(names), _TIMEOUT_S)
                staging = self._staging(len(keys))
                pages = codec.staging_bytes(staging)
                todo = [j for j in range(len(keys)) if not held[j]]
                items = [
                    (j, names[j], codec.encode(pages, j, page_fingerprint(self.prefix, keys[j])))
                    for j in todo
                ]
                stored = self._copy_and_put(staging, srcs, items)
            except Exception as e:  # noqa: BLE001
                self._failed("set", e)
                return [False] * len(keys)
        out = list(held)
        for (j, _, _), ok in zip(items, stored, strict=True):
            out[j] = ok
        self.counts["pages_written"] += sum(stored)
        self.counts["pages_deduplicated"] += sum(held)
        return out

    def _copy_and_put(
        self, staging: torch.Tensor, srcs: list[torch.Tensor], items: list[tuple[int, str, Any]]
    ) -> list[bool]:
        """Copy each item's page into its staging page and put its object, in steps of
        ``_SET_STEP`` pages: a step's writes (on the disk tier's threads) run while the
        next step is copied (numpy's copy, which lets the GIL go and starts no OpenMP
        threads, whose spinning slowed the Python beside them 30x here). Returns once
        every put ended and the store flushed: the staging pages are free again."""
        futs: list[Future[list[bool]]] = []
        try:
            for a in range(0, len(items), _SET_STEP):
                step = items[a : a + _SET_STEP]
                for j, _, _ in step:
                    _copy_into(staging[j], srcs[j])
                futs.append(self.st.submit(self._put_all([(n, o) for _, n, o in step])))
        finally:
            # Every put that started ends before the staging pages are reused.
            done = [f.result(_TIMEOUT_S) for f in futs]
        self.st.call(
            self.store.flush(), _TIMEOUT_S
        )  # written through: SGLang may reuse the host pages now
        return [ok for d in done for ok in d]

    async def _held_each(self, names: list[str]) -> list[bool]:
        await self.store.sync()
        out = [self.store.has_object(n) for n in names]
        if self.store.shared and not all(out):
            asks = [self.store.contains_object(n) for n, h in zip(names, out, strict=True) if not h]
            found = iter(await asyncio.gather(*asks))
            out = [h or bool(next(found)) for h in out]
        return out

    async def _put_all(self, items: list[tuple[str, Any]]) -> list[bool]:
        got = await asyncio.gather(
            *(self.store.put_object(n, s, self_checked=True) for n, s in items),
            return_exceptions=True,
        )
        return [r is True for r in got]

    # ------------------------------------------------------------------ legacy calls

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        got = self.batch_get([key], [target_location])
        return got[0] if isinstance(got, list) else None

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """SGLang's non-zero-copy path: each page into its flat page buffer (the host
        layout's page order, ``get_dummy_flat_data_page``); None from the first page
        that cannot be read."""
        out: list[torch.Tensor | None] = [None] * len(keys)
        if self.disabled or not keys or target_locations is None:
            return out
        assert self.codec is not None
        try:
            dests = [flat_page_view(t, self.layout, self.codec) for t in target_locations]
        except PageLayoutError as e:
            log.error("HurrayHiCacheStorage: batch_get: %s", e)
            return out
        with self._get_lock:
            n = self._read_pages(keys, dests)
            for i in range(n):
                out[i] = target_locations[i]
        return out

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """SGLang's non-zero-copy path: flat pages (``get_data_page(flat=True)``, the host
        layout's page order)."""
        if self.disabled or not keys or values is None:
            return False
        assert self.codec is not None
        try:
            srcs = [flat_page_view(v, self.layout, self.codec) for v in values]
        except PageLayoutError as e:
            log.error("HurrayHiCacheStorage: batch_set: %s", e)
            return False
        return all(self._write_pages(keys, srcs))

    # ------------------------------------------------------------------ the rest

    def _note(self, into: list[tuple[int, float]], pages: int, seconds: float) -> None:
        if pages and self.codec is not None and seconds > 0:
            into.append((pages, pages * self.codec.page_bytes / seconds / 1e9))

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` of the calls since the last ``get_stats``: pages
        per prefetch and backup, and their GB/s."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m = StorageMetrics()
        for pages, gbs in self._prefetch:
            m.prefetch_pgs.append(pages)
            m.prefetch_bandwidth.append(gbs)
        for pages, gbs in self._backup:
            m.backup_pgs.append(pages)
            m.backup_bandwidth.append(gbs)
        self._prefetch, self._backup = [], []
        return m

    def close(self) -> None:
        """Write what is pending, then close the store."""
        self.st.close()
        if self._ahead is not None:
            self._ahead.close()


def cpu_host_pool(
    layout: str,
    dtype: torch.dtype,
    page_size: int,
    pages: int,
    *,
    layers: int,
    heads: int,
    head_dim: int,
) -> Any:
    """SGLang's own ``MHATokenToKVPoolHost`` of ``pages`` pages on CPU tensors (device
    buffers too), as SGLang's HiCache builds it, for checks and benchmarks on a machine
    without a GPU (SGLang's server needs CUDA)."""
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    tokens = pages * page_size
    k = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(layers))

    def ptrs(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD
        ),
        page_size=page_size,
        head_num=heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info,
        1.0,
        0,
        page_size,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=tokens,
        start_layer=0,
        end_layer=layers,
        host_token_capacity=tokens,
    )


_ON_THE_LOOP = "not read on the calling thread"  # a page ``_read_on_the_loop`` reads


class _ReadAhead:
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


def _copy_into(dest: torch.Tensor, src: torch.Tensor) -> None:
    """``dest.copy_(src)`` (same shape and dtype) by numpy: on this thread alone, the
    GIL let go."""
    np.copyto(dest.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())


def _copy_page(codec: PageCodec, obj: torch.Tensor, dest: torch.Tensor) -> None:
    """The pools of the page object in ``obj`` into ``dest``, a ``[2, layers, page_size,
    heads, head_dim]`` view of the host pool (numpy's copy: it lets the GIL go, and
    runs on the calling thread alone, where torch's would start its OpenMP threads)."""
    d = dest.view(torch.uint8)  # [2, layers, page_size, heads, head_dim * itemsize]
    for part, r, li in codec.page_of(obj):
        np.copyto((d if r < 0 else d[r, li]).numpy(), part.numpy())


def _unsupported(pool: Any) -> str:
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
