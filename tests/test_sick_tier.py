"""An engine on a store whose tier hangs or is down (issue V items 2 and 3): a real cache
server SIGSTOPped under engine ports. No lookup or load waits past ``engine.wait_s``
(the bounds below are the tier's own timeout, which the engine used to wait at every
probe: a hang guard, not a speed threshold), a tier that is down counts nothing, and
everything comes back when the server does."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hurray_store.engine import EnginePort
from tests.server_helpers import ServerProc

TIMEOUT_S = 3.0  # the remote tier's own timeout: what a call used to wait
ITEMS = {f"obj-{i}": bytes([i]) * 4096 for i in range(4)}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProc]:
    s = ServerProc(tmp_path / "srv").start()
    yield s
    s.resume()
    s.kill()


def _port(server: ServerProc, **engine: Any) -> EnginePort:
    return EnginePort(
        {
            "tiers": [server.tier(timeout_s=TIMEOUT_S)],
            "engine": {"wait_s": 0.2, **engine},
        }
    )


def _timed(fn: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    got = fn()
    return got, time.monotonic() - t0


def _until(cond: Any, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "not in time"
        time.sleep(0.05)


def _load(port: EnginePort, names: list[str]) -> list[bytes]:
    out: list[bytes] = []

    def take(j: int, t: torch.Tensor) -> None:
        out.append(bytes(t.numpy()))

    port.load(names, 4096, lambda j, b: "", take)
    return out


def test_a_hung_server_costs_an_engine_one_bound_then_misses_at_once_until_it_is_back(
    server: ServerProc,
) -> None:
    """A second engine (its ledger knows nothing: it asks the server) finds the objects;
    the server hangs: the next lookup is a miss after ``wait_s`` (the call goes on,
    late), every lookup and load meanwhile is a miss at once, then the tier is down and
    they stay misses at once; the server resumes: the tier's probe brings it back and
    the objects are found and loaded, byte for byte."""
    writer, reader = _port(server), _port(server)
    try:
        names = list(ITEMS)
        assert writer.save_lent([list(ITEMS.items())]) == [True] * 4
        assert reader.lookup(names).n == 4
        server.pause()
        held, took = _timed(lambda: reader.lookup(names))
        assert held.n == 0 and took < TIMEOUT_S / 2
        assert reader.bound.counts["calls_late"] == 1
        longest, end = 0.0, time.monotonic() + TIMEOUT_S + 1.0  # past the late call's end
        while time.monotonic() < end:
            (h, loaded), took = _timed(lambda: (reader.lookup(names), _load(reader, names)))
            assert h.n == 0 and loaded == []
            longest = max(longest, took)
            time.sleep(0.05)
        assert longest < TIMEOUT_S / 2, "a call waited on the hung server"
        assert reader.bound.counts["calls_late"] == 1, "only the first call went late"
        assert reader.bound.counts["missed_while_late"] >= 1
        assert not reader.store.tiers[0].available, "the late call ended the tier's wait"
        # The writer's ledger holds them in the remote tier. Its load finds the hang (a
        # miss after the bound); once its tier is down, it counts nothing (it used to
        # promise all four while every get failed).
        assert _load(writer, names) == []
        _until(lambda: not writer.store.tiers[0].available)
        assert writer.lookup(names).n == 0
        assert writer.held_each(names) == [False] * 4
        server.resume()
        _until(lambda: reader.store.tiers[0].available)
        assert reader.lookup(names).n == 4 and writer.lookup(names).n == 4
        assert _load(reader, names) == list(ITEMS.values())
        stats = reader.stats()["port"]
        assert stats["calls_late"] == 1 and stats["missed_while_late"] >= 1
    finally:
        server.resume()
        writer.close()
        reader.close()


def test_a_lookup_that_pinned_after_its_bound_lets_its_pins_go_when_it_ends(
    server: ServerProc,
) -> None:
    """A pinning lookup that went late: the engine got a miss, so the pins its call
    takes when it finally ends are given back (nothing stays pinned for good)."""
    writer, reader = _port(server), _port(server)
    try:
        names = list(ITEMS)
        assert writer.save_lent([list(ITEMS.items())]) == [True] * 4
        server.pause()
        assert reader.lookup(names, pin=True).n == 0
        server.resume()  # the late call now ends: answered, its pins taken
        _until(lambda: not reader.bound.late)
        _until(lambda: reader.lookup(names).n == 4)
        led, objs = reader.store.ledger, reader.store.objects
        assert not any(led.is_pinned(g) for g in objs._groups(names)), "late pins kept"
    finally:
        server.resume()
        writer.close()
        reader.close()


def test_a_vllm_load_from_a_hung_server_is_abandoned_after_the_bound_and_writes_nothing(
    server: ServerProc,
) -> None:
    """vLLM's forward waits for each layer of a step's load at most the bound: the
    server hangs, the first layer does not come, the load is abandoned (every later
    layer's wait returns at once, the load delivered nothing, so vLLM recomputes its
    blocks), and when the server resumes and the late read ends, not one layer is
    written into vLLM's blocks."""
    from hurray_store.adapters.vllm.transfer import BlockTransfers, Transfer
    from tests.test_vllm_transfer import L, _filled, _prompt, _spec

    sp = _spec(torch.bfloat16)
    src = _filled("LBNHC", sp.dtype, 8, seed=3)
    prompt = _prompt(3, 4)
    saver, loader = _port(server), _port(server)
    try:
        xfer = BlockTransfers(saver, sp, src, "LBNHC")
        xfer.save([Transfer("a", prompt, [1, 4, 6], 0, b"s")])
        assert xfer.drain(30) and xfer.counts["blocks_saved"] == 3
        dst = _filled("LBNHC", sp.dtype, 8, seed=5)
        before = [v.clone() for v in dst]
        xfer2 = BlockTransfers(loader, sp, dst, "LBNHC")
        server.pause()
        loading = xfer2.start_load([Transfer("a", prompt, [0, 2, 3], 0, b"s")])
        wait = loader.bound.limit(loading.layer_bytes)
        assert wait < TIMEOUT_S / 2
        oks, took = _timed(lambda: [xfer2.wait_layer(loading, li, wait) for li in range(L)])
        assert oks == [False] * L and loading.abandoned and took < TIMEOUT_S / 2
        assert xfer2.finish_load(loading, 30) == [0]
        assert loading.future is not None
        loader.bound.went_late(loading.future)  # as the connector does
        assert loader.lookup_tokens([sp], prompt, b"s") == 0, "a miss while it is late"
        server.resume()
        loading.future.result(30)  # the late read ends (its tier timed out, or it read)
        assert all(torch.equal(x, y) for x, y in zip(before, dst, strict=True))
        _until(lambda: loader.store.tiers[0].available)
        _until(lambda: loader.lookup_tokens([sp], prompt, b"s") == 3 * sp.page_size)
    finally:
        server.resume()
        saver.close()
        loader.close()


def test_a_ranged_read_from_a_hung_server_is_a_miss_after_the_bound_and_writes_nothing(
    server: ServerProc,
) -> None:
    """The port's ranged reads (LMCache's gets) on a hung server: a miss after the bound,
    and the caller's buffers stay as they were, even when the late read ends after the
    server resumes; with the server back, the same read delivers the bytes."""
    writer, reader = _port(server), _port(server)
    try:
        assert writer.save_lent([list(ITEMS.items())]) == [True] * 4
        assert reader.lookup(list(ITEMS)).n == 4  # the reader asked the server: it knows
        into = memoryview(bytearray(b"\xee" * 1024))
        server.pause()
        got, took = _timed(lambda: reader.read([("obj-1", [(0, 1024)], [into])]))
        assert got == [False] and took < TIMEOUT_S / 2
        server.resume()
        _until(lambda: not reader.bound.late)
        assert bytes(into) == b"\xee" * 1024, "a late read wrote into the caller's buffer"
        _until(lambda: reader.store.tiers[0].available)
        _until(lambda: reader.read([("obj-1", [(0, 1024)], [into])]) == [True])
        assert bytes(into) == ITEMS["obj-1"][:1024]
    finally:
        server.resume()
        writer.close()
        reader.close()
