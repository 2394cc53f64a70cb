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

Every page is one object (``adapters/sglang/pages.py``); its name is SGLang's page key after a
prefix that hashes everything else the page's bytes depend on: the model's identity
from its weights and config (``identity.model_identity``, the rule vLLM's connector and
the transformers adapter follow), the salt, the KV geometry (layers, head size, page
size, dtype), the model's KV heads the rank holds (never the TP rank: another TP size
reads them, assembled from whatever ranges are stored, ``PageIO.sources``; an MLA
model's latent is every rank's, ``heads: latent``), the PP and attention-CP ranks and,
for ``page_first``, the object's token-major form (``pages.TOKEN_MAJOR``). Pages are shared between
instances of the per-layer layouts (``layer_first``, ``page_first_direct``,
``page_head``), whichever of them wrote it; a ``page_first`` instance's pages are named
apart from theirs (a miss across, never wrong data).

What SGLang relies on: ``batch_exists`` counts the leading run the ledger (or a shared
tier) hold; a get checks every page in a staging buffer before it copies it into the
host pool, and a page that is missing, corrupt or another page's object is False, with
every page after it; a failed check drops the object. The store down, slow or full is
misses and a warning, never an exception into SGLang's threads. A set returns once its
pages are written through every tier (SGLang may reuse the host pages right after).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from hurray_store.adapters.sglang.page_io import (
    PageIO,
    Piece,
    page_starts,
    unsupported_mla_pool,
    unsupported_pool,
)
from hurray_store.adapters.sglang.pages import (
    TOKEN_MAJOR,
    PageCodec,
    PageLayoutError,
    flat_page_view,
    page_view,
)
from hurray_store.adapters.sglang.states import StateIO
from hurray_store.engine import EnginePort
from hurray_store.engine.extra import check_keys
from hurray_store.engine.identity import WeightsIdentity
from hurray_store.engine.portable import divisors, tiles
from hurray_store.spec import rank_heads
from hurray_store.throttle import Every

log = logging.getLogger(__name__)
_WARN_EVERY_S = 10.0  # a failing store is logged at most this often
# What the storage extra_config takes: SGLang's keys for a backend it loads by name, and
# ours (docs/sglang.md).
EXTRA_KEYS = (
    "backend_name",
    "module_path",
    "class_name",
    "interface_v1",
    "extra_backend_tag",
    "config",
    "model_path",
    "salt",
    "total_kv_heads",
)


