"""``hurray_store.adapters.vllm.transfer``: the vLLM connector's data path without vLLM,
on KV views built as vLLM builds them (``tests.test_vllm_layout``), against real stores
(a disk folder, a real redis-server).

- A step's saves, written behind the caller, read back by another store and loaded into
  other blocks of other views: exact, in every layout, with the CPU packing too.
- ``save`` returns before the store has written: with a real Redis whose writes are held
  (``CLIENT PAUSE ... WRITE``), another store finds nothing until they are released,
  then everything.
- The backlog bound: saves past it drop the oldest waiting ones (counted), never block,
  and never hold more than the bound; what was not dropped lands.
- A load the store cannot deliver reports the tokens it did deliver (none); a store that
  cannot write loses the save, never raising into the engine.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from hurray_store import KVSpec
from hurray_store.adapters.vllm.layout import LAYOUTS
from hurray_store.adapters.vllm.transfer import BlockTransfers, Transfer
from hurray_store.engine import EnginePort
from hurray_store.testing.services import RedisProc
from tests.test_vllm_layout import _views

BS, H, D, L = 16, 2, 8, 3


def _spec(dtype: torch.dtype = torch.float32) -> KVSpec:
    return KVSpec("transfer-test", L, H, D, BS, dtype)


def _filled(layout: str, dtype: torch.dtype, blocks: int, seed: int) -> list[torch.Tensor]:
    views, _ = _views(layout, dtype, L, blocks, H, BS, 2 * D)
    g = torch.Generator().manual_seed(seed)
    for v in views:
        v.copy_(torch.randn(v.shape, generator=g).to(dtype))
    return views


def _prompt(n_blocks: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 30000, (n_blocks * BS,), generator=g).tolist()


def _wait(cond: Any, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


@pytest.fixture
def disk_cfg(tmp_path: Path) -> dict[str, Any]:
    folder = {"type": "disk", "path": str(tmp_path / "disk"), "capacity_bytes": 1 << 30}
    return {"namespace": "xfer", "tiers": [{"type": "cpu", "capacity_bytes": 1 << 28}, folder]}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_saved_blocks_load_into_other_blocks_of_other_views_exactly(
    layout: str, disk_cfg: dict[str, Any]
) -> None:
    sp = _spec(torch.bfloat16)
    src = _filled(layout, sp.dtype, 12, seed=1)
    a, b = _prompt(3, 1), _prompt(2, 2)
    st = EnginePort(disk_cfg, name="saver", saves_in_flight=1)
    try:
        xfer = BlockTransfers(st, sp, src, layout)
        xfer.save([Transfer("a", a, [7, 2, 9], 0, b"s"), Transfer("b", b, [4, 11], 0, b"s")])
        assert xfer.drain(30) and xfer.counts["blocks_saved"] == 5
    finally:
        st.close()
    # Another process's store (a fresh one on the folder) loads them into other views.
    other = EnginePort(disk_cfg, name="loader", saves_in_flight=1)
    try:
        dst = _filled("LBNHC" if layout != "LBNHC" else "BHLNC", sp.dtype, 10, seed=2)
        before = [v.clone() for v in dst]
        xfer2 = BlockTransfers(other, sp, dst, "LBNHC" if layout != "LBNHC" else "BHLNC")
        # b's request already holds its first block (vLLM's own hit): load from block 1.
        loading = xfer2.start_load(
            [Transfer("a", a, [0, 5, 3], 0, b"s"), Transfer("b", b, [8, 1], 1, b"s")]
        )
        for li in range(L):
            assert xfer2.wait_layer(loading, li, 30)
        assert xfer2.finish_load(loading, 30) == [3 * BS, 2 * BS]
        for s_v, d_v, old in zip(src, dst, before, strict=True):
            for s_b, d_b in [(7, 0), (2, 5), (9, 3), (11, 1)]:
                assert torch.equal(d_v[d_b], s_v[s_b])
            for untouched in [2, 4, 6, 7, 8, 9]:
                assert torch.equal(d_v[untouched], old[untouched])
        # Another salt: nothing delivered, nothing written.
        again = [v.clone() for v in dst]
        miss = xfer2.start_load([Transfer("c", a, [4, 6, 7], 0, b"t")])
        assert xfer2.finish_load(miss, 30) == [0]
        assert all(torch.equal(x, y) for x, y in zip(again, dst, strict=True))
    finally:
        other.close()


def test_the_cpu_packing_within_c_is_undone_on_save_and_redone_on_load(
    disk_cfg: dict[str, Any],
) -> None:
    sp = _spec()
    n = BS * D
    g = torch.Generator().manual_seed(3)
    packed_of = torch.stack([torch.randperm(n, generator=g) for _ in "kv"])
    packing = (packed_of, torch.argsort(packed_of, dim=-1))
    src = _filled("LBHNC", sp.dtype, 6, seed=4)
    p = _prompt(2, 5)
    st = EnginePort(disk_cfg, name="packed", saves_in_flight=1)
    try:
        xfer = BlockTransfers(st, sp, src, "LBHNC", packing=packing)
        xfer.save([Transfer("p", p, [5, 1], 0, b"")])
        assert xfer.drain(30)
        plain = BlockTransfers(st, sp, _filled("LBHNC", sp.dtype, 4, seed=6), "LBHNC")
        got = plain.start_load([Transfer("p", p, [2, 3], 0, b"")])
        assert plain.finish_load(got, 30) == [2 * BS]
        for li, (s_v, d_v) in enumerate(zip(src, plain.views, strict=True)):
            for s_b, d_b in [(5, 2), (1, 3)]:
                # The stored page is the unpacked block: token-major K then V.
                x = s_v[s_b].reshape(H, 2, n)
                logical = x.gather(-1, packing[1].expand(x.shape)).view(H, 2, BS, D)
                want = torch.cat([logical[:, 0], logical[:, 1]], dim=-1)
                assert torch.equal(d_v[d_b], want), li
        # Loaded back through the packing: the packed bytes again.
        back = _filled("LBHNC", sp.dtype, 4, seed=7)
        repack = BlockTransfers(st, sp, back, "LBHNC", packing=packing)
        assert repack.finish_load(repack.start_load([Transfer("p", p, [0, 2], 0, b"")]), 30)
        for s_v, d_v in zip(src, back, strict=True):
            assert torch.equal(d_v[0], s_v[5]) and torch.equal(d_v[2], s_v[1])
    finally:
        st.close()


@pytest.fixture
def paused_redis(redis_server: RedisProc) -> Any:
    """A redis-py client of the session's redis-server; writes are released at the end."""
    r = redis.Redis.from_url(redis_server.url)
    yield r
    r.execute_command("CLIENT", "UNPAUSE")
    r.close()


