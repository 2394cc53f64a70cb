"""The write path of page-sized objects, on its own (no SGLang import): the disk tier's
batched hand-over to its writer threads (``WriteJobs``), its one-``writev`` fast path
and what a short write leaves to write, and the SGLang backend's page I/O (``PageIO``)
writing pages straight from a host pool whose pools are contiguous, through a staging
copy otherwise, read back bit-exact either way."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from hurray_store.adapters.sglang.page_io import PageIO
from hurray_store.adapters.sglang.pages import (
    LAYOUTS,
    TOKEN_MAJOR,
    PageCodec,
    page_fingerprint,
    page_view,
)
from hurray_store.config import DiskTierConfig
from hurray_store.engine import EnginePort
from hurray_store.store import open_store
from hurray_store.tiers import Buffer
from hurray_store.tiers.disk import DiskTier
from hurray_store.tiers.files import skip, write_all
from hurray_store.tiers.write_jobs import WriteJobs

L, H, D, P = 3, 2, 8, 4  # layers, KV heads, head size, page size


# ------------------------------------------------------------------ WriteJobs


async def test_writes_asked_in_one_turn_share_one_job_per_writer_thread() -> None:
    seen: list[tuple[str, str]] = []  # (key, thread name)
    lock = threading.Lock()

    def write(key: str, buffers: Iterable[Buffer], nbytes: int | None) -> bool:
        with lock:
            seen.append((key, threading.current_thread().name))
        time.sleep(0.02)  # long enough that the second job finds the second thread
        return key != "k3"

    pool = ThreadPoolExecutor(2, "w")
    jobs = WriteJobs(write, pool, threads=2)
    try:
        got = await asyncio.gather(*(jobs.put(f"k{i}", [b"x"], 1) for i in range(10)))
    finally:
        pool.shutdown(wait=True)
    assert got == [i != 3 for i in range(10)]
    assert sorted(k for k, _ in seen) == sorted(f"k{i}" for i in range(10))
    # One job per thread: the first half in order on one thread, the second on another.
    by_thread: dict[str, list[str]] = {}
    for k, t in seen:
        by_thread.setdefault(t, []).append(k)
    assert sorted(by_thread.values()) == [
        [f"k{i}" for i in range(5)],
        [f"k{i}" for i in range(5, 10)],
    ]


async def test_a_write_that_raises_fails_its_own_caller_only() -> None:
    def write(key: str, buffers: Iterable[Buffer], nbytes: int | None) -> bool:
        if key == "bad":
            raise ValueError("the record is not the bytes promised")
        return True

    pool = ThreadPoolExecutor(1, "w")
    jobs = WriteJobs(write, pool, threads=1)
    try:
        got = await asyncio.gather(
            jobs.put("a", [b"x"]),
            jobs.put("bad", [b"x"]),
            jobs.put("b", [b"x"]),
            return_exceptions=True,
        )
    finally:
        pool.shutdown(wait=True)
    assert got[0] is True and got[2] is True
    assert isinstance(got[1], ValueError)


async def test_writes_after_the_pool_is_shut_down_fail_with_a_runtime_error() -> None:
    pool = ThreadPoolExecutor(1, "w")
    pool.shutdown(wait=True)
    jobs = WriteJobs(lambda k, b, n: True, pool, threads=1)
    with pytest.raises(RuntimeError):
        await jobs.put("a", [b"x"])


async def test_a_waiting_thread_runs_the_newest_queued_job_itself() -> None:
    gate = threading.Event()
    ran: list[tuple[str, str]] = []

    def write(key: str, buffers: Iterable[Buffer], nbytes: int | None) -> bool:
        if key == "first":
            gate.wait(10)  # the one writer thread is held on this
        ran.append((key, threading.current_thread().name))
        return True

    pool = ThreadPoolExecutor(1, "w")
    jobs = WriteJobs(write, pool, threads=1)
    try:
        first = asyncio.ensure_future(jobs.put("first", [b"x"]))
        await asyncio.sleep(0.05)  # handed over: the writer holds it
        later = [asyncio.ensure_future(jobs.put(f"k{i}", [b"x"])) for i in range(3)]
        await asyncio.sleep(0.05)  # queued behind it
        helped = await asyncio.to_thread(lambda: (jobs.help(), jobs.help()))
        assert helped == (True, False)  # the one queued job, then none
        assert await asyncio.gather(*later) == [True] * 3
        gate.set()
        assert await first
    finally:
        gate.set()
        pool.shutdown(wait=True)
    helpers = {t for k, t in ran if k != "first"}
    assert helpers and not any(t.startswith("w") for t in helpers)


async def test_the_store_has_no_write_to_help_with_when_none_is_queued(tmp_path: Path) -> None:
    cfg = {"tiers": [{"type": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 20}]}
    store = await open_store(cfg)
    try:
        assert store.help_writes() is False
        assert await store.put_object("a", b"x" * 10)
        assert store.help_writes() is False  # written already
    finally:
        await store.close()


# ------------------------------------------------------------------ the disk tier's writes


def test_skip_drops_the_bytes_a_short_write_wrote() -> None:
    views = [memoryview(b"abc"), memoryview(b"de"), memoryview(b"fghi")]
    assert skip(views, 4) == 4
    assert b"".join(views) == b"efghi"
    assert skip(views, 100) == 5 and views == []


def test_write_all_writes_every_byte_through_a_pipe_that_takes_little_at_a_time() -> None:
    r, w = os.pipe()
    data = os.urandom(1 << 20)  # far more than a pipe holds: writev returns short
    views = [memoryview(data)[i : i + 3000] for i in range(0, len(data), 3000)][:512]
    want = b"".join(views)
    got = bytearray()

    def drain() -> None:
        while chunk := os.read(r, 1 << 16):
            got.extend(chunk)

    t = threading.Thread(target=drain)
    t.start()
    try:
        write_all(w, list(views))
    finally:
        os.close(w)
        t.join()
        os.close(r)
    assert bytes(got) == want


@pytest.mark.parametrize("how", ["list_with_size", "list", "iterator", "typed_views"])
async def test_an_object_of_many_small_buffers_is_written_whole(tmp_path: Path, how: str) -> None:
    tier = DiskTier(DiskTierConfig(path=str(tmp_path), capacity_bytes=1 << 30))
    await tier.open()
    try:
        parts: list[Buffer] = [os.urandom(1 + 97 * i) for i in range(120)]
        if how == "typed_views":  # not bytes: views of another format
            parts = [memoryview(torch.randn(33).to(torch.float16).numpy()) for _ in range(20)]
        want = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
        if how == "list_with_size":
            ok = await tier._put("k", parts, len(want))
        elif how == "iterator":
            ok = await tier._put("k", iter(parts))
        else:
            ok = await tier.put("k", parts)
        assert ok
        assert bytes(await tier.get("k") or b"") == want
    finally:
        await tier.close()


# ------------------------------------------------------------------ PageIO


def host_pool(layout: str, pages: int, dtype: torch.dtype) -> torch.Tensor:
    """A host ``kv_buffer`` of SGLang's shape for ``layout`` (random bytes)."""
    shape = {
        "layer_first": (2, L, pages * P, H, D),
        "page_first": (2, pages * P, L, H, D),
        "page_first_direct": (2, pages, L, P, H, D),
        "page_head": (2, pages, H, P, L, D),
    }[layout]
    return torch.randn(shape).to(dtype)