class HurrayHiCacheStorage(HiCacheStorage):
    """SGLang's L3 HiCache storage on a hurray_store TieredStore (see the module doc)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        check_keys(extra, EXTRA_KEYS, "HurrayHiCacheStorage", "the storage extra_config")
        # An MLA model's latent is the same on every TP rank: one rank writes it (SGLang
        # backs up from its storage writer only) and every rank reads the same pages.
        self.mla = bool(storage_config.is_mla_model)
        if storage_config.should_split_heads:
            raise ValueError(
                "HurrayHiCacheStorage: tp_lcm_size (pages split by heads across "
                "heterogeneous TP) is not supported"
            )
        self.storage_config = storage_config
        # The model's identity, kept up with its weights: files replaced in the folder,
        # or clear() (docs/sglang.md, "When the weights change").
        self.weights = WeightsIdentity(
            extra.get("model_path"), storage_config.model_name, "HurrayHiCacheStorage"
        )
        self.identity = self.weights.value
        self.port = EnginePort(extra.get("config"), name="hurray-sglang")
        self.store = self.port.store
        self.salt = str(extra.get("salt", "")) or self.store.config.salt
        c = storage_config
        # Pages are named by the model's KV heads they hold, not by the TP rank
        # (``register_mem_pool_host`` learns them); pipeline and context ranks stay.
        self.ranks = f"pp{c.pp_rank}/{c.pp_size}.cp{c.attn_cp_rank}/{c.attn_cp_size}"
        self.total_heads = _total_kv_heads(extra)
        self.heads = (0, 0)
        self.codec: PageCodec | None = None
        self.layout = ""
        self.disabled = "no host pool registered"
        self.prefix = ""  # what a page's name and fingerprint hash besides its key
        self.io: PageIO | None = None  # once a host pool is registered
        self._get_lock = threading.Lock()  # SGLang's prefetch and backup threads
        self._warn = Every(_WARN_EVERY_S)
        self.counts = {
            "pages_read": 0,
            "pages_written": 0,
            "pages_deduplicated": 0,  # a set of pages the store already held
            "pages_rejected": 0,  # read, but not this page's object (dropped)
            "pages_assembled": 0,  # read from the pages of other head ranges
            "states_read": 0,  # state pages (a Mamba pool's, through the v2 calls)
            "states_written": 0,
            "store_errors": 0,
        }
        # The v2 calls' pools besides the KV pool (SGLang's hybrid models: a sliding
        # window's KV, Mamba state), each by SGLang's pool name: KV pages as the KV
        # pool's are, state pages as state objects.
        self.side_pools: dict[str, Any] = {}
        self.side: dict[str, PageIO | StateIO] = {}
        # SGLang's StorageMetrics, per call since the last get_stats
        self._prefetch: list[tuple[int, float]] = []  # (pages, GB/s)
        self._backup: list[tuple[int, float]] = []

    # ------------------------------------------------------------------ the pool

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pool = mem_pool_host
        why = unsupported_mla_pool(pool) if self.mla else unsupported_pool(pool)
        if why:
            self.disabled = why
            log.warning("HurrayHiCacheStorage: every page a miss: %s", why)
            return
        self.layout = str(pool.layout)
        self.codec = PageCodec(
            int(pool.layer_num),
            1 if self.mla else int(pool.head_num),
            int(pool.kv_cache_dim) if self.mla else int(pool.head_dim),
            int(pool.page_size),
            pool.dtype,
            token_major=self.layout in TOKEN_MAJOR,
            fused=self.mla,
        )
        why = self._learn_heads()
        if why:
            self.disabled = why
            log.warning("HurrayHiCacheStorage: every page a miss: %s", why)
            return
        self.prefix = self._prefix()
        self.io = PageIO(self.port, self.codec, self.prefix, self.counts, self._failed)
        self.io.set_prefix(self.prefix, self._sources())
        self.disabled = ""
        model = str(self.storage_config.model_name or self.identity)
        self.port.publish_events(self.io.page_key, model=model, block_size=self.codec.page_size)
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

    def _learn_heads(self) -> str:
        """The model's KV heads this rank holds (why not known: "" when they are). An
        MLA pool's latent is every rank's: no head range."""
        if self.mla:
            return ""
        assert self.codec is not None
        c = self.storage_config
        total = self.total_heads or self.codec.heads * c.tp_size
        try:
            start, n = rank_heads(total, c.tp_rank, c.tp_size)
        except ValueError as e:
            return f"{e}: set total_kv_heads in the extra_config"
        if n != self.codec.heads:
            return (
                f"rank {c.tp_rank} of {c.tp_size} holds {self.codec.heads} KV heads, not "
                f"{n} of the model's {total}: set total_kv_heads in the extra_config"
            )
        self.total_heads, self.heads = total, (start, start + n)
        return ""

    def _prefix(self, heads: tuple[int, int] | None = None) -> str:
        """What a page's name and fingerprint hash besides its key: the model's identity
        now, the salt, the pool's geometry, the model's KV heads it holds (``heads``:
        another range's), the pipeline and context ranks."""
        assert self.codec is not None
        a, b = heads or self.heads
        fields = {
            "model": self.identity,
            "salt": self.salt,
            "layers": self.codec.layers,
            "heads": "latent" if self.mla else f"{a}-{b}/{self.total_heads}",
            "head_dim": self.codec.head_dim,
            "page_size": self.codec.page_size,
            "dtype": str(self.codec.dtype),
            "ranks": self.ranks,
        }
        if self.codec.token_major:  # the per-layer form's names are those stored before
            fields["pages"] = "token_major"
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))

    def _sources(self) -> list[list[Piece]]:
        """The other head ranges this pool's pages can be assembled from: for every
        width that divides the model's heads, the stored ranges of that width (a wider
        one sliced, or the narrower that tile this rank's)."""
        assert self.codec is not None
        out: list[list[Piece]] = []
        if self.mla:  # one latent for every rank: nothing else to assemble it from
            return out
        own = self.heads[1] - self.heads[0]
        for w in divisors(self.total_heads):
            got = tiles(self.heads, self.total_heads, w) if w != own else None
            if got is None:
                continue
            codec = PageCodec(
                self.codec.layers,
                w,
                self.codec.head_dim,
                self.codec.page_size,
                self.codec.dtype,
                token_major=self.codec.token_major,
            )
            out.append([Piece(self._prefix((s, s + w)), codec, t, p) for s, t, p in got])
        return out

    def _off(self) -> str:
        """Why every call is a miss ("" when none); first, the identity is kept up with
        the weights: when it changed, pages are named under the new one from now on."""
        if not self.disabled and (now := self.weights.current()) != self.identity:
            assert self.io is not None
            self.identity = now
            self.prefix = self._prefix()
            self.io.set_prefix(self.prefix, self._sources())
            for name, io in self.side.items():
                io.set_prefix(self._side_prefix(name, self.side_pools[name]))
        return self.disabled

    def clear(self) -> None:
        """SGLang's ``clear_hicache_storage`` (and what an operator calls after a weight
        sync in memory): the pages stored so far are no longer found. They are not
        deleted (another instance on the same weights may use them; eviction takes
        them): this instance keys by a new generation of its identity, or by the new
        weights' identity when the model folder's files changed."""
        self.weights.reset()
        self._off()

    def name_of(self, key: str) -> str:
        """The store's object name of SGLang's page ``key``."""
        assert self.io is not None, "no host pool registered"
        return self.io.name_of(key)

    def _page_views(
        self, n: int, host_indices: torch.Tensor, call: str, pool: Any = None
    ) -> list[torch.Tensor] | None:
        """The host pool's ``[2, layers, page_size, heads, head_dim]`` view of each of
        ``n`` pages (page ``i`` starts at ``host_indices[i * page_size]``); None, logged,
        when the indices do not name ``n`` pages of the pool."""
        pool = self.mem_pool_host if pool is None else pool
        P = int(pool.page_size)
        try:
            starts = page_starts(host_indices, n, P)
            mla = self.mla and pool is self.mem_pool_host
            return [page_view(pool.kv_buffer, str(pool.layout), P, s, mla) for s in starts]
        except PageLayoutError as e:
            log.error("HurrayHiCacheStorage: %s: %s", call, e)
            return None

    @staticmethod
    def _distinct(keys: list[str], call: str) -> bool:
        """A set names each page once (which of two pages would the key hold?)."""
        if len(set(keys)) == len(keys):
            return True
        log.error("HurrayHiCacheStorage: %s: a key named twice in one call; nothing set", call)
        return False

    def _failed(self, what: str, e: BaseException) -> None:
        self.counts["store_errors"] += 1
        if self._warn.due():
            log.warning("HurrayHiCacheStorage: %s failed, served as misses: %r", what, e)

    # ------------------------------------------------------------------ exists

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many of ``keys``, from the first, a get will find."""
        if self._off() or not keys:
            return 0
        try:
            assert self.io is not None
            return self.io.held(keys)
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
        if self._off() or not keys:
            return out
        assert self.codec is not None and self.io is not None
        t0 = time.perf_counter()
        dests = self._page_views(len(keys), host_indices, "batch_get_v1")
        if dests is None:
            return out
        with self._get_lock:
            n = self.io.read_pages(keys, dests)
            for i in range(n):
                out[i] = True
        self._note(self._prefetch, n, time.perf_counter() - t0)
        return out

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
        if self._off() or not keys or not self._distinct(keys, "batch_set_v1"):
            return out
        assert self.codec is not None and self.io is not None
        t0 = time.perf_counter()
        srcs = self._page_views(len(keys), host_indices, "batch_set_v1")
        if srcs is None:
            return out
        out = self.io.write_pages(keys, srcs)
        self._note(self._backup, sum(out), time.perf_counter() - t0)
        return out

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
        if self._off() or not keys or target_locations is None:
            return out
        assert self.codec is not None and self.io is not None
        try:
            dests = [flat_page_view(t, self.layout, self.codec) for t in target_locations]
        except PageLayoutError as e:
            log.error("HurrayHiCacheStorage: batch_get: %s", e)
            return out
        with self._get_lock:
            n = self.io.read_pages(keys, dests)
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
        if self._off() or not keys or values is None or not self._distinct(keys, "batch_set"):
            return False
        assert self.codec is not None and self.io is not None
        try:
            srcs = [flat_page_view(v, self.layout, self.codec) for v in values]
        except PageLayoutError as e:
            log.error("HurrayHiCacheStorage: batch_set: %s", e)
            return False
        return all(self.io.write_pages(keys, srcs))

    # ------------------------------------------------------------------ v2: hybrid pools

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A pool of SGLang's hybrid models beside the KV pool (``PoolName``: "swa",
        "mamba", ...): a KV pool of a sliding window's layers is paged as the KV pool
        is (its own names), any other pool's page is a state object. A pool this
        backend cannot read is a miss in every v2 call (said once)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name == str(PoolName.KV):
            return  # the KV pool: register_mem_pool_host's
        self.side_pools[name] = host_pool
        try:
            self.side[name] = self._side_io(name, host_pool)
        except Exception as e:  # noqa: BLE001 - the pool is a miss, SGLang goes on
            self.side.pop(name, None)
            log.warning(
                "HurrayHiCacheStorage: pool %s (%s): every page a miss: %s",
                name,
                type(host_pool).__name__,
                e,
            )
            return
        log.info(
            "HurrayHiCacheStorage: pool %s (%s) through the v2 calls",
            name,
            type(host_pool).__name__,
        )

    def _side_io(self, name: str, pool: Any) -> PageIO | StateIO:
        prefix = self._side_prefix(name, pool)
        if hasattr(pool, "head_num") and not unsupported_pool(pool):  # paged KV
            codec = PageCodec(
                int(pool.layer_num),
                int(pool.head_num),
                int(pool.head_dim),
                int(pool.page_size),
                pool.dtype,
                token_major=str(pool.layout) in TOKEN_MAJOR,
            )
            return PageIO(self.port, codec, prefix, self.counts, self._failed)
        if not hasattr(pool, "get_data_page") or not hasattr(pool, "set_from_flat_data_page"):
            raise ValueError("neither paged KV nor a pool of flat pages")
        return StateIO(self.port, pool, prefix, self.counts, self._failed)

    def _side_prefix(self, name: str, pool: Any) -> str:
        """What a hybrid pool's page names and fingerprints hash besides its key: the
        model, the salt, the pool's name and class and the geometry of its page (its
        tensors' shapes and dtypes), and the ranks (a state is the rank's own shard:
        named by the TP rank, not portable across TP sizes)."""
        c = self.storage_config
        shapes = [[str(t.dtype), list(t.shape[1:])] for t in _pool_tensors(pool)]
        fields = {
            "model": self.identity,
            "salt": self.salt,
            "pool": name,
            "class": type(pool).__name__,
            "layout": str(getattr(pool, "layout", "")),
            "page_size": int(getattr(pool, "page_size", 1) or 1),
            "tensors": shapes,
            "ranks": f"{self.ranks}.tp{c.tp_rank}/{c.tp_size}",
        }
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The longest prefix of ``keys`` a get restores in every pool: the KV pages
        from the first (``batch_exists``), and per other pool its hit policy: every
        page (``all_pages``) or the last ``len(transfer.keys)`` pages before the
        prefix's end (``trailing_pages``: a Mamba state, a window). A prefix whose KV
        is held but whose state is not counts as not held. What it counts is leased
        until the get."""
        kv = self.batch_exists(keys, extra_info)
        hits: dict[str, int] = {str(PoolName.KV): kv} if kv else {}
        ok = set(range(1, kv + 1))
        asks: list[tuple[StateIO | PageIO, int, bool]] = []
        for t in pool_transfers or []:
            if not ok:
                break
            io = self.side.get(str(t.name))
            if io is None:
                ok = set()
                break
            present = self._held_each([io.name_of(k) for k in keys[:kv]])
            policy = t.hit_policy
            if policy == PoolHitPolicy.ALL_PAGES:
                lead = next((i for i, h in enumerate(present) if not h), kv)
                mine = set(range(1, lead + 1))
                asks.append((io, 0, True))
            elif policy == PoolHitPolicy.TRAILING_PAGES:
                n = max(1, len(t.keys or ()))
                mine = {p for p in range(1, kv + 1) if all(present[max(0, p - n) : p])}
                asks.append((io, n, False))
            else:  # block groups (DeepSeek V4's compressed pools): not served
                mine = set()
            if mine:
                hits[str(t.name)] = max(mine)
            ok &= mine
        final = max(ok, default=0)
        for io, n, every in asks:  # pin what the get will read of each pool
            want = keys[:final] if every else keys[max(0, final - n) : final]
            if want:
                try:
                    self.port.lookup([io.name_of(k) for k in want], lease=True)
                except Exception as e:  # noqa: BLE001
                    self._failed("exists (v2)", e)
        return PoolTransferResult(final, hits, sorted(ok))

    def _held_each(self, names: list[str]) -> list[bool]:
        try:
            return self.port.held_each(names)
        except Exception as e:  # noqa: BLE001
            self._failed("exists (v2)", e)
            return [False] * len(names)

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Each transfer's pages into its pool at its ``host_indices``: per pool, True
        for each page read and checked, up to the first that is not (nothing is
        written into the slots of a page that is not)."""
        return {str(t.name): self._v2(t, write=False) for t in transfers}

    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Each transfer's pages at its ``host_indices`` stored under its keys (a page
        the store holds is not written again); returns once written through."""
        return {str(t.name): self._v2(t, write=True) for t in transfers}

    def _v2(self, t: PoolTransfer, write: bool) -> list[bool]:
        keys = list(t.keys or [])
        out = [False] * len(keys)
        call = "batch_set_v2" if write else "batch_get_v2"
        if self._off() or not keys:
            return out
        name = str(t.name)
        if name == str(PoolName.KV):
            if write:
                return self.batch_set_v1(keys, t.host_indices)
            return self.batch_get_v1(keys, t.host_indices)
        io = self.side.get(name)
        if io is None:
            if self._warn.due():
                log.warning("HurrayHiCacheStorage: %s: pool %s not registered: misses", call, name)
            return out
        if write and not self._distinct(keys, call):
            return out
        if isinstance(io, StateIO):
            try:
                slots = page_starts(t.host_indices, len(keys), io.page_size)
            except PageLayoutError as e:
                log.error("HurrayHiCacheStorage: %s: pool %s: %s", call, name, e)
                return out
            if write:
                return io.write(keys, slots)
            n = io.read(keys, slots)
        else:
            pool = self.side_pools[name]
            pages = self._page_views(len(keys), t.host_indices, call, pool)
            if pages is None:
                return out
            if write:
                return io.write_pages(keys, pages)
            with self._get_lock:
                n = io.read_pages(keys, pages)
        return [i < n for i in range(len(keys))]

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
        """Write what is pending, then close the store; every later call is a miss (or
        not stored) at once."""
        self.disabled = "closed"
        self.port.close()


