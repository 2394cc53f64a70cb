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

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

from hurray_store.batches import batches
from hurray_store.engine import EnginePort, Save
from hurray_store.engine.extra import check_keys
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
        check_keys(d, ("config", "max_capacity_gb", "model_path"), "HurrayL2Adapter", "its config")
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
        self.store: TieredStore = self.port.store
        # LMCache's tasks run here, in order, calling the port (which may wait for the
        # store's loop): LMCache's thread only hands them over.
        self._worker = ThreadPoolExecutor(1, "hurray-l2-tasks")
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
        model = os.path.basename(os.path.normpath(cfg.model_path)) if cfg.model_path else "lmcache"
        self.port.publish_events(self._chunk_hash, model=model, block_size=0)

    # ------------------------------------------------------------------ plumbing

    def _key(self, key: Any) -> str:
        salt = getattr(key, "cache_salt", "")
        group = getattr(key, "object_group_id", 0)
        return (
            f"{self._prefix}{key.model_name}@{key.kv_rank}@{group}"
            f"@{bytes(key.chunk_hash).hex()}@{salt}"
        )

    def _chunk_hash(self, name: str) -> tuple[bytes, ...]:
        """LMCache's chunk hash of one of our object names (a KV event's block hash)."""
        if not name.startswith(self._prefix):
            return ()
        parts = name[len(self._prefix) :].split("@")
        return (bytes.fromhex(parts[3]),) if len(parts) >= 5 else ()

    def _task(self) -> L2TaskId:
        with self._lock:
            self._next += 1
            return self._next

    def _submit(self, task: Callable[[], None], failed: Callable[[], None]) -> None:
        """Run ``task`` on the adapter's worker thread (it calls the port, which may
        wait for the store's loop: never on LMCache's thread, never on the loop). One
        that raises still completes, as a failure: ``failed`` reports it."""

        def run() -> None:
            try:
                task()
            except Exception as e:  # noqa: BLE001 - reported to LMCache as a failure
                log.warning("hurray L2 adapter: a task failed: %r", e)
                failed()

        self._worker.submit(run)

    def _report(self, done: dict[L2TaskId, Any], tid: L2TaskId, result: Any, efd: Any) -> None:
        """Task ``tid`` ended with ``result``: kept for LMCache's query, and signalled."""
        with self._lock:
            done[tid] = result
        efd.notify()

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
        self._submit(
            partial(self._store, tid, list(keys), list(objects)),
            lambda: self._report(self._stored, tid, L2StoreResult(False, 0), self._store_efd),
        )
        return tid

    def _store(self, tid: L2TaskId, keys: list[Any], objects: list[Any]) -> None:
        """Per key not held yet, one object, its bytes then its record, written whole or
        not at all, saved through the port (its backlog bounds the bytes in flight);
        the task is done once every save ended. A Hurray stream (pyhurray and
        ``hurray-store inspect`` read it), its bytes hashed once, by the tier that
        writes them."""
        names = [self._key(k) for k in keys]
        held = self.port.held_each(names)
        todo = [
            (k, n, memoryview(o.byte_array).cast("B"))
            for k, n, o, h in zip(keys, names, objects, held, strict=True)
            if not h
        ]
        # The task keeps LMCache's objects referenced until its saves end: a view of
        # ``byte_array`` does not keep its buffer alive.
        task = _StoreTask(len(todo), objects)

        def done(key: Any, nbytes: int) -> Callable[[bool], None]:
            def f(ok: bool) -> None:
                if task.ended(key, nbytes, ok):
                    self._stored_all(tid, task)

            return f

        if not todo:
            self._stored_all(tid, task)
            return
        self.port.save([Save(n, pack_l2_object(v), len(v), done(k, len(v))) for k, n, v in todo])

    def _stored_all(self, tid: L2TaskId, task: _StoreTask) -> None:
        if not task.ok:
            log.warning("hurray L2 adapter: store task %d: some keys stored in no tier", tid)
        if task.keys:
            self._notify_keys_stored(task.keys, task.sizes)
        self._report(self._stored, tid, L2StoreResult(task.ok, task.total), self._store_efd)

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            out, self._stored = self._stored, {}
        return out

    # ------------------------------------------------------------------ lookup and lock

    def submit_lookup_and_lock_task(
        self, keys: list[Any], group_layout_descs: Any = None
    ) -> L2TaskId:
        tid = self._task()
        self._submit(
            partial(self._lookup, tid, list(keys)),
            lambda: self._report(self._looked, tid, Bitmap(len(keys)), self._lookup_efd),
        )
        return tid

    def _lookup(self, tid: L2TaskId, keys: list[Any]) -> None:
        """Each key found through the port (the ledger, or a shared tier for what it
        lacks) and pinned in the same step (nothing evicts it in between)."""
        bitmap = Bitmap(len(keys))
        for i, key in enumerate(keys):
            k = self._key(key)
            held = self.port.lookup([k], pin=True)
            if held.n:
                bitmap.set(i)
                with self._lock:
                    self._locks.setdefault(k, []).extend(held.pins)
        self._report(self._looked, tid, bitmap, self._lookup_efd)

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._looked.pop(task_id, None)

    def submit_unlock(self, keys: list[Any]) -> None:
        for key in keys:
            k = self._key(key)
            with self._lock:
                pins = self._locks.get(k)
                if not pins:
                    continue
                pin = pins.pop()
                if not pins:
                    del self._locks[k]
            self.port.release_one(pin)

    def submit_touch(self, keys: list[Any]) -> None:
        """Keys LMCache used without loading them (LMCache 0.5.7): they count as used
        now in the store's eviction order, and in LMCache's."""
        self.port.touch([self._key(key) for key in keys])
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

        kinds = [t.kind for t in self.store.config.tiers]
        remote = any(k in ("redis", "remote", "s3") for k in kinds)
        memory_only = all(k in ("cpu", "gpu") for k in kinds)
        return MemoryTags(
            MemorySegment.DRAM if memory_only else MemorySegment.STORAGE,
            MemoryResidency.REMOTE if remote else MemoryResidency.LOCAL,
        )

    # ------------------------------------------------------------------ load

    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> L2TaskId:
        tid = self._task()
        self._submit(
            partial(self._load, tid, list(keys), list(objects)),
            lambda: self._report(self._loaded, tid, Bitmap(len(keys)), self._load_efd),
        )
        return tid

    def _load(self, tid: L2TaskId, keys: list[Any], objects: list[Any]) -> None:
        """Every key at once (bounded in bytes), each read straight into LMCache's
        buffer and verified there against its record; a key that fails is a 0."""
        bitmap = Bitmap(len(keys))
        accessed = []
        items = list(zip(keys, objects, strict=True))
        pos = 0
        for wave in batches(items, lambda ko: int(ko[1].get_size()), _WAVE_BYTES):
            got = self._load_wave([_L2Load(self._key(k), o) for k, o in wave])
            for j, ok in enumerate(got):
                if ok:
                    bitmap.set(pos + j)
                    accessed.append(wave[j][0])
            pos += len(wave)
        if accessed:
            self._notify_keys_accessed(accessed)
        self._report(self._loaded, tid, bitmap, self._load_efd)

    def _load_wave(self, loads: list[_L2Load]) -> list[bool]:
        """Read through the port (a disk tier or a single Redis on this thread, each
        range hashed by the tier as it comes in; the rest on the store's loop, all at
        once, hashed here), then each checked against its record."""

        def hashed(j: int, i: int, s: int) -> None:
            if i == 0:
                loads[j].csum = s

        got = self.port.read(
            [(x.name, x.ranges, x.into) for x in loads], hashed, in_flight=len(loads)
        )
        out = []
        for x, ok in zip(loads, got, strict=True):
            if not ok:
                out.append(False)  # gone (or shorter than an object of this size)
                continue
            if x.csum is None:  # read on the store's loop
                x.csum = checksum(x.dst)
            try:
                x.check()
                out.append(True)
            except FormatError as e:
                self.port.reject(x.name, str(e))
                out.append(False)
        return out

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._loaded.pop(task_id, None)

    # ------------------------------------------------------------------ the rest

    def delete(self, keys: list[Any]) -> None:
        gone, sizes = [], []
        for key in keys:
            k = self._key(key)
            size = self.port.size(k)
            if size is not None and self.port.delete(k):
                gone.append(key)
                sizes.append(max(0, size - l2_layout(0)[2]))  # LMCache's bytes in it
        if gone:
            self._notify_keys_deleted(gone, sizes)

    def report_status(self) -> dict:
        st = self.port.stats()
        return {
            "is_healthy": True,
            "type": "HurrayL2Adapter",
            "tiers": st["tiers"],
            "locked_key_count": len(self._locks),
        }

    def close(self) -> None:
        try:
            self._worker.shutdown(wait=True)
            self.port.close()
        finally:
            for efd in (self._store_efd, self._lookup_efd, self._load_efd):
                efd.close()


class _StoreTask:
    """A store task's saves: how many are left, what was stored, whether all were."""

    def __init__(self, n: int, objects: list[Any]) -> None:
        self.left, self.ok, self.total = n, True, 0
        self.objects: list[Any] | None = objects  # kept alive while their bytes are saved
        self.keys: list[Any] = []
        self.sizes: list[int] = []
        self._lock = threading.Lock()

    def ended(self, key: Any, nbytes: int, ok: bool) -> bool:
        """One save ended; True for the last."""
        with self._lock:
            if ok:
                self.keys.append(key)
                self.sizes.append(nbytes)
                self.total += nbytes
            else:
                self.ok = False
            self.left -= 1
            if self.left == 0:
                self.objects = None
            return self.left == 0


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
