"""LMCache's own engine (LMCacheEngine, on the CPU) with hurray_store as its only store.

LMCache ships no CPU connector for a paged cache, so a test-only connector copies chunks
between LMCache's KV_2LTD buffers and a vLLM-style paged pool by slot mapping (plain
torch; LMCache's engine, token database, storage manager and plugin loader are real).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
pytest.importorskip("lmcache", reason="the lmcache extra is not installed (make test installs it)")

try:  # LMCache 0.5.7 moved the in-process engine, with no shim
    from lmcache.inprocess.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.inprocess.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
except ImportError:  # 0.5.6
    from lmcache.v1.cache_engine import LMCacheEngineBuilder  # type: ignore[no-redef]
    from lmcache.v1.gpu_connector.gpu_connectors import (  # type: ignore[no-redef]
        GPUConnectorInterface,
    )
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402

from hurray_store.adapters.lmcache import HurrayStoragePlugin  # noqa: E402

L, H, D, P, CHUNK, BLOCKS = 3, 2, 16, 16, 64, 64


class PagedTorchConnector(GPUConnectorInterface):
    """Chunk <-> paged pool (``kvcaches``: per layer ``[2, blocks, P, H, D]``) by
    ``slot_mapping``."""

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, L, num_tokens, H * D])

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
        s = kw["slot_mapping"][start:end]
        for li, kv in enumerate(kw["kvcaches"]):
            memory_obj.tensor[:, li, : end - start] = kv.view(2, -1, H * D)[:, s]

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
        s = kw["slot_mapping"][start:end]
        for li, kv in enumerate(kw["kvcaches"]):
            kv.view(2, -1, H * D)[:, s] = memory_obj.tensor[:, li, : end - start]

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
        for o, a, b in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(o, a, b, **kw)

    def batched_to_gpu(
        self, memory_objs: Any = None, starts: Any = None, ends: Any = None, **kw: Any
    ) -> None:
        for o, a, b in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(o, a, b, **kw)


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[Any]:
    (tmp_path / "h.yaml").write_text(
        f"tiers:\n  - {{type: disk, path: {tmp_path / 'cache'}, capacity_bytes: 1073741824}}\n"
    )
    names: list[str] = []

    def make() -> Any:
        cfg = LMCacheEngineConfig.from_dict(
            {
                "chunk_size": CHUNK,
                "local_cpu": False,
                "max_local_cpu_size": 0.25,
                "storage_plugins": ["hurray"],
                "extra_config": {
                    "storage_plugin.hurray.module_path": "hurray_store.adapters.lmcache",
                    "storage_plugin.hurray.class_name": "HurrayStoragePlugin",
                    "storage_plugin.hurray.config": str(tmp_path / "h.yaml"),
                },
            }
        )
        md = LMCacheMetadata(
            model_name="tiny",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.float16,
            kv_shape=(L, 2, CHUNK, H, D),
        )
        name = f"test-{uuid.uuid4().hex[:8]}"
        eng = LMCacheEngineBuilder.get_or_create(
            name, cfg, md, PagedTorchConnector(), lambda t, r: None, lambda o, r: o
        )
        names.append(name)
        eng.post_init()
        return eng

    try:
        yield make
    finally:
        for name in names:  # LMCache's storage manager thread would hang the run otherwise
            LMCacheEngineBuilder.destroy(name)


def plugin(eng: Any) -> HurrayStoragePlugin:
    found = [
        b
        for b in eng.storage_manager.storage_backends.values()
        if isinstance(b, HurrayStoragePlugin)
    ]
    assert found, "LMCache swallowed a plugin load error: the plugin is not among the backends"
    return found[0]


def test_store_lookup_retrieve_into_other_pages_and_restart(engines: Any) -> None:
    eng = engines()
    p = plugin(eng)
    assert [type(b).__name__ for b in eng.storage_manager.storage_backends.values()] == [
        "LocalCPUBackend",
        "HurrayStoragePlugin",
    ]
    g = torch.Generator().manual_seed(0)
    src = [torch.randn((2, BLOCKS, P, H, D), generator=g).half() for _ in range(L)]
    a = list(range(1000, 1200))  # 3 full chunks + 8 tokens
    b = a[:64] + list(range(5000, 5128))  # shares its first chunk with a
    slots_a = torch.arange(0, 200)
    slots_b = torch.cat(
        [torch.arange(0, 64), torch.arange(256, 384)]
    )  # the shared chunk's pages too
    eng.store(torch.tensor(a), slot_mapping=slots_a, kvcaches=src)
    eng.store(torch.tensor(b), slot_mapping=slots_b, kvcaches=src)
    p.flush()
    assert eng.lookup(torch.tensor(a)) == 192 and eng.lookup(torch.tensor(b)) == 192
    assert eng.lookup(torch.tensor(a[:64] + [7] * 100)) == 64
    assert eng.lookup(torch.tensor([9] * 128)) == 0

    def check(e: Any, toks: list[int], src_slots: torch.Tensor) -> None:
        dst = [torch.zeros((2, BLOCKS, P, H, D), dtype=torch.float16) for _ in range(L)]
        slots = (torch.arange(len(toks)) * 7 + 3) % (BLOCKS * P)  # scattered destination pages
        ret = e.retrieve(torch.tensor(toks), slot_mapping=slots, kvcaches=dst)
        assert int(ret.sum()) == 192
        for li in range(L):
            assert torch.equal(
                dst[li].view(2, -1, H, D)[:, slots[:192]],
                src[li].view(2, -1, H, D)[:, src_slots[:192]],
            )

    check(eng, a, slots_a)
    check(eng, b, slots_b)
    LMCacheEngineBuilder.destroy(
        next(n for n, e in LMCacheEngineBuilder._instances.items() if e is eng)
    )
    eng2 = engines()  # a new engine over the same disk tier (LMCache's own disk backend forgets)
    assert eng2.lookup(torch.tensor(a)) == 192
    check(eng2, a, slots_a)