def _pool_tensors(pool: Any) -> list[torch.Tensor]:
    """The host tensors a pool's page is made of, for its geometry: a Mamba pool's
    temporal and conv states (and side states), else its KV buffer."""
    if hasattr(pool, "temporal_buffer"):
        return [pool.temporal_buffer, *pool.conv_buffer, *getattr(pool, "slot_state_buffers", [])]
    kv = getattr(pool, "kv_buffer", None)
    return [kv] if isinstance(kv, torch.Tensor) else []


def _total_kv_heads(extra: dict[str, Any]) -> int:
    """The model's KV heads: the extra_config's ``total_kv_heads``, else the model
    folder's config.json, else 0 (the pool's heads times the TP size, exact whenever
    the TP size does not exceed the model's KV heads)."""
    if "total_kv_heads" in extra:
        n = extra["total_kv_heads"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"HurrayHiCacheStorage: total_kv_heads {n!r}: a positive int")
        return n
    path = extra.get("model_path")
    if path:
        try:
            with open(f"{path}/config.json") as f:
                cfg = json.load(f)
            cfg = cfg.get("text_config", cfg)
            n = cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
            return int(n) if n else 0
        except (OSError, ValueError, TypeError):
            return 0
    return 0


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
    return _on_cpu(MHATokenToKVPoolHost, info, page_size, layout, layers, tokens)


