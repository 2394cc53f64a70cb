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
from collections import deque
from collections.abc import Callable, Coroutine, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

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
_HASH_MASK = 2**64 - 1  # LMCache's chunk hashes are Python ints, possibly negative
# Chunks whose names and pins are kept (``HurrayStoragePlugin._chunks``) before the
# unpinned ones are dropped. A name takes 0.6 us to make here, 0.1 to find again; a
# chunk is named on its put, each lookup, get and unpin.
_CHUNKS_KEPT = 8192


def _chunk_name(prefix: str, key: CacheEngineKey) -> str:
    """The store's name of LMCache's chunk ``key``, under the layout's ``prefix``. A key
    with tags (LMCache's ``lmcache.tag.*`` request configs, which keep one tenant's
    chunks apart from another's: its keys differ by them) names its tags' xxh3-64 too,
    of fixed length whatever the tags."""
    name = (
        f"{prefix}{key.model_name}@{key.world_size}@{key.worker_id}"
        f"@{key.chunk_hash & _HASH_MASK:016x}@{str(key.dtype).removeprefix('torch.')}"
    )
    if tags := getattr(key, "tags", None):
        name += f"@t{checksum(repr(tags).encode()):016x}"
    return name + "/c"


class _Chunk(deque[Pin]):
    """A chunk LMCache named lately: LMCache's key, its name in the store, the store's
    handle on it (``TieredStore.object_ref``), and, as its items, the store's pins this
    engine holds on it (one object less to reach than a list of them in a slot). A
    deque, not a list: a list emptied by its last ``pop`` gives its storage back and
    takes it again on the next pin, a ``malloc`` and a ``free`` a pin; the 32 unpins
    of a lookup right after a store took 19-23 us with a list here, 9-12 with a
    deque."""

    __slots__ = ("key", "name", "ref")

    def __init__(self, key: CacheEngineKey, name: str, ref: KeyRef) -> None:
        super().__init__()
        self.key, self.name, self.ref = key, name, ref


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
        # LMCache's chunks this engine has named lately (put or pinned): each one's name in the
        # store, the store's handle on it, which a lookup pins by (it keeps the books' entry of the
        # copy a get finds, so a pin looks nothing up while that copy stays), and the store's pins
        # this engine holds on it (LMCache may pin a chunk twice, for two lookups of one prefix, and
        # lets each go once). One lookup by LMCache's key finds them all. They are found by the
        # key's chunk hash, an int: LMCache's key hashes in Python (``__hash__`` builds a tuple of
        # its fields, 0.4-0.6 us a call here, as much as the rest of a pin), and the key an unpin
        # names is the very object its lookup named, so the entry's own key matches it by identity,
        # with no comparison. A key whose chunk hash is taken by another key (the same tokens under
        # other tags) goes in ``_others``, by the whole key. ``unpin`` takes no lock: it pops a pin
        # from a chunk's deque. Chunks are added, and pins too, only under ``_chunks_lock``, and
        # chunks leave under it: a removed one, and the unpinned ones when there are too many
        # (``_drops`` counts the times any left).
        self._chunks: dict[int, _Chunk] = {}
        self._others: dict[CacheEngineKey, _Chunk] = {}
        self._chunks_lock = threading.Lock()
        self._chunks_cap = _CHUNKS_KEPT
        self._drops = 0
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
        c = self._find(key)
        return c.name if c is not None else _chunk_name(self._key_prefix, key)

    def _find(self, key: CacheEngineKey) -> _Chunk | None:
        """``key``'s entry in ``_chunks`` or ``_others``; None: none (any thread)."""
        c = self._chunks.get(key.chunk_hash)
        if c is None or (c.key is not key and c.key != key):
            # a key of another's chunk hash, its entry made while that one's was here
            c = self._others.get(key) if self._others else None
        return c

    def _chunk(self, key: CacheEngineKey, ref: KeyRef | None = None) -> _Chunk:
        """``key``'s entry, made if new (under ``_chunks_lock``), with ``ref`` as its
        handle where that is one (a lookup's, already pointing at the copy it pinned)."""
        if (c := self._find(key)) is not None:
            return c
        if len(self._chunks) + len(self._others) >= self._chunks_cap:
            # New dicts, not deletions in place: an unpin reading the old ones finds
            # the same entries. The pinned ones stay.
            self._chunks = {h: c for h, c in self._chunks.items() if c}
            self._others = {k: c for k, c in self._others.items() if c}
            self._chunks_cap = max(_CHUNKS_KEPT, 2 * (len(self._chunks) + len(self._others)))
            self._drops += 1
        name = _chunk_name(self._key_prefix, key)
        c = _Chunk(key, name, ref if ref is not None else self.store.object_ref(name))
        if self._chunks.setdefault(key.chunk_hash, c) is not c:
            self._others[key] = c  # its chunk hash is another key's
        return c

    # ------------------------------------------------------------------ put

    async def _put(self, c: _Chunk, chunk: Sealed) -> None:
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
            with self._chunks_lock:
                chunks = [self._chunk(k) for k in keys]
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
        found: list[_Chunk | KeyRef | None] = []
        drops = self._drops  # before the names' ``get``: entries leaving after, seen
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
        found: list[_Chunk | KeyRef | None],
        refs: bool = False,
    ) -> Iterator[Any]:
        """The store's name of each of ``keys`` (with ``refs``, its handle), made as
        the store asks for it (any thread), each key's entry in ``_chunks`` added to
        ``found`` (where it has none, the handle made for it, or None)."""
        get, others, prefix = self._chunks.get, self._others, self._key_prefix
        for k in keys:
            if (c := get(k.chunk_hash)) is None or (c.key is not k and c.key != k):
                c = others.get(k) if others else None  # as ``_find``, inline
            if c is not None:
                found.append(c)
                yield c.ref if refs else c.name
            else:
                name = _chunk_name(prefix, k)
                ref = self.store.object_ref(name) if refs else None
                found.append(ref)
                yield ref if ref is not None else name

    def _hold(
        self,
        keys: Sequence[CacheEngineKey],
        found: Sequence[_Chunk | KeyRef | None],
        drops: int,
        pins: Sequence[Pin],
    ) -> None:
        """The store pinned the chunks of ``keys``, from the first, for this engine: one
        pin more each, in its entry of ``found`` (made where there was none, with the
        handle the pin was taken by) while ``_drops`` is still ``drops``; else in the
        entry found or made again."""
        with self._chunks_lock:
            for k, c, pin in zip(keys, found, pins, strict=False):
                # ``_drops`` again each time: making an entry may drop others
                if c.__class__ is not _Chunk or self._drops != drops:
                    c = self._chunk(k, c if isinstance(c, KeyRef) else None)
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
            self._drop(key, k, f"{size} bytes is the size of no chunk object of this layout")
            return None
        pools, _ = self.layout.layers_of(pages)
        # The page count gives the token count but for a partial last page: read that
        # many tokens, and the record beside them.
        n = min(pages * self.page_size, self.chunk_size)
        out = self._allocate(key, n)
        if out is None:
            return None
        try:
            return _ChunkGet(key, slot, k, size, pages, pools, n, out, self)
        except BaseException:
            out.ref_count_down()
            raise

    def _drop(self, key: CacheEngineKey, name: str, why: str) -> None:
        log.warning("hurray plugin: %s failed verification (%s); a miss", key, why)
        self._call(self.store.delete_object(name))

    def _pool_views(self, obj: MemoryObj) -> list[memoryview]:
        """Byte views of a chunk's token rows, per layer its keys then its values."""
        # [2, layers, tokens, width]: one view, with no torch operation (see ChunkLayout.encode)
        whole, L = memoryview(obj.byte_array).cast("B"), self.num_layers
        nb = len(whole) // (2 * L)
        return [whole[(r * L + li) * nb : (r * L + li + 1) * nb] for li in range(L) for r in (0, 1)]

    def _allocate(self, key: CacheEngineKey, tokens: int) -> MemoryObj | None:
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
        found: list[_Chunk | KeyRef | None] = []
        drops, lazy = self._drops, self._names(keys, found)  # made on the store's loop
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
        lookup's chunks go one call per chunk), with no lock (see ``_chunks``)."""
        c = self._chunks.get(key.chunk_hash)
        if c is None or (c.key is not key and c.key != key):
            c = self._others.get(key) if self._others else None  # as ``_find``, inline
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
        with self._chunks_lock:
            c = self._find(key)
            if c is not None and c and not force:
                return False
            if c is not None:
                if self._chunks.get(key.chunk_hash) is c:
                    del self._chunks[key.chunk_hash]
                else:
                    del self._others[key]
                self._drops += 1
        name = c.name if c is not None else _chunk_name(self._key_prefix, key)
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
        self.dst = plugin._pool_views(out)
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
                part = p._allocate(self.key, got)
                if part is None:
                    return None
                assert self.out is not None
                part.tensor.copy_(self.out.tensor[:, :, :got])
                self.release()
                self.out = part
                self.sums = [checksum(d) for d in p._pool_views(part)]  # its tokens only
            for li, lay in enumerate(layers):
                if (
                    self.sums[2 * li] != lay.key_tokens_checksum
                    or self.sums[2 * li + 1] != lay.value_tokens_checksum
                ):
                    raise FormatError(f"layer {li}: its bytes differ from the record")
        except FormatError as e:
            p._drop(self.key, self.name, str(e))
            return None
        out, self.out = self.out, None
        return out