def codec_for(layout: str, dtype: torch.dtype = torch.bfloat16) -> PageCodec:
    """The codec the backend builds for a host pool in ``layout``."""
    return PageCodec(L, H, D, P, dtype, token_major=layout in TOKEN_MAJOR)


def storage_of(kv: torch.Tensor) -> memoryview:
    return memoryview(torch.empty(0, dtype=torch.uint8).set_(kv.untyped_storage()).numpy())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_direct_pools_are_the_pages_own_bytes_where_each_pool_is_contiguous(layout: str) -> None:
    codec = codec_for(layout)
    kv = host_pool(layout, 3, torch.bfloat16)
    page = page_view(kv, layout, P, 2 * P)
    pools = codec.direct_pools(page, storage_of(kv))
    if layout == "page_head":
        assert pools is None  # a pool is spread over the page: copied into staging
        return
    assert pools is not None
    if layout == "page_first":  # token-major: the page's K, then its V, all layers
        assert len(pools) == 2
        for r in (0, 1):
            want = page[r].permute(1, 0, 2, 3).contiguous().view(torch.uint8)
            assert bytes(pools[r]) == want.numpy().tobytes()
        return
    assert len(pools) == 2 * L
    for li in range(L):
        for r in (0, 1):
            want = page[r, li].contiguous().view(torch.uint8).numpy().tobytes()
            assert bytes(pools[2 * li + r]) == want


