"""hurray_store as an LMCache 0.5.6 storage plugin (the only module that
imports ``lmcache``).

LMCache hands over chunks, not token ids: a ``MemoryObj`` in ``KV_2LTD`` format,
``[2, num_layers, num_tokens, heads * head_dim]``, under a ``CacheEngineKey``. The plugin
stores each chunk through the store's object level:

- one block-paged layer object per layer: one sequence, the chunk's tokens cut into
  pages of ``page_size``, the last page zero-padded;
- then a small chunk record, the commit point. It holds the layout fingerprint, the
  token count, and each layer object's key, size and xxh3-64 checksum.

A get reads the record first. It checks the fingerprint, reads each layer object,
checks its checksum, and decodes it with the validating codec. Any mismatch is a miss,
never wrong data.

The object key derives from the ``CacheEngineKey`` (model, world size, worker, chunk
hash, dtype) and from a layout fingerprint of LMCache's metadata (layers, kv heads, head
size, chunk size, dtype, MLA, page size). A layout change is then a different key: a
miss, never scrambled KV.

Plugin settings: ``extra_config["storage_plugin.<name>.config"]`` (a hurray_store YAML,
required) and ``...page_size`` (default 16). See docs/lmcache.md.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from hurray_store.adapters.lmcache.records import (
    ChunkLayer,
    layout_fingerprint,
    pack_chunk_record,
    parse_chunk_record,
)
from hurray_store.adapters.store_thread import StoreThread, pin_objects
from hurray_store.errors import FormatError
from hurray_store.format import LayerKV, checksum, encode_layer_buffers
from hurray_store.store import TieredStore
from hurray_store.tiers import host_view

log = logging.getLogger(__name__)
T = TypeVar("T")


class HurrayStoragePlugin(StoragePluginInterface):
    """LMCache storage plugin over a hurray_store TieredStore (its own event loop thread)."""

    def __init__(
        self,
        dst_device: str = "cpu",
        config: Any = None,
        metadata: Any = None,
        local_cpu_backend: Any = None,
        loop: Any = None,
    ) -> None:
        super().__init__(
            dst_device=dst_device,
            config=config,
            metadata=metadata,
            local_cpu_backend=local_cpu_backend,
            loop=loop,
        )
        extra = dict(getattr(config, "extra_config", None) or {})
        name = self._plugin_name(extra)
        path = extra.get(f"storage_plugin.{name}.config")
        if not path:
            raise ValueError(
                f"storage plugin {name!r}: set "
                f'extra_config["storage_plugin.{name}.config"] to a hurray_store YAML'
            )
        self.page_size = int(extra.get(f"storage_plugin.{name}.page_size", 16))
        num_layers, _, self.chunk_size, self.num_kv_heads, self.head_size = (
            int(x) for x in metadata.kv_shape
        )
        self.num_layers = num_layers
        self.dtype = metadata.kv_dtype
        self.fingerprint = layout_fingerprint(
            num_layers,
            self.num_kv_heads,
            self.head_size,
            self.chunk_size,
            self.dtype,
            bool(getattr(metadata, "use_mla", False)),
            self.page_size,
        )
        self._runner = StoreThread(path, "hurray-store-plugin")
        self.store: TieredStore = self._runner.store
        self._pending: dict[CacheEngineKey, Future[None]] = {}
        self._lock = threading.Lock()
        self._pinned: set[CacheEngineKey] = set()
        self._closed = False

    @staticmethod
    def _plugin_name(extra: dict[str, Any]) -> str:
        for k, v in extra.items():
            if (
                k.startswith("storage_plugin.")
                and k.endswith(".class_name")
                and v == HurrayStoragePlugin.__name__
            ):
                return k[len("storage_plugin.") : -len(".class_name")]
        return "hurray"

    def __str__(self) -> str:
        return "HurrayStoragePlugin"

    # ------------------------------------------------------------------ plumbing

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._runner.call(coro)

    def _base(self, key: CacheEngineKey) -> str:
        dtype = str(key.dtype).removeprefix("torch.")
        who = f"{key.model_name}@{key.world_size}@{key.worker_id}"
        return f"lmc/{self.fingerprint[:8].hex()}/{who}@{key.chunk_hash & (2**64 - 1):016x}@{dtype}"

    def _record_key(self, key: CacheEngineKey) -> str:
        return self._base(key) + "/r"

    def _layer_key(self, key: CacheEngineKey, li: int) -> str:
        return f"{self._base(key)}/{li}"

    # ------------------------------------------------------------------ put

    def _encode(self, obj: MemoryObj) -> tuple[int, list[Any]]:
        t = obj.tensor
        assert t is not None
        if (
            t.dim() != 4
            or t.shape[0] != 2
            or t.shape[1] != self.num_layers
            or t.shape[3] != self.num_kv_heads * self.head_size
        ):
            raise ValueError(
                f"expected a KV_2LTD chunk [2, {self.num_layers}, tokens, "
                f"{self.num_kv_heads * self.head_size}], got {tuple(t.shape)}"
            )
        n = int(t.shape[2])
        P = self.page_size
        pages = -(-n // P)
        layers = []
        for li in range(self.num_layers):
            kv = torch.zeros((2, pages * P, self.num_kv_heads, self.head_size), dtype=t.dtype)
            kv[:, :n] = t[:, li].reshape(2, n, self.num_kv_heads, self.head_size)
            kv = kv.view(2, pages, P, self.num_kv_heads, self.head_size)
            layers.append(
                encode_layer_buffers(
                    LayerKV(li, kv[0], kv[1], torch.arange(pages), torch.tensor([0, pages]))
                )
            )
        return n, layers

    def _token_bytes(self, n: int) -> int:
        return n * self.num_kv_heads * self.head_size * self.dtype.itemsize

    async def _put(self, key: CacheEngineKey, n: int, layers: list[Any]) -> None:
        nb = self._token_bytes(n)
        views = [[memoryview(b).cast("B") for b in enc.buffers] for enc in layers]
        entries = []
        for enc, v in zip(layers, views, strict=True):
            # Buffers: key descriptor, key pool, ..., value descriptor, value pool, ...
            kpool, vpool = v[1], v[5]
            entries.append(
                ChunkLayer(
                    enc.nbytes,
                    checksum(*v),
                    enc.key_pool_offset,
                    enc.value_pool_offset,
                    checksum(kpool[:nb]),
                    checksum(vpool[:nb]),
                )
            )
        # One group per chunk: the layers together (one Redis pipeline, or a thread
        # each on disk), then the record, the commit point; evicted together.
        items: list[tuple[str, Any]] = [(self._layer_key(key, li), v) for li, v in enumerate(views)]
        items.append((self._record_key(key), pack_chunk_record(self.fingerprint, n, entries)))
        await self.store.put_objects(items)

    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[CacheEngineKey], None] | None = None,
    ) -> None:
        for key, obj in zip(keys, objs, strict=True):
            if self.contains(key) or self.exists_in_put_tasks(key):
                continue
            obj.ref_count_up()  # LMCache drops its reference once we return
            try:
                n, layers = self._encode(obj)
            except Exception:
                obj.ref_count_down()
                raise
            fut = self._runner.submit(self._put(key, n, layers))
            with self._lock:
                self._pending[key] = fut

            def done(f: Future[None], key: CacheEngineKey = key, obj: MemoryObj = obj) -> None:
                with self._lock:
                    self._pending.pop(key, None)
                obj.ref_count_down()
                if f.exception() is not None:
                    log.warning("hurray plugin: put of %s failed: %s", key, f.exception())
                elif on_complete_callback is not None:
                    try:
                        on_complete_callback(key)
                    except Exception as e:  # LMCache's contract: callback errors are logged
                        log.warning("hurray plugin: completion callback for %s raised %s", key, e)

            fut.add_done_callback(done)
        return None

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return key in self._pending

    def flush(self) -> None:
        """Wait for every submitted put (tests, shutdown)."""
        with self._lock:
            futs = list(self._pending.values())
        for f in futs:
            f.result()
        self._call(self.store.flush())

    # ------------------------------------------------------------------ get

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        rk = self._record_key(key)
        # The books first (no trip to the store's loop); a cache server shared with
        # other engines is asked when they say no, as LMCache's remote backend asks.
        ok = self.store.has_object(rk) or (
            self.store.shared and bool(self._call(self.store.contains_object(rk)))
        )
        if ok and pin:
            self.pin(key)
        return ok

    async def _get(self, key: CacheEngineKey) -> MemoryObj | None:
        raw = await self.store.get_object(self._record_key(key))
        if raw is None:
            return None
        rec = host_view(raw)
        try:
            n, layers = parse_chunk_record(
                rec, self.fingerprint, self.num_layers, self.chunk_size, self._token_bytes
            )
            nl = len(layers)
            nb = self._token_bytes(n)
            out = self.local_cpu_backend.allocate(
                torch.Size([2, nl, n, self.num_kv_heads * self.head_size]),
                self.dtype,
                MemoryFormat.KV_2LTD,
            )
            if out is None:
                log.warning("hurray plugin: LMCache's CPU buffer is full; %s is a miss", key)
                return None
            try:
                # The chunk's tokens of each pool, read straight into LMCache's buffer
                # (pages are stored in order, so they are one byte range per pool).
                dst = [
                    (host_view(out.tensor[0, li]), host_view(out.tensor[1, li])) for li in range(nl)
                ]
                oks = await asyncio.gather(
                    *(
                        self.store.read_object_into(
                            self._layer_key(key, li),
                            [(lay.key_pool_offset, nb), (lay.value_pool_offset, nb)],
                            list(dst[li]),
                        )
                        for li, lay in enumerate(layers)
                    )
                )
                for li, ok in enumerate(oks):
                    if not ok:
                        raise FormatError(f"layer {li}: missing")
                    if (
                        checksum(dst[li][0]) != layers[li].key_tokens_checksum
                        or checksum(dst[li][1]) != layers[li].value_tokens_checksum
                    ):
                        raise FormatError(f"layer {li}: its bytes differ from the record")
            except BaseException:
                out.ref_count_down()
                raise
            return out
        except FormatError as e:
            log.warning("hurray plugin: %s failed verification (%s); a miss", key, e)
            await self.store.delete_object(self._record_key(key))
            return None

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        return self._call(self._get(key))

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        n = 0
        for key in keys:
            if not await asyncio.wrap_future(
                self._runner.submit(self.store.contains_object(self._record_key(key)))
            ):
                break
            if pin:
                self.pin(key)
            n += 1
        return n

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[CacheEngineKey], transfer_spec: Any = None
    ) -> list[MemoryObj]:
        out = []
        for key in keys:
            obj = await asyncio.wrap_future(self._runner.submit(self._get(key)))
            if obj is None:
                break
            out.append(obj)
        return out

    # ------------------------------------------------------------------ the rest

    def pin(self, key: CacheEngineKey) -> bool:
        if not self._call(self.store.contains_object(self._record_key(key))):
            return False
        self._pinned.add(key)
        self._call(
            pin_objects(
                self.store,
                [
                    self._record_key(key),
                    *(self._layer_key(key, li) for li in range(self.num_layers)),
                ],
                True,
            )
        )
        return True

    def unpin(self, key: CacheEngineKey) -> bool:
        if key not in self._pinned:
            return False
        self._pinned.discard(key)
        self._call(
            pin_objects(
                self.store,
                [
                    self._record_key(key),
                    *(self._layer_key(key, li) for li in range(self.num_layers)),
                ],
                False,
            )
        )
        return True

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        if key in self._pinned and not force:
            return False
        had = self._call(self.store.contains_object(self._record_key(key)))

        async def drop() -> None:
            # The record's group is the whole chunk. A chunk stored before groups kept
            # their member list is a group per object after a restart: its layers too.
            await self.store.delete_object(self._record_key(key))
            for li in range(self.num_layers):
                await self.store.delete_object(self._layer_key(key, li))

        self._call(drop())
        self._pinned.discard(key)
        return bool(had)

    def get_allocator_backend(self) -> Any:
        return self.local_cpu_backend

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        finally:
            self._runner.close()
