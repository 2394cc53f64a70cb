"""hurray_store as an LMCache 0.5.6 storage plugin.

LMCache hands over chunks, not token ids: a ``MemoryObj`` in ``KV_2LTD`` format,
``[2, num_layers, num_tokens, heads * head_dim]``, under a ``CacheEngineKey``. The plugin
stores each chunk through the store's object level as one object, one Hurray stream:

- 2 x layers block-paged descriptors (per layer a key and a value descriptor, each with
  its page pool: one sequence, the chunk's tokens cut into pages of ``page_size``). The
  pools are views of LMCache's buffer; a partial last page is the only copy
  (zero-padded);
- then the chunk record, the commit point, last (``format/records.py``). It holds the
  layout fingerprint, the token count, the object's size, and per layer where its pools
  start and the xxh3-64 of the chunk's key and value token bytes (each byte hashed once).

That is the chunk object of ``format/chunk.py``, SGLang's page objects' format too.

The object's size (from the store's ledger) gives its page count, hence where every pool
and the record sit. The plugin wires four parts to LMCache's interface: the layout
(``layout.py``), the chunks this engine named and its pins on them (``chunks.py``), the
lookups (``lookups.py``), the puts (``puts.py``) and the gets, read straight into
LMCache's buffer and checked there against the record (``gets.py``).

The object key derives from the ``CacheEngineKey`` (model, world size, worker, chunk
hash, dtype) and from a layout fingerprint of LMCache's metadata (layers, kv heads, head
size, chunk size, dtype, MLA, page size). A layout change is then a different key: a
miss, never scrambled KV.

The chunk names also carry the model's identity (``engine.identity``): with
``...model_path`` (or a model name that is a folder) the weights' and KV-shaping
config's, so two checkpoints served under one ``model_name`` never share a chunk;
without, LMCache's model name alone, with one warning.

Plugin settings: ``extra_config["storage_plugin.<name>.config"]`` (a hurray_store YAML,
required), ``...page_size`` (default 16) and ``...model_path`` (the model's folder;
recommended). See docs/lmcache.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from hurray_store.adapters.lmcache.chunks import ChunkRegistry
from hurray_store.adapters.lmcache.gets import ChunkGets
from hurray_store.adapters.lmcache.layout import ChunkLayout
from hurray_store.adapters.lmcache.lookups import ChunkLookups
from hurray_store.adapters.lmcache.puts import ChunkPuts
from hurray_store.engine import EnginePort
from hurray_store.engine.extra import check_keys
from hurray_store.engine.identity import WeightsIdentity, identity_tag
from hurray_store.store import TieredStore


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
        mine = f"storage_plugin.{name}."
        check_keys(
            (k for k in extra if k.startswith(mine)),
            (mine + k for k in ("config", "page_size", "model_path", "module_path", "class_name")),
            "hurray plugin",
            "LMCache's extra_config",
        )
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
        self.fingerprint = self.layout.fingerprint
        # The model's identity: its weights where the folder is known (model_path, or
        # LMCache's model name when that is a folder), else its name, with a warning.
        self.weights = WeightsIdentity(
            extra.get(f"storage_plugin.{name}.model_path"), metadata.model_name, "hurray plugin"
        )
        self.identity = self.weights.value
        self.port = EnginePort(path, name="hurray-store-plugin")
        self.store: TieredStore = self.port.store
        # The chunks this engine named lately, and its pins on them.
        self.chunks = ChunkRegistry(self._prefix(), self.port.ref)
        self.lookups = ChunkLookups(self.port, self.chunks)
        self.puts = ChunkPuts(self.port, self.chunks, self.layout)
        self.gets = ChunkGets(self.port, self.chunks, self.layout, local_cpu_backend)
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

    def _prefix(self) -> str:
        """The chunks' names name the layout and the model's identity (its weights)."""
        if self.identity.startswith("name:") and not self.weights.generation:
            return f"lmc/{self.fingerprint[:8].hex()}/"  # LMCache's model name in the key
        return f"lmc/{self.fingerprint[:8].hex()}.{identity_tag(self.identity)}/"

    def clear(self) -> int:
        """LMCache's ``clear`` (its storage manager calls it on every backend, as after a
        weight update): the chunks stored so far are no longer found by this engine,
        which names chunks by a new generation of its identity from now on, or by the
        new weights' when the model folder's files changed. Nothing is deleted (another
        engine on the old weights may use it; eviction takes it). Returns 0: no tokens
        were deleted."""
        self.identity = self.weights.reset()
        for c in self.chunks.rename(self._prefix()):
            while True:  # pin by pin: an unpin may be popping from the same entry
                try:
                    self.port.release_one(c.pop())
                except IndexError:
                    break
        return 0

    # ------------------------------------------------------------------ put

    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[CacheEngineKey], None] | None = None,
    ) -> None:
        self.puts.submit(keys, objs, on_complete_callback)

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        return self.puts.pending(key)

    def flush(self) -> None:
        """Wait for every submitted put (tests, shutdown)."""
        self.puts.wait()

    # ------------------------------------------------------------------ lookups

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        return self.batched_contains([key], pin) == 1

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        """How many of ``keys``, from the first, a get will find: what LMCache's engine
        asks on every lookup (vLLM's with ``pin``): ``lookups.py``."""
        return self.lookups.count(keys, pin)

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        return await self.lookups.count_async(keys, pin)

    def pin(self, key: CacheEngineKey) -> bool:
        return self.lookups.pin_prefix([key]) == 1

    def unpin(self, key: CacheEngineKey) -> bool:
        return self.lookups.unpin(key)

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        return self.lookups.remove(key, force)

    # ------------------------------------------------------------------ get

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        return self.gets.get_many([key])[0]

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """Every chunk of ``keys``, None where missing, read all at once: what LMCache's
        engine calls on a retrieve."""
        return self.gets.get_many(keys)

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[CacheEngineKey], transfer_spec: Any = None
    ) -> list[MemoryObj]:
        """The chunks of ``keys`` up to the first miss, read all at once (on a worker
        thread of LMCache's loop)."""
        out = await asyncio.to_thread(self.gets.get_many, keys)
        n = next((i for i, o in enumerate(out) if o is None), len(out))
        for o in out[n:]:
            if o is not None:
                o.ref_count_down()  # after a miss: LMCache uses a prefix only
        return [o for o in out[:n] if o is not None]

    # ------------------------------------------------------------------ the rest

    def get_allocator_backend(self) -> Any:
        return self.local_cpu_backend

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        finally:
            self.port.close()
