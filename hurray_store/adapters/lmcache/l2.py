"""``lmcache server`` (the multiprocess mode) moves objects between its L1 memory and L2
adapters through non-blocking submit/query calls signalled on three eventfds. The
adapter below keeps each object in hurray_store's object level: the object's bytes,
then a record (the commit point) with its size and xxh3-64 checksum. A load checks
both against the caller's buffer before it copies; anything else is a 0 in the
result bitmap, never wrong bytes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

from hurray_store.adapters.lmcache.records import (
    pack_l2_record,
    parse_l2_record,
)
from hurray_store.adapters.store_thread import StoreThread
from hurray_store.errors import FormatError
from hurray_store.format import checksum
from hurray_store.store import TieredStore
from hurray_store.tiers import host_view

log = logging.getLogger(__name__)
T = TypeVar("T")


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
                rec = pack_l2_record(data)
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
                size, csum = parse_l2_record(host_view(raw))
                dst = memoryview(obj.byte_array).cast("B")
                if size != len(dst):
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
                try:
                    sizes.append(parse_l2_record(host_view(raw))[0])
                except FormatError:
                    sizes.append(0)
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
