"""hurray_store as an LMCache 0.5.6 storage plugin (the only module that
imports ``lmcache``).

LMCache hands over chunks, not token ids: a ``MemoryObj`` in ``KV_2LTD`` format,
``[2, num_layers, num_tokens, heads * head_dim]``, under a ``CacheEngineKey``. The plugin
stores each chunk through the store's object level as one object, one Hurray stream:

- 2 x layers block-paged descriptors (per layer a key and a value descriptor, each with
  its page pool: one sequence, the chunk's tokens cut into pages of ``page_size``). The
  pools are views of LMCache's buffer; a partial last page is the only copy
  (zero-padded);
- then the chunk record, the commit point, last (``hurray_store.records``). It holds the layout
  fingerprint, the token count, the object's size, and per layer where its pools start
  and the xxh3-64 of the chunk's key and value token bytes (each byte hashed once).

The object's size (from the store's books) gives its page count, hence where every pool
and the record sit. A get reads every layer's token bytes straight into LMCache's buffer
and the record beside them, in one ranged read (on disk one file, on Redis one
transaction), and checks them there against the record. Gets run on LMCache's thread:
from a disk tier or a single Redis they read there too, with no trip to the store's
loop. Any mismatch is a miss, never wrong data. (A chunk whose last page is partial
comes back with a copy of its tokens: the token count is in the record, read with them.)

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
from collections.abc import Callable, Coroutine, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from hurray_store.adapters.lmcache.chunks import Chunk, ChunkRegistry, chunk_name
from hurray_store.adapters.lmcache.layout import ChunkLayout
from hurray_store.adapters.store_thread import StoreThread, held_prefix, pin_held_prefix
from hurray_store.errors import FormatError
from hurray_store.format import checksum
from hurray_store.records import (
    parse_chunk_record,
)
from hurray_store.store import KeyRef, Pin, TieredStore
from hurray_store.tiers import RangeIn, Sealed

log = logging.getLogger(__name__)
T = TypeVar("T")
_GETS_IN_FLIGHT = 2  # chunks read at once on the store's loop (more was slower here)


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
        page_size = int(extra.get(f"storage_plugin.{name}.page_size", 16))
        num_layers, _, chunk_size, num_kv_heads, head_size = (int(x) for x in metadata.kv_shape)
        self.layout = ChunkLayout(
            num_layers,
            num_kv_heads,
            head_size,
            chunk_size,
            metadata.kv_dtype,
            bool(getattr(metadata, "use_mla", False)),
            page_size,
        )
        self.page_size, self.chunk_size, self.num_layers = page_size, chunk_size, num_layers
        self.num_kv_heads, self.head_size, self.dtype = num_kv_heads, head_size, metadata.kv_dtype
        self.fingerprint = self.layout.fingerprint
        self._key_prefix = f"lmc/{self.fingerprint[:8].hex()}/"
        self._runner = StoreThread(path, "hurray-store-plugin")
        self.store: TieredStore = self._runner.store
        self._unpin_one = self.store.unpin_one
        self._pending: dict[CacheEngineKey, Future[None]] = {}
        self._lock = threading.Lock()
        # The chunks this engine named lately, and its pins on them (``chunks.py``).
        self.chunks = ChunkRegistry(self._key_prefix, self.store.object_ref)
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

    def _chunk_key(self, key: CacheEngineKey) -> str:
        """The store's name of LMCache's chunk ``key``."""
        return self.chunks.name(key)

    # ------------------------------------------------------------------ put

    async def _put(self, c: Chunk, chunk: Sealed) -> None:
        # One object per chunk, its record last: written whole or not at all.
        if not await self.store.put_object(c.name, chunk, self_checked=True):
            raise OSError("stored in no tier")
        self.store.refresh_ref(c.ref)  # the next lookup's pin finds the copy at once

    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[CacheEngineKey], None] | None = None,
    ) -> None:
        # The puts go to the store's loop together, once every chunk is laid out: one
        # wake-up of its thread for the batch. One per chunk cost more than the wait
        # for the layout: store-only loops of 32 chunks in LMCache's engine, medians
        # over alternating pairs of 6-round runs, 3.10 GB/s against 2.51 (8 pairs)
        # and 3.12 against 2.85 (6 pairs). A chunk the books hold is skipped: what other
        # processes on the disk folder removed is heard first, so it is written again.
        self._hear_others()
        puts: list[tuple[Coroutine[Any, Any, None], Future[None]]] = []
        try:
            with self.chunks.lock:
                chunks = [self.chunks.entry(k) for k in keys]
            for key, c, obj in zip(keys, chunks, objs, strict=True):
                if self._held(c.name) or self.exists_in_put_tasks(key):
                    continue
                obj.ref_count_up()  # LMCache drops its reference once we return
                try:
                    chunk = self.layout.encode(obj)
                except Exception:
                    obj.ref_count_down()
                    raise
                fut: Future[None] = Future()
                puts.append((self._put(c, chunk), fut))
                self._track(key, obj, fut, on_complete_callback)
        finally:
            if puts:
                self._runner.start_all(puts)
        return None

    def _track(
        self,
        key: CacheEngineKey,
        obj: MemoryObj,
        fut: Future[None],
        on_complete_callback: Callable[[CacheEngineKey], None] | None,
    ) -> None:
        """``key``'s put is pending until ``fut`` is done; then LMCache's buffer is let
        go and LMCache told."""
        with self._lock:
            self._pending[key] = fut

        def done(f: Future[None]) -> None:
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
        return self.batched_contains([key], pin) == 1

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        """How many of ``keys``, from the first, a get will find: what LMCache's engine
        asks on every lookup (vLLM's with ``pin``). Without ``pin``, the books are read
        here, with no trip to the store's loop; a cache server shared with other engines
        is asked when they say no, as LMCache's remote backend asks. With ``pin``, the
        hits are pinned here too, from the books, in one step under their lock (the
        store's loop is asked only about a shared tier). Either way, what other processes
        sharing the store's disk folder did is heard first (``_hear_others``)."""
        self._hear_others()
        return self._lookup_now(keys, pin)

    def _lookup_now(self, keys: Sequence[CacheEngineKey], pin: bool) -> int:
        """``batched_contains`` once the store has heard the others."""
        if pin:
            return self._pin_prefix(keys)
        n = 0
        for key in keys:
            if not self._held(self._chunk_key(key)):
                break
            n += 1
        return n

    def _hear_others(self) -> None:
        """Before the books are read on this thread: what other processes sharing a
        tier's medium (a disk folder) committed or removed since the store last heard,
        heard on the store's loop, as each of the store's own operations does first.
        Asking costs one ``fstat`` a disk tier; the trip to the loop is made only when
        there is something to hear."""
        if self.store.unheard():
            self._call(self.store.sync())

    def _held(self, name: str) -> bool:
        """A get of chunk ``name`` will find it: the books say so, or a shared tier."""
        return self.store.has_object(name) or (
            self.store.shared and self._call(self.store.contains_object(name))
        )

    def _pin_prefix(self, keys: Sequence[CacheEngineKey]) -> int:
        """Pin the chunks of ``keys`` a get will find, from the first to the first miss;
        how many. The chunks' handles go to the store one at a time, as it asks (by
        name on the store's loop with a shared tier): a new prompt's lookup names its
        first chunk only (64 names made took 130-150 us here, where
        LMCache's disk backend answers the same miss in 0.5-0.7)."""
        found: list[Chunk | KeyRef | None] = []
        drops = self.chunks.drops  # before the names' ``get``: entries leaving after, seen
        pins: Sequence[Pin]
        if self.store.shared:  # asked on the store's loop, by name
            pins = self._runner.pin_prefix(self._names(keys, found))
        else:
            pins = self.store.pin_held_refs(self._names(keys, found, refs=True))
        self._hold(keys, found, drops, pins)
        return len(pins)

    def _names(
        self,
        keys: Sequence[CacheEngineKey],
        found: list[Chunk | KeyRef | None],
        refs: bool = False,
    ) -> Iterator[Any]:
        """The store's name of each of ``keys`` (with ``refs``, its handle), made as
        the store asks for it (any thread), each key's entry in ``chunks`` added to
        ``found`` (where it has none, the handle made for it, or None)."""
        find, prefix = self.chunks.find, self._key_prefix
        for k in keys:
            if (c := find(k)) is not None:
                found.append(c)
                yield c.ref if refs else c.name
            else:
                name = chunk_name(prefix, k)
                ref = self.store.object_ref(name) if refs else None
                found.append(ref)
                yield ref if ref is not None else name

    def _hold(
        self,
        keys: Sequence[CacheEngineKey],
        found: Sequence[Chunk | KeyRef | None],
        drops: int,
        pins: Sequence[Pin],
    ) -> None:
        """The store pinned the chunks of ``keys``, from the first, for this engine: one
        pin more each, in its entry of ``found`` (made where there was none, with the
        handle the pin was taken by) while ``chunks.drops`` is still ``drops``; else in the
        entry found or made again."""
        with self.chunks.lock:
            for k, c, pin in zip(keys, found, pins, strict=False):
                # ``drops`` again each time: making an entry may drop others
                if c.__class__ is not Chunk or self.chunks.drops != drops:
                    c = self.chunks.entry(k, c if isinstance(c, KeyRef) else None)
                c.append(pin)

    def _get_many(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj | None]:
        """The chunks of ``keys``, None where missing, read on the calling thread
        (LMCache's; never the store's loop). Chunks on a disk tier or a single Redis
        are read from here with no trip to the store's loop (``read_objects_into_now``),
        as LMCache's own disk backend reads, each range hashed as it comes in; the others
        are read on the loop, all at once, and checked here. Any mismatch is a miss and leaves."""
        out: list[MemoryObj | None] = [None] * len(keys)
        gets: list[_ChunkGet] = []
        try:
            for j, key in enumerate(keys):
                if (g := self._prepare(key, j)) is not None:
                    gets.append(g)
            now = self.store.read_objects_into_now(
                [(g.name, g.ranges, g.into) for g in gets], self._hash_range(gets)
            )
            later = [g for g, ok in zip(gets, now, strict=True) if not ok]
            if later:
                read = self._call(self._read_all(later))
                for g, ok in zip(later, read, strict=True):
                    if ok:
                        g.sums = [checksum(d) for d in g.dst]
                    else:
                        g.release()  # gone since the books said so
            for g in gets:
                if g.out is not None:
                    out[g.slot] = g.finish(self)
        except BaseException:
            for o in out:
                if o is not None:
                    o.ref_count_down()
            raise
        finally:
            for g in gets:
                g.release()  # whatever finish did not hand over
        return out

    @staticmethod
    def _hash_range(gets: list[_ChunkGet]) -> RangeIn:
        def hashed(j: int, i: int, s: int) -> None:  # hashed as it came in
            g = gets[j]
            if i < len(g.dst):
                g.sums[i] = s

        return hashed

    async def _read_all(self, gets: list[_ChunkGet]) -> list[bool]:
        slots = asyncio.Semaphore(_GETS_IN_FLIGHT)

        async def one(g: _ChunkGet) -> bool:
            async with slots:
                return await self.store.read_object_into(g.name, g.ranges, g.into)

        return list(await asyncio.gather(*(one(g) for g in gets)))

    def _prepare(self, key: CacheEngineKey, slot: int) -> _ChunkGet | None:
        """What a get of ``key`` (``slot`` in its batch) reads where: from its object's
        size in the books (the loop asks shared tiers when they do not know it), its
        page count, and LMCache's buffer for its tokens. None: a miss."""
        k = self._chunk_key(key)
        size = self.store.object_size_now(k)
        if size is None:
            size = self._call(self.store.object_size(k))
        if size is None:
            return None
        pages = self.layout.pages_of(size)
        if pages is None:
            self.drop_chunk(key, k, f"{size} bytes is the size of no chunk object of this layout")
            return None
        pools, _ = self.layout.layers_of(pages)
        # The page count gives the token count but for a partial last page: read that
        # many tokens, and the record beside them.
        n = min(pages * self.page_size, self.chunk_size)
        out = self.allocate_chunk(key, n)
        if out is None:
            return None
        try:
            return _ChunkGet(key, slot, k, size, pages, pools, n, out, self)
        except BaseException:
            out.ref_count_down()
            raise

    def drop_chunk(self, key: CacheEngineKey, name: str, why: str) -> None:
        """A chunk object that failed verification: deleted, a miss (a get's seam)."""
        log.warning("hurray plugin: %s failed verification (%s); a miss", key, why)
        self._call(self.store.delete_object(name))

    def pool_views(self, obj: MemoryObj) -> list[memoryview]:
        """Byte views of a chunk's token rows, per layer its keys then its values."""
        # [2, layers, tokens, width]: one view, with no torch operation (see ChunkLayout.encode)
        whole, L = memoryview(obj.byte_array).cast("B"), self.num_layers
        nb = len(whole) // (2 * L)
        return [whole[(r * L + li) * nb : (r * L + li + 1) * nb] for li in range(L) for r in (0, 1)]

    def allocate_chunk(self, key: CacheEngineKey, tokens: int) -> MemoryObj | None:
        """LMCache's buffer for a chunk of ``tokens`` (a get's seam); None when full."""
        out = self.local_cpu_backend.allocate(
            torch.Size([2, self.num_layers, tokens, self.num_kv_heads * self.head_size]),
            self.dtype,
            MemoryFormat.KV_2LTD,
        )
        if out is None:
            log.warning("hurray plugin: LMCache's CPU buffer is full; %s is a miss", key)
        return out

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        return self._get_many([key])[0]

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        """How many of ``keys``, from the first, a get will find, pinned with ``pin``.
        With no shared tier, as ``batched_contains``, here (the books and the pins need
        no trip to the store's loop); with one, one task on the store's loop, which asks
        the shared tier about all of them at once."""
        if not self.store.shared:
            if self.store.unheard():  # as ``_hear_others``, without blocking this loop
                await asyncio.wrap_future(self._runner.submit(self.store.sync()))
            return self._lookup_now(keys, pin)
        if not pin:
            names = map(self._chunk_key, keys)  # lazy, as with ``pin``
            return await asyncio.wrap_future(self._runner.submit(held_prefix(self.store, names)))
        found: list[Chunk | KeyRef | None] = []
        drops, lazy = self.chunks.drops, self._names(keys, found)  # made on the store's loop
        pins = await asyncio.wrap_future(self._runner.submit(pin_held_prefix(self.store, lazy)))
        self._hold(keys, found, drops, pins)
        return len(pins)

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """Every chunk of ``keys``, None where missing, read all at once: what LMCache's
        engine calls on a retrieve."""
        return self._get_many(keys)

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[CacheEngineKey], transfer_spec: Any = None
    ) -> list[MemoryObj]:
        """The chunks of ``keys`` up to the first miss, read all at once (on a worker
        thread of LMCache's loop)."""
        out = await asyncio.to_thread(self._get_many, keys)
        n = next((i for i, o in enumerate(out) if o is None), len(out))
        for o in out[n:]:
            if o is not None:
                o.ref_count_down()  # after a miss: LMCache uses a prefix only
        return [o for o in out[:n] if o is not None]

    # ------------------------------------------------------------------ the rest

    def pin(self, key: CacheEngineKey) -> bool:
        self._hear_others()
        return self._pin_prefix([key]) == 1

    def unpin(self, key: CacheEngineKey) -> bool:
        """Let one pin of a chunk go, here on the caller's thread (LMCache lets a
        lookup's chunks go one call per chunk), with no lock (see ``chunks.py``)."""
        c = self.chunks.find(key)
        if c is None:
            return False
        try:
            self._unpin_one(c.pop())
        except IndexError:
            return False
        return True

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        """Delete a chunk; a pinned one only with ``force``, its pins let go with it
        (else a chunk put again under the key would stay pinned)."""
        with self.chunks.lock:
            c = self.chunks.find(key)
            if c is not None and c and not force:
                return False
            self.chunks.remove(key)
        name = c.name if c is not None else chunk_name(self._key_prefix, key)
        while c is not None:  # pin by pin: an unpin may be popping from the same list
            try:
                self._unpin_one(c.pop())
            except IndexError:
                break
        return self._call(self._remove(name))

    async def _remove(self, name: str) -> bool:
        had = await self.store.contains_object(name)
        await self.store.delete_object(name)
        return had

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


class _ChunkGet:
    """One chunk's get: where its ranges sit in its object, LMCache's buffer they go
    into, and the record and checksums that check them."""

    def __init__(
        self,
        key: CacheEngineKey,
        slot: int,
        name: str,
        size: int,
        pages: int,
        pools: list[tuple[int, int]],
        n: int,
        out: MemoryObj,
        plugin: HurrayStoragePlugin,
    ) -> None:
        self.key, self.slot, self.name, self.size = key, slot, name, size
        self.pages, self.pools, self.n = pages, pools, n
        self.out: MemoryObj | None = out
        self.rec = bytearray(plugin.layout.record_bytes)
        self.ranges = plugin.layout.ranges_of(pages)  # the object's size is the layout's
        self.dst = plugin.pool_views(out)
        self.into = [*self.dst, memoryview(self.rec)]
        self.sums: list[int | None] = [None] * len(self.dst)

    def release(self) -> None:
        if self.out is not None:
            self.out.ref_count_down()
            self.out = None

    def finish(self, p: HurrayStoragePlugin) -> MemoryObj | None:
        """The chunk, once its bytes match its record; else a miss, and the object
        leaves the store."""
        # The record of a whole chunk whose bytes are the ones it was written with, made
        # here and compared at once (a get's check took 6 us so, against 17 parsing the
        # record and comparing field by field); any other record is parsed, and the
        # reason it differs logged.
        sums = self.sums
        if None not in sums and self.rec == p.layout.record_of(
            p.fingerprint, self.n, self.size, self.pools, sums
        ):
            out, self.out = self.out, None
            return out
        try:
            got, rec_size, layers = parse_chunk_record(
                self.rec, p.fingerprint, p.num_layers, p.chunk_size, p.layout.token_bytes
            )
            if (
                rec_size != self.size
                or [(x.key_pool_offset, x.value_pool_offset) for x in layers] != self.pools
            ):
                raise FormatError("the record describes another object")
            if got != self.n:
                if not (self.pages - 1) * p.page_size < got < self.n:
                    raise FormatError(f"{got} tokens in a chunk object of {self.pages} pages")
                part = p.allocate_chunk(self.key, got)
                if part is None:
                    return None
                assert self.out is not None
                part.tensor.copy_(self.out.tensor[:, :, :got])
                self.release()
                self.out = part
                self.sums = [checksum(d) for d in p.pool_views(part)]  # its tokens only
            for li, lay in enumerate(layers):
                if (
                    self.sums[2 * li] != lay.key_tokens_checksum
                    or self.sums[2 * li + 1] != lay.value_tokens_checksum
                ):
                    raise FormatError(f"layer {li}: its bytes differ from the record")
        except FormatError as e:
            p.drop_chunk(self.key, self.name, str(e))
            return None
        out, self.out = self.out, None
        return out