def test_a_token_major_codec_refuses_a_per_layer_page_and_the_other_way_round() -> None:
    kv = host_pool("layer_first", 2, torch.bfloat16)
    page = page_view(kv, "layer_first", P, 0)
    assert codec_for("page_first").direct_pools(page, storage_of(kv)) is None
    tm = host_pool("page_first", 2, torch.bfloat16)
    page = page_view(tm, "page_first", P, P)
    assert codec_for("layer_first").direct_pools(page, storage_of(tm)) is None


def test_a_token_major_page_object_is_one_key_and_one_value_descriptor_in_token_order() -> None:
    import hurray

    codec = codec_for("page_first", torch.float32)
    kv = host_pool("page_first", 2, torch.float32)
    page = page_view(kv, "page_first", P, P)
    pools = codec.direct_pools(page, storage_of(kv))
    assert pools is not None
    raw = b"".join(bytes(b) for b in codec.encode(pools, page_fingerprint("x", "k")))
    assert len(raw) == codec.size
    tensors = list(hurray.StreamReader(raw))
    assert len(tensors) == 3  # K, V, then the record
    assert [t.layout.kv_role for t in tensors[:2]] == ["key", "value"]
    for r in (0, 1):
        assert tuple(tensors[r].shape) == (P, L * H, D)  # one page of every layer's heads
        pool = torch.from_dlpack(tensors[r].buffer(0)).view(torch.float32).view(P, L * H, D)
        assert torch.equal(pool, kv[r, P : 2 * P].reshape(P, L * H, D))


def test_direct_pools_refuses_a_page_of_another_dtype_or_shape() -> None:
    codec = PageCodec(L, H, D, P, torch.bfloat16)
    kv = host_pool("layer_first", 2, torch.float16)
    storage = memoryview(torch.empty(0, dtype=torch.uint8).set_(kv.untyped_storage()).numpy())
    assert codec.direct_pools(page_view(kv, "layer_first", P, 0), storage) is None
    other = PageCodec(L, H, D, 2 * P, torch.float16)  # pages of 8 tokens
    assert other.direct_pools(page_view(kv, "layer_first", P, 0), storage) is None
    short = storage[: len(storage) // 2]  # not the whole storage: out of its bounds
    fp16 = PageCodec(L, H, D, P, torch.float16)
    assert fp16.direct_pools(page_view(kv, "layer_first", P, P), short) is None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_written_by_page_io_read_back_bit_exact(tmp_path: Path, layout: str) -> None:
    codec = codec_for(layout)
    n = 40  # more than one step of SET_STEP pages
    kv = host_pool(layout, n, torch.bfloat16)
    disk = {"type": "disk", "path": str(tmp_path / "d"), "capacity_bytes": 1 << 30}
    port = EnginePort({"tiers": [disk]}, name="t")
    counts = {"pages_written": 0, "pages_deduplicated": 0, "pages_read": 0, "pages_rejected": 0}
    errors: list[BaseException] = []
    io = PageIO(port, codec, "prefix", counts, lambda what, e: errors.append(e))
    try:
        keys = [f"p{i}" for i in range(n)]
        srcs = [page_view(kv, layout, P, i * P) for i in range(n)]
        assert io.write_pages(keys, srcs) == [True] * n
        assert errors == [] and counts["pages_written"] == n
        # Written from the host pool where its pools are contiguous: no staging copy.
        assert (io._set_staging is None) == (layout != "page_head")
        want = kv.clone()
        kv.zero_()
        assert io.read_pages(keys, [page_view(kv, layout, P, i * P) for i in range(n)]) == n
        assert torch.equal(kv, want)
        # Each object is the page's: its record checks against its own name only.
        obj = memoryview(port.call(port.store.get_object(io.name_of("p7"))))
        rec = obj[codec.size - codec.record_bytes :]
        assert codec.check(rec, page_fingerprint("prefix", "p7"), codec.pool_sums(obj)) == ""
        assert codec.check(rec, page_fingerprint("prefix", "p8"), codec.pool_sums(obj)) != ""
    finally:
        port.close()
