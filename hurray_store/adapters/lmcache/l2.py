"""``lmcache server`` (the multiprocess mode) moves objects between its L1 memory and L2
adapters through non-blocking submit/query calls signalled on three eventfds. The
adapter below keeps each of LMCache's objects as one object of hurray_store's object
level: a Hurray stream of two rank-1 ``uint8`` tensors, the bytes and then a record (the
commit point, last) with their offset, size and xxh3-64 checksum (``format/records.py``).
Every tier writes an object whole or not at all, so no record exists without its bytes. A
load reads the bytes straight into LMCache's buffer and the record beside them, in one
ranged read, and checks the record against the buffer there; anything else is a 0 in
the result bitmap, never wrong bytes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

from hurray_store.batches import batches
from hurray_store.engine import EnginePort
from hurray_store.engine.identity import folder_identity, identity_tag
from hurray_store.errors import FormatError
from hurray_store.format import checksum
from hurray_store.format.records import (
    L2_RECORD_BYTES,
    l2_layout,
    pack_l2_object,
    parse_l2_record,
)
from hurray_store.store import Pin, TieredStore

log = logging.getLogger(__name__)
T = TypeVar("T")
_WAVE_BYTES = 256 << 20  # bytes of one task in flight at once


class HurrayL2AdapterConfig(L2AdapterConfigBase):
    """Config of HurrayL2Adapter.

    - ``config`` (str, required): path of a hurray_store YAML (its tiers).
    - ``max_capacity_gb`` (float, optional): the capacity reported to LMCache for its
      global eviction; 0 (default) leaves eviction to hurray_store's own budgets.
    - ``model_path`` (str, optional): the model's folder; objects are then keyed by its
      weights and KV-shaping config, not by LMCache's model name alone.
    """

    def __init__(
        self, config: str, max_capacity_gb: float = 0.0, model_path: str | None = None
    ) -> None:
        self.config = config
        self.max_capacity_gb = max_capacity_gb
        self.model_path = model_path

    @classmethod
    def from_dict(cls, d: dict) -> HurrayL2AdapterConfig:
        path = d.get("config")
        if not isinstance(path, str) or not path:
            raise ValueError("config must be the path of a hurray_store YAML")
        cap = d.get("max_capacity_gb", 0.0)
        if not isinstance(cap, int | float) or isinstance(cap, bool) or cap < 0:
            raise ValueError("max_capacity_gb must be a number >= 0")
        model_path = d.get("model_path")
        if model_path is not None and (not isinstance(model_path, str) or not model_path):
            raise ValueError("model_path must be the path of the model's folder")
        return cls(path, float(cap), model_path)

    @classmethod
    def help(cls) -> str:
        return (
            "hurray_store L2 adapter config fields:\n"
            "- config (str): path of a hurray_store YAML (required)\n"
            "- max_capacity_gb (float): capacity reported to LMCache (optional, default 0)\n"
            "- model_path (str): the model's folder, to key objects by its weights (optional)"
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
        self._locks: dict[str, list[Pin]] = {}  # the store's pins of each locked key
        self.port = EnginePort(cfg.config, name="hurray-store-l2")
        self._runner = self.port.thread  # LMCache's tasks run on the store's loop
        self.store: TieredStore = self.port.store
        # "l2o/": objects that end in their record (older "l2/" groups are never read);
        # then the weights' tag where the model's folder is known.
        self._prefix = "l2o/"
        if cfg.model_path:
            tag = identity_tag(folder_identity(cfg.model_path, None, "HurrayL2Adapter"))
            self._prefix = f"l2o/{tag}/"
        else:
            log.warning(
                "HurrayL2Adapter: no model_path: objects are keyed by LMCache's model name "
                "alone, so two checkpoints served under one name would share KV; set "
                "model_path to key by the weights"
            )

    # ------------------------------------------------------------------ plumbing

    def _key(self, key: Any) -> str:
        salt = getattr(key, "cache_salt", "")
        group = getattr(key, "object_group_id", 0)
        return (
            f"{self._prefix}{key.model_name}@{key.kv_rank}@{group}"
            f"@{bytes(key.chunk_hash).hex()}@{salt}"
        )

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
        # No copy: LMCache holds a read lock on each object until this task is reported
        # done (its StoreController calls finish_read only after
        # pop_completed_store_tasks), so the buffers stay valid and unchanged.
        # The task also keeps the objects referenced: a view of ``byte_array`` does not.
        self._submit(self._store(tid, list(keys), list(objects)))
        return tid

    async def _store(self, tid: L2TaskId, keys: list[Any], objects: list[Any]) -> None:
        """Every key of the task at once (bounded in bytes): per key one object, its
        bytes then its record, written whole or not at all. What other processes sharing
        a tier did is read first: a key one of them removed is written again."""
        await self.store.sync()
        views = [memoryview(o.byte_array).cast("B") for o in objects]

        async def one(key: Any, data: memoryview) -> int | None:
            k = self._key(key)
            if self.store.has_object(k):
                return None  # stored already
            # A Hurray stream (any Hurray reader, pyhurray or `hurray-store inspect`,
            # reads it) closed by its record: the bytes are hashed once, by the tier
            # that writes them (a disk tier or a single Redis: on its writing thread,
            # just before they go out).
            if not await self.store.put_object(k, pack_l2_object(data), self_checked=True):
                raise OSError(f"{k}: stored in no tier")
            return len(data)

        ok, total = True, 0
        stored_keys, sizes = [], []
        items = list(zip(keys, views, strict=True))
        for wave in batches(items, lambda kv: len(kv[1]), _WAVE_BYTES):
            got = await asyncio.gather(*(one(k, v) for k, v in wave), return_exceptions=True)
            for (key, _), r in zip(wave, got, strict=True):
                if isinstance(r, BaseException):
                    log.warning("hurray L2 adapter: store task %d: %s", tid, r)
                    ok = False
                elif r is not None:
                    total += r
                    stored_keys.append(key)
                    sizes.append(r)
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
        # What other processes sharing a tier did, read once; then each key from the
        # ledger, pinned in the same step of the loop as its check (nothing evicts it in
        # between). A shared tier (a cache server) is asked about what the ledger lacks.
        await self.store.sync()
        bitmap = Bitmap(len(keys))
        for i, key in enumerate(keys):
            k = self._key(key)
            if self.store.has_object(k) or (
                self.store.shared and await self.store.contains_object(k)
            ):
                bitmap.set(i)
                self._locks.setdefault(k, []).extend(self.store.pin_objects([k]))
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
                pins = self._locks.get(k)
                if not pins:
                    continue
                self.store.unpin((pins.pop(),))
                if not pins:
                    del self._locks[k]

        self._runner.loop.call_soon_threadsafe(unlock)

    def submit_touch(self, keys: list[Any]) -> None:
        """Keys LMCache used without loading them (LMCache 0.5.7): they count as used
        now in the store's eviction order, and in LMCache's."""
        self._runner.loop.call_soon_threadsafe(
            self.store.touch_objects, [self._key(key) for key in keys]
        )
        self._notify_keys_accessed(list(keys))

    def get_memory_tags(self) -> Any:
        """Where the bytes live (LMCache 0.5.7 asks, for prefetch targets and L1-L2
        affinity): storage; remote when a tier is shared with other hosts (Redis, S3, a
        cache server), local otherwise."""
        from lmcache.v1.distributed.api import (  # LMCache 0.5.7 on
            MemoryResidency,
            MemorySegment,
            MemoryTags,
        )

        remote = any(t.kind in ("redis", "remote", "s3") for t in self.store.tiers)
        memory_only = all(t.kind in ("cpu", "gpu") for t in self.store.tiers)
        return MemoryTags(
            MemorySegment.DRAM if memory_only else MemorySegment.STORAGE,
            MemoryResidency.REMOTE if remote else MemoryResidency.LOCAL,
        )

    # ------------------------------------------------------------------ load

    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> L2TaskId:
        tid = self._task()
        self._submit(self._load(tid, list(keys), list(objects)))
        return tid

    async def _load(self, tid: L2TaskId, keys: list[Any], objects: list[Any]) -> None:
        """Every key at once (bounded in bytes), each read straight into LMCache's
        buffer and verified there against its record; a key that fails is a 0."""
        bitmap = Bitmap(len(keys))
        accessed = []
        items = list(zip(keys, objects, strict=True))
        pos = 0
        for wave in batches(items, lambda ko: int(ko[1].get_size()), _WAVE_BYTES):
            got = await self._load_wave([_L2Load(self._key(k), o) for k, o in wave])
            for j, ok in enumerate(got):
                if ok:
                    bitmap.set(pos + j)
                    accessed.append(wave[j][0])
            pos += len(wave)
        if accessed:
            self._notify_keys_accessed(accessed)
        with self._lock:
            self._loaded[tid] = bitmap
        self._load_efd.notify()

    async def _load_wave(self, loads: list[_L2Load]) -> list[bool]:
        # Objects on a disk tier or a single Redis are read off the loop, on a worker
        # thread and the tier's helpers, each hashed by the tier as it comes in; the
        # rest are read on the loop and hashed on workers (python-xxhash's one-shot
        # xxh3 keeps the GIL while it hashes, so this keeps the loop's own turns short
        # rather than hashing on every core).
        def hashed(j: int, i: int, s: int) -> None:
            if i == 0:
                loads[j].csum = s

        now = await asyncio.to_thread(
            self.store.read_objects_into_now, [(x.name, x.ranges, x.into) for x in loads], hashed
        )

        async def rest(x: _L2Load) -> bool:
            if not await self.store.read_object_into(x.name, x.ranges, x.into):
                return False  # gone (or shorter than an object of this size)
            x.csum = await asyncio.to_thread(checksum, x.dst)
            return True

        later = [x for x, ok in zip(loads, now, strict=True) if not ok]
        read = dict(zip(map(id, later), await asyncio.gather(*map(rest, later)), strict=True))
        out = []
        for x, ok in zip(loads, now, strict=True):
            try:
                if not (ok or read[id(x)]):
                    out.append(False)
                    continue
                x.check()
                out.append(True)
            except FormatError as e:
                log.warning("hurray L2 adapter: %s failed verification (%s); a miss", x.name, e)
                await self.store.delete_object(x.name)
                out.append(False)
        return out

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._loaded.pop(task_id, None)

    # ------------------------------------------------------------------ the rest

    def delete(self, keys: list[Any]) -> None:
        async def drop() -> tuple[list[Any], list[int]]:
            gone, sizes = [], []
            for key in keys:
                k = self._key(key)
                size = await self.store.object_size(k)
                if size is None:
                    continue
                await self.store.delete_object(k)
                gone.append(key)
                sizes.append(max(0, size - l2_layout(0)[2]))  # LMCache's bytes in it
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
            self.port.close()
        finally:
            for efd in (self._store_efd, self._lookup_efd, self._load_efd):
                efd.close()


class _L2Load:
    """One key of a load: LMCache's buffer and the record read beside it, where both sit
    in the object, and the checksum of what came in."""

    def __init__(self, name: str, obj: Any) -> None:
        self.name = name
        self.dst = memoryview(obj.byte_array).cast("B")
        self.at, rec_at, _ = l2_layout(len(self.dst))
        self.rec = bytearray(L2_RECORD_BYTES)
        self.ranges = [(self.at, len(self.dst)), (rec_at, len(self.rec))]
        self.into = [self.dst, memoryview(self.rec)]
        self.csum: int | None = None

    def check(self) -> None:
        """FormatError unless the record describes these bytes."""
        offset, size, want = parse_l2_record(self.rec)
        if (offset, size) != (self.at, len(self.dst)):
            raise FormatError(
                f"L2 record: {size} bytes at {offset}, the load buffer holds {len(self.dst)}"
            )
        if self.csum != want:
            raise FormatError("L2 object: its bytes differ from the record")