def _redis_cfg(url: str) -> dict[str, Any]:
    tier = {"type": "redis", "url": url, "key_prefix": f"x-{uuid.uuid4().hex[:8]}:"}
    tier["timeout_s"] = 60.0
    return {"namespace": "xfer", "tiers": [{"type": "cpu", "capacity_bytes": 1 << 28}, tier]}


def _peer_lookup(cfg: dict[str, Any], sp: KVSpec, p: list[int]) -> int:
    """What another instance opened now finds (a store on the same Redis: it learns
    what Redis holds when it opens)."""
    peer = EnginePort({**cfg, "tiers": [cfg["tiers"][1]]}, name="peer", saves_in_flight=1)
    try:
        (n,) = peer.call(peer.store.lookup(sp, [p]))
        return n
    finally:
        peer.close()


def test_save_returns_before_the_store_writes_and_others_see_only_what_is_committed(
    redis_server: RedisProc, paused_redis: Any
) -> None:
    cfg = _redis_cfg(redis_server.url)
    sp = _spec()
    p = _prompt(4, 8)
    st = EnginePort(cfg, name="held", saves_in_flight=1)
    try:
        xfer = BlockTransfers(st, sp, _filled("LBNHC", sp.dtype, 8, seed=9), "LBNHC")
        paused_redis.execute_command("CLIENT", "PAUSE", "60000", "WRITE")
        xfer.save([Transfer("p", p, [1, 3, 5, 7], 0, b"")])  # returns: the writes wait
        assert xfer.pending_bytes() == 4 * xfer.page_bytes
        time.sleep(0.5)  # the writer is held in Redis, not merely not yet started
        assert _peer_lookup(cfg, sp, p) == 0
        assert xfer.pending_bytes() == 4 * xfer.page_bytes  # not committed yet
        paused_redis.execute_command("CLIENT", "UNPAUSE")
        assert xfer.drain(60) and xfer.pending_bytes() == 0
        assert xfer.counts["blocks_saved"] == 4 and xfer.counts["saves_failed"] == 0
        assert _peer_lookup(cfg, sp, p) == 4 * BS
    finally:
        paused_redis.execute_command("CLIENT", "UNPAUSE")
        st.close()


