"""hurray_store as an LMCache 0.5.6 storage plugin (layer L5; the only module that
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
import hashlib
import logging
import struct
import threading
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import torch
from lmcache.lmcache_native import Bitmap
from lmcache.utils import CacheEngineKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.platform import create_event_notifier
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from hurray_store.errors import FormatError
from hurray_store.format import LayerKV, checksum, encode_layer_buffers
from hurray_store.store import TieredStore, open_store
from hurray_store.tiers import host_view

log = logging.getLogger(__name__)
T = TypeVar("T")
_RECORD_MAGIC = b"HSLC"
_RECORD = struct.Struct("<4sH32sQI")  # magic, version, fingerprint, num_tokens, num_layers
# Per layer: object size, object checksum, key pool offset, value pool offset, and the
# checksums of the chunk's tokens in each pool (what a get reads); the key is derived.
_LAYER = struct.Struct("<QQQQQQ")
_RECORD_VERSION = 2


class StoreThread:
    """A store on an event loop of its own thread: LMCache calls from its threads;
    every store call (pins included) runs on this loop."""

    def __init__(self, config: Any, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self.store: TieredStore = self.call(open_store(config))

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the store's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        """Flush and close the store, then stop the loop."""
        try:
            self.call(self.store.close(), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)


async def _pin(store: TieredStore, keys: list[str], pin: bool) -> None:
    (store.pin_objects if pin else store.unpin_objects)(keys)


def layout_fingerprint(
    num_layers: int,
    num_kv_heads: int,
    head_size: int,
    chunk_size: int,
    dtype: torch.dtype,
    use_mla: bool,
    page_size: int,
) -> bytes:
    """32 bytes that change with anything that changes what a chunk's bytes mean."""
    fields = (num_layers, num_kv_heads, head_size, chunk_size, dtype, int(use_mla), page_size)
    text = "|".join(["hurray_store/lmcache-layout/v1", *map(str, fields)])
    return hashlib.sha256(text.encode()).digest()


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
        body = [_RECORD.pack(_RECORD_MAGIC, _RECORD_VERSION, self.fingerprint, n, len(layers))]
        views = [[memoryview(b).cast("B") for b in enc.buffers] for enc in layers]
        for enc, v in zip(layers, views, strict=True):
            # Buffers: key descriptor, key pool, ..., value descriptor, value pool, ...
            kpool, vpool = v[1], v[5]
            body.append(
                _LAYER.pack(
                    enc.nbytes,
                    checksum(*v),
                    enc.key_pool_offset,
                    enc.value_pool_offset,
                    checksum(kpool[:nb]),
                    checksum(vpool[:nb]),
                )
            )
        rec = b"".join(body)
        # One group per chunk: the layers together (one Redis pipeline, or a thread
        # each on disk), then the record, the commit point; evicted together.
        items: list[tuple[str, Any]] = [(self._layer_key(key, li), v) for li, v in enumerate(views)]
        items.append((self._record_key(key), [rec, struct.pack("<Q", checksum(rec))]))
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
            if len(rec) < _RECORD.size + 8:
                raise FormatError(f"chunk record of {len(rec)} bytes is shorter than its header")
            (stored_sum,) = struct.unpack_from("<Q", rec, len(rec) - 8)
            if checksum(rec[:-8]) != stored_sum:
                raise FormatError("chunk record: checksum differs")
            magic, version, fp, n, nl = _RECORD.unpack_from(rec)
            if magic != _RECORD_MAGIC or version != _RECORD_VERSION:
                raise FormatError(f"chunk record: magic {bytes(magic)!r} version {version}")
            if fp != self.fingerprint or nl != self.num_layers or not 0 < n <= self.chunk_size:
                raise FormatError("chunk record: another layout")
            if len(rec) != _RECORD.size + nl * _LAYER.size + 8:
                raise FormatError("chunk record: wrong length")
            nb = self._token_bytes(n)
            layers = [_LAYER.unpack_from(rec, _RECORD.size + li * _LAYER.size) for li in range(nl)]
            for li, (size, _, kpo, vpo, _, _) in enumerate(layers):
                if kpo + nb > size or vpo + nb > size:
                    raise FormatError(f"layer {li}: pool offsets outside the object")
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
                            self._layer_key(key, li), [(kpo, nb), (vpo, nb)], list(dst[li])
                        )
                        for li, (_, _, kpo, vpo, _, _) in enumerate(layers)
                    )
                )
                for li, ok in enumerate(oks):
                    if not ok:
                        raise FormatError(f"layer {li}: missing")
                    if (
                        checksum(dst[li][0]) != layers[li][4]
                        or checksum(dst[li][1]) != layers[li][5]
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
            _pin(
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
            _pin(
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


# ---------------------------------------------------------------------- L2 adapter
#
# ``lmcache server`` (the multiprocess mode) moves objects between its L1 memory and L2
# adapters through non-blocking submit/query calls signalled on three eventfds. The
# adapter below keeps each object in hurray_store's object level: the object's bytes,
# then a record (the commit point) with its size and xxh3-64 checksum. A load checks
# both against the caller's buffer before it copies; anything else is a 0 in the
# result bitmap, never wrong bytes.

_L2_RECORD = struct.Struct("<4sHQQ")  # magic "HSL2", version, size, checksum


class HurrayL2AdapterConfig(L2AdapterConfigBase):
    """Config of HurrayL2Adapter.

    - ``config`` (str, required): path of a hurray_store YAML (its tiers).
    - ``max_capacity_gb`` (float, optional): the capacity reported to LMCache for its
      global eviction; 0 (default) leaves eviction to hurray_store's own budgets.
    """

    def __init__(self, config: str, max_capacity_gb: float = 0.0) -> None:
        self.config = config
        self.max_capacity_gb = max_capacity_gb

    @classmethod
    def from_dict(cls, d: dict) -> HurrayL2AdapterConfig:
        path = d.get("config")
        if not isinstance(path, str) or not path:
            raise ValueError("config must be the path of a hurray_store YAML")
        cap = d.get("max_capacity_gb", 0.0)
        if not isinstance(cap, int | float) or isinstance(cap, bool) or cap < 0:
            raise ValueError("max_capacity_gb must be a number >= 0")
        return cls(path, float(cap))

    @classmethod
    def help(cls) -> str:
        return (
            "hurray_store L2 adapter config fields:\n"
            "- config (str): path of a hurray_store YAML (required)\n"
            "- max_capacity_gb (float): capacity reported to LMCache (optional, default 0)"
        )


class HurrayL2Adapter(L2AdapterInterface):
    """LMCache L2 adapter over a hurray_store TieredStore (its own event loop thread)."""

    def __init__(self, config: HurrayL2AdapterConfig | dict, l1_memory_desc: Any = None) -> None:
        cfg = (
            config
            if isinstance(config, HurrayL2AdapterConfig)
            else HurrayL2AdapterConfig.from_dict(config)
        )
        super().__init__(max_capacity_bytes=int(cfg.max_capacity_gb * (1 << 30)))
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._lock = threading.Lock()
        self._next = 0
        self._stored: dict[L2TaskId, L2StoreResult] = {}
        self._looked: dict[L2TaskId, Bitmap] = {}
        self._loaded: dict[L2TaskId, Bitmap] = {}
        self._locks: dict[str, int] = {}
        self._runner = StoreThread(cfg.config, "hurray-store-l2")
        self.store: TieredStore = self._runner.store

    # ------------------------------------------------------------------ plumbing

    @staticmethod
    def _key(key: Any) -> str:
        salt = getattr(key, "cache_salt", "")
        group = getattr(key, "object_group_id", 0)
        return f"l2/{key.model_name}@{key.kv_rank}@{group}@{bytes(key.chunk_hash).hex()}@{salt}"

    def _task(self) -> L2TaskId:
        with self._lock:
            self._next += 1
            return self._next

    def _submit(self, coro: Coroutine[Any, Any, None]) -> None:
        self._runner.submit(coro)

    def get_store_event_fd(self) -> int:
        return int(self._store_efd.fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._lookup_efd.fileno())

    def get_load_event_fd(self) -> int:
        return int(self._load_efd.fileno())

    # ------------------------------------------------------------------ store

    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> L2TaskId:
        tid = self._task()
        # Copy now: the caller owns the buffers and may reuse them once we return.
        payloads = [bytes(memoryview(o.byte_array).cast("B")) for o in objects]
        self._submit(self._store(tid, list(keys), payloads))
        return tid

    async def _store(self, tid: L2TaskId, keys: list[Any], payloads: list[bytes]) -> None:
        ok, total = True, 0
        stored_keys, sizes = [], []
        try:
            for key, data in zip(keys, payloads, strict=True):
                k = self._key(key)
                if await self.store.contains_object(k + "/r"):
                    continue
                rec = _L2_RECORD.pack(b"HSL2", 1, len(data), checksum(data))
                # One group, the record last: never a record without its object.
                if not await self.store.put_objects([(k, [data]), (k + "/r", [rec])]):
                    ok = False
                    continue
                total += len(data)
                stored_keys.append(key)
                sizes.append(len(data))
        except Exception as e:
            log.warning("hurray L2 adapter: store task %d failed: %s", tid, e)
            ok = False
        with self._lock:
            self._stored[tid] = L2StoreResult(ok, total)
        if stored_keys:
            self._notify_keys_stored(stored_keys, sizes)
        self._store_efd.notify()

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            out, self._stored = self._stored, {}
        return out

    # ------------------------------------------------------------------ lookup and lock

    def submit_lookup_and_lock_task(
        self, keys: list[Any], group_layout_descs: Any = None
    ) -> L2TaskId:
        tid = self._task()
        self._submit(self._lookup(tid, list(keys)))
        return tid

    async def _lookup(self, tid: L2TaskId, keys: list[Any]) -> None:
        bitmap = Bitmap(len(keys))
        for i, key in enumerate(keys):
            k = self._key(key)
            if await self.store.contains_object(k + "/r"):
                bitmap.set(i)
                self._locks[k] = self._locks.get(k, 0) + 1
                self.store.pin_objects([k, k + "/r"])
        with self._lock:
            self._looked[tid] = bitmap
        self._lookup_efd.notify()

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._looked.pop(task_id, None)

    def submit_unlock(self, keys: list[Any]) -> None:
        def unlock() -> None:
            for key in keys:
                k = self._key(key)
                n = self._locks.get(k, 0)
                if n <= 0:
                    continue
                self.store.unpin_objects([k, k + "/r"])
                if n == 1:
                    del self._locks[k]
                else:
                    self._locks[k] = n - 1

        self._runner.loop.call_soon_threadsafe(unlock)

    # ------------------------------------------------------------------ load

    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> L2TaskId:
        tid = self._task()
        self._submit(self._load(tid, list(keys), list(objects)))
        return tid

    async def _load(self, tid: L2TaskId, keys: list[Any], objects: list[Any]) -> None:
        bitmap = Bitmap(len(keys))
        accessed = []
        for i, (key, obj) in enumerate(zip(keys, objects, strict=True)):
            k = self._key(key)
            try:
                raw = await self.store.get_object(k + "/r")
                if raw is None:
                    continue
                rec = host_view(raw)
                if len(rec) != _L2_RECORD.size:
                    raise FormatError("L2 record: wrong length")
                magic, version, size, csum = _L2_RECORD.unpack(rec)
                dst = memoryview(obj.byte_array).cast("B")
                if magic != b"HSL2" or version != 1 or size != len(dst):
                    raise FormatError(
                        f"L2 record: {size} bytes recorded, the load buffer holds {len(dst)}"
                    )
                got = await self.store.get_object(k)
                data = None if got is None else host_view(got)
                if data is None or len(data) != size or checksum(data) != csum:
                    raise FormatError("L2 object: missing, or its bytes differ from the record")
                dst[:] = data
                bitmap.set(i)
                accessed.append(key)
            except FormatError as e:
                log.warning("hurray L2 adapter: %s failed verification (%s); a miss", k, e)
                await self.store.delete_object(k + "/r")
        if accessed:
            self._notify_keys_accessed(accessed)
        with self._lock:
            self._loaded[tid] = bitmap
        self._load_efd.notify()

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._loaded.pop(task_id, None)

    # ------------------------------------------------------------------ the rest

    def delete(self, keys: list[Any]) -> None:
        async def drop() -> tuple[list[Any], list[int]]:
            gone, sizes = [], []
            for key in keys:
                k = self._key(key)
                raw = await self.store.get_object(k + "/r")
                if raw is None:
                    continue
                await self.store.delete_object(k + "/r")  # its group: the object too
                await self.store.delete_object(k)  # stored before groups kept their members
                gone.append(key)
                sizes.append(
                    _L2_RECORD.unpack(host_view(raw))[2] if len(raw) == _L2_RECORD.size else 0
                )
            return gone, sizes

        gone, sizes = self._runner.call(drop())
        if gone:
            self._notify_keys_deleted(gone, sizes)

    def report_status(self) -> dict:
        st = self.store.stats()
        return {
            "is_healthy": True,
            "type": "HurrayL2Adapter",
            "tiers": st["tiers"],
            "locked_key_count": len(self._locks),
        }

    def close(self) -> None:
        try:
            self._runner.close()
        finally:
            for efd in (self._store_efd, self._lookup_efd, self._load_efd):
                efd.close()
