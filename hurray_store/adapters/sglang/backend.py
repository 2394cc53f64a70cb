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
)

from hurray_store.adapters.sglang.page_io import (
    PageIO,
    Piece,
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
            "store_errors": 0,
        }
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
        self, n: int, host_indices: torch.Tensor, call: str
    ) -> list[torch.Tensor] | None:
        """The host pool's ``[2, layers, page_size, heads, head_dim]`` view of each of
        ``n`` pages (page ``i`` starts at ``host_indices[i * page_size]``); None, logged,
        when the indices do not name ``n`` pages of the pool."""
        assert self.codec is not None and self.io is not None
        P = self.codec.page_size
        try:
            if host_indices.dtype.is_floating_point or host_indices.dtype == torch.bool:
                raise PageLayoutError(f"host indices of {host_indices.dtype}, not integers")
            if host_indices.numel() != n * P:
                raise PageLayoutError(f"{host_indices.numel()} host indices for {n} pages of {P}")
            pages = host_indices.reshape(n, P).to(torch.int64)
            if n and not torch.equal(pages - pages[:, :1], torch.arange(P).expand(n, P)):
                raise PageLayoutError("a page's host indices are not consecutive")
            starts = [int(i) for i in pages[:, 0].tolist()]
            kv = self.mem_pool_host.kv_buffer
            return [page_view(kv, self.layout, P, s, self.mla) for s in starts]
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