def test_a_full_backlog_drops_the_oldest_saves_counts_them_and_never_blocks(
    redis_server: RedisProc, paused_redis: Any
) -> None:
    cfg = _redis_cfg(redis_server.url)
    sp = _spec()
    prompts = [_prompt(2, 20 + i) for i in range(6)]
    step = 2 * 2 * BS * H * D * 4 * L  # one save: 2 pages of every layer's K and V
    # the port's save backlog, as the connector opens it: one writer, a bound of 3 saves
    st = EnginePort(cfg, name="bounded", saves_in_flight=1, save_backlog_bytes=3 * step)
    try:
        views = _filled("LBHNC", sp.dtype, 16, seed=10)
        xfer = BlockTransfers(st, sp, views, "LBHNC")
        assert xfer.page_bytes * 2 == step
        paused_redis.execute_command("CLIENT", "PAUSE", "60000", "WRITE")
        xfer.save([Transfer("r0", prompts[0], [0, 1], 0, b"")])
        _wait(lambda: xfer.queued() == 0)  # the writer took save 0 and is held in Redis
        for i in range(1, 6):
            xfer.save([Transfer(f"r{i}", prompts[i], [2 * i, 2 * i + 1], 0, b"")])
            assert xfer.pending_bytes() <= 3 * step
        # Save 0 in flight, 1..5 queued in a bound of 3: 1, 2 and 3 were dropped; every
        # save returned while nothing could be written (none waited for the store).
        assert xfer.counts["saves_dropped"] == 3 and xfer.pending_bytes() == 3 * step
        # A save larger than the whole bound is dropped by itself.
        big = Transfer("big", _prompt(8, 40), list(range(8, 16)), 0, b"")
        xfer.save([big])
        assert xfer.counts["saves_dropped"] == 4
        paused_redis.execute_command("CLIENT", "UNPAUSE")
        assert xfer.drain(60)
        found = st.call(st.store.lookup(sp, prompts + [big.token_ids]))
        assert found == [2 * BS, 0, 0, 0, 2 * BS, 2 * BS, 0]
        assert xfer.counts["blocks_saved"] == 6 and xfer.pending_bytes() == 0
    finally:
        paused_redis.execute_command("CLIENT", "UNPAUSE")
        st.close()


def test_a_store_that_cannot_write_loses_the_save_and_misses_the_load_never_raising(
    tmp_path: Path,
) -> None:
    port = 1  # nothing listens there: every write to this Redis fails
    tier = {"type": "redis", "url": f"redis://127.0.0.1:{port}", "timeout_s": 0.5}
    st = EnginePort({"namespace": "xfer", "tiers": [tier]}, name="down", saves_in_flight=1)
    sp = _spec()
    try:
        xfer = BlockTransfers(st, sp, _filled("LBHNC", sp.dtype, 4, seed=11), "LBHNC")
        p = _prompt(2, 12)
        xfer.save([Transfer("p", p, [0, 1], 0, b"")])
        assert xfer.drain(30)
        assert xfer.counts["blocks_saved"] == 0
        loading = xfer.start_load([Transfer("p", p, [2, 3], 0, b"")])
        assert xfer.finish_load(loading, 30) == [0]
    finally:
        st.close()


def test_views_that_are_not_in_the_layout_named_are_refused(disk_cfg: dict[str, Any]) -> None:
    sp = _spec()
    st = EnginePort(disk_cfg, name="refused", saves_in_flight=1)
    try:
        views = _filled("LBNHC", sp.dtype, 4, seed=13)  # tokens outside heads
        with pytest.raises(ValueError, match="not in layout LBHNC"):
            BlockTransfers(st, sp, views, "LBHNC")
        with pytest.raises(ValueError, match="2 KV layer views"):
            BlockTransfers(st, sp, views[:2], "LBNHC")
    finally:
        st.close()


def test_a_later_steps_save_copies_only_its_new_blocks(disk_cfg: dict[str, Any]) -> None:
    """Chunked prefill: a request's first step saves blocks 0-1; its next step copies out
    only blocks 2-3 (the copy is sized by them) and the whole prompt loads exactly. A
    save whose earlier block the store does not hold (another salt here) writes nothing
    (its blocks could never be reached) and says so."""
    sp = _spec()
    src = _filled("LBNHC", sp.dtype, 8, seed=5)
    p = _prompt(4, 5)
    st = EnginePort(disk_cfg, name="chunks", saves_in_flight=1)
    try:
        xfer = BlockTransfers(st, sp, src, "LBNHC")
        sizes: list[int] = []
        copy_out = xfer.copy_out
        xfer.copy_out = lambda ids: (sizes.append(len(ids)), copy_out(ids))[1]  # type: ignore[method-assign]
        xfer.save([Transfer("r", p[: 2 * BS], [6, 1, 4, 3], 0, b"")])
        xfer.save([Transfer("r", p, [6, 1, 4, 3], 2, b"")])
        xfer.save([Transfer("q", p, [6, 1, 4, 3], 2, b"other")])
        assert xfer.drain(30)
        assert sizes == [2, 2, 2], "each step copies only its new blocks"
        assert xfer.counts["blocks_saved"] == 4 and xfer.counts["blocks_unreachable"] == 2
        dst = _filled("LBNHC", sp.dtype, 8, seed=6)
        xfer2 = BlockTransfers(st, sp, dst, "LBNHC")
        loading = xfer2.start_load([Transfer("r", p, [0, 2, 5, 7], 0, b"")])
        assert xfer2.finish_load(loading, 30) == [4 * BS]
        for s_v, d_v in zip(src, dst, strict=True):
            for s_b, d_b in [(6, 0), (1, 2), (4, 5), (3, 7)]:
                assert torch.equal(d_v[d_b], s_v[s_b])
        miss = xfer2.start_load([Transfer("q", p, [0, 2, 5, 7], 0, b"other")])
        assert xfer2.finish_load(miss, 30) == [0]
    finally:
        st.close()