def cpu_mla_host_pool(
    layout: str, dtype: torch.dtype, page_size: int, pages: int, *, layers: int, dim: int
) -> Any:
    """SGLang's own ``MLATokenToKVPoolHost`` of ``pages`` pages on CPU tensors (its
    device buffers too: one ``[tokens, 1, dim]`` latent per layer), for checks on a
    machine without a GPU."""
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    tokens = pages * page_size
    bufs = tuple(torch.zeros(tokens, 1, dim, dtype=dtype) for _ in range(layers))
    rope = min(64, dim // 2)
    info = MLABufferInfo(
        buffers=bufs,
        data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
        layer_indices=tuple(range(layers)),
        device_layer_num=layers,
        page_size=page_size,
        kv_lora_rank=dim - rope,
        qk_rope_head_dim=rope,
        kv_cache_dim=dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return _on_cpu(
        MLATokenToKVPoolHost, info, page_size, layout, layers, tokens, target_layer_num=layers
    )


def cpu_mamba_host_pool(
    slots: int,
    *,
    layers: int,
    temporal: tuple[int, ...],
    conv: tuple[tuple[int, ...], ...],
    dtype: torch.dtype = torch.float32,
    layout: str = "page_first",
) -> Any:
    """SGLang's own ``MambaPoolHost`` of ``slots`` state slots on CPU tensors (its device
    buffers too: ``temporal`` and each ``conv`` state shape per layer and slot), as a
    hybrid model's HiCache builds it, for checks on a machine without a GPU."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(
        temporal=torch.zeros(layers, slots, *temporal, dtype=dtype),
        conv=tuple(torch.zeros(layers, slots, *c, dtype=dtype) for c in conv),
    )
    return MambaPoolHost(
        info, 1.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout=layout
    )


def _on_cpu(
    cls: Any, info: Any, page_size: int, layout: str, layers: int, tokens: int, **more: Any
) -> Any:
    """SGLang's host pool ``cls`` as HiCache builds one (host as large as the device
    pool, every layer), unpinned on the CPU."""
    return cls(
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
        **more,
    )
