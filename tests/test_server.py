"""The cache server, as run: `hurray-store serve` processes on loopback ports, engine
processes and raw sockets as clients. No part is mocked."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import hurray
import pytest

from hurray_store import PagedKVPool
from hurray_store import keys as keymod
from hurray_store import transport as tp
from hurray_store.config import load_config
from hurray_store.store import TieredStore
from tests import server_client as sc
from tests.server_helpers import ROOT, Raw, ServerProc

TOKEN = "s3cret-token"
Err, Msg = tp.Err, tp.Msg


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """One server for the module; a short request timeout for the truncation test."""
    s = ServerProc(
        tmp_path_factory.mktemp("server"), token=TOKEN, request_timeout_s=1.0, hello_timeout_s=2.0
    ).start()
    yield s
    s.kill()


@pytest.fixture
def bystander(server: ServerProc) -> Iterator[Raw]:
    """A well-behaved client, connected before the misbehaving one: it must be served
    throughout."""
    r = Raw(server.port)
    kind, _, _ = r.hello(TOKEN)
    assert kind == Msg.SERVER_HELLO
    assert r.put("bystander-object", b"x" * 1000)[0] == Msg.TENSOR_PUT_ACK
    yield r
    assert r.ping(), "the other client's connection still works"
    assert r.get("bystander-object") == b"x" * 1000, "and it is still served"
    r.close()


def _clients(server: ServerProc, n: int, *args: str) -> list[dict]:
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.server_client",
                "--url",
                server.url,
                "--token",
                TOKEN,
                "--client",
                str(c),
                *args,
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for c in range(n)
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr.decode()[-3000:]
        out.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    return out


# ----------------------------------------------------------------------------- clients


def test_three_client_processes_share_pages_through_one_server(tmp_path: Path) -> None:
    srv = ServerProc(tmp_path / "srv", token=TOKEN).start()
    try:
        rounds = 4
        # Phase 1: three engines put overlapping batches at once, each reading its own
        # back through a fresh store.
        first = _clients(srv, 3, "--rounds", str(rounds))
        # Phase 2: three fresh engines each read every client's batches.
        second = _clients(srv, 3, "--rounds", str(rounds), "--read-clients", "3")
    finally:
        srv.kill()
    distinct = {
        h
        for c in range(3)
        for seqs in sc.batches(c, rounds)
        for t in seqs
        for h in keymod.page_hashes(sc.SPEC, t)
    }
    assert sum(r["pages_written"] for r in first) == len(distinct), (
        "a page shared across clients is stored once"
    )
    assert sum(r["pages_written"] for r in second) == 0
    for r in first + second:
        assert r["bad_pages"] == 0, (
            f"client {r['client']}: retrieved pages differ from what was put"
        )
        assert r["short"] == 0, f"client {r['client']}: a sequence came back short"
    full = sum(len(t) // 8 * 8 for c in range(3) for seqs in sc.batches(c, rounds) for t in seqs)
    assert all(r["retrieved_tokens"] == full for r in second)


def test_bounded_load_from_several_processes(server: ServerProc) -> None:
    """A fixed amount of work from 3 processes at once; it ends by itself and reports."""
    code = r"""
import asyncio, json, sys, time
from hurray_store.config import load_config
from hurray_store.tiers import open_tier
async def main(url, token, me, n, size):
    cfg = load_config({"tiers": [{"type": "remote", "url": url, "token": token}]}, env={}).tiers[0]
    t = open_tier(cfg); await t.open()
    t0 = time.perf_counter()
    blobs = {f"load/{me}/{i}": bytes([(me * 31 + i) % 251]) * size for i in range(n)}
    oks = await t.put_many(list((k, [v]) for k, v in blobs.items()))
    got = await t.get_many(list(blobs))
    dt = time.perf_counter() - t0
    good = sum(1 for k, g in zip(blobs, got) if g is not None and bytes(g) == blobs[k])
    await t.close()
    print(json.dumps({"puts_ok": sum(oks), "gets_ok": good, "seconds": dt, "bytes": 2 * n * size}))
asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])))
"""
    n, size = 64, 256 << 10
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, server.url, TOKEN, str(me), str(n), str(size)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for me in range(3)
    ]
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()[-2000:]
        reports.append(json.loads(out))
    for r in reports:
        assert r["puts_ok"] == n and r["gets_ok"] == n
    total = sum(r["bytes"] for r in reports)
    slowest = max(r["seconds"] for r in reports)
    print(
        f"\nload: {3 * 2 * n} requests, {total / 2**20:.0f} MiB in {slowest:.2f} s "
        f"({total / slowest / 1e9:.2f} GB/s)"
    )


def test_server_restart_with_disk_tier_clients_reconnect_and_find_every_segment(
    tmp_path: Path,
) -> None:
    srv = ServerProc(tmp_path / "srv", token=TOKEN).start()

    async def main() -> None:
        cfg = load_config(
            {"tiers": [{"type": "gpu", "device": "cpu", "capacity_bytes": 64 << 20}, srv.tier()]},
            env={},
        )
        all_batches = sc.batches(0, 3)
        async with TieredStore(cfg) as engine:
            for seqs in all_batches:
                pool = PagedKVPool(sc.SPEC, 512)
                await engine.put(pool, seqs, sc.fill(pool, seqs))
            await engine.flush()  # every segment committed on the server
            assert srv.stop(signal.SIGTERM) == 0, "graceful shutdown exits 0"
            remote = engine.tiers[1]
            assert not await remote.ping(), "a server that is gone is a miss, not an exception"
            srv.start()
            deadline = time.monotonic() + 10
            while not await remote.ping():
                assert time.monotonic() < deadline, "the client reconnects after its backoff"
                await asyncio.sleep(0.05)
            # The engine that reconnected, and a fresh one, find every committed segment.
            fresh = TieredStore(cfg)
            await fresh.open()
            for store in (engine, fresh):
                for seqs in all_batches:
                    dst = PagedKVPool(sc.SPEC, 512)
                    res = await store.retrieve(dst, seqs)
                    assert res.num_tokens == [len(t) // 8 * 8 for t in seqs]
                    assert sc.check(dst, seqs, res.block_tables, res.num_tokens) == 0
            assert fresh.stats()["tiers"]["remote"]["hits"] > 0, (
                "the fresh engine read from the server"
            )
            await fresh.close()

    try:
        asyncio.run(main())
    finally:
        srv.kill()


def test_engine_store_runs_with_the_server_down(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No server at all: puts land in the local tier, reads miss, nothing raises; when
    the server comes up, writes resume after the backoff."""
    srv = ServerProc(tmp_path / "srv", token=TOKEN)

    async def main() -> None:
        cfg = load_config(
            {
                "tiers": [
                    {"type": "gpu", "device": "cpu", "capacity_bytes": 64 << 20},
                    srv.tier(connect_timeout_s=0.5),
                ]
            },
            env={},
        )
        async with TieredStore(cfg) as engine:
            seqs = sc.batches(0, 1)[0]
            pool = PagedKVPool(sc.SPEC, 512)
            r = await engine.put(pool, seqs, sc.fill(pool, seqs))
            await engine.flush()
            assert r.pages_written > 0
            st = engine.stats()["tiers"]["remote"]
            assert not st["available"] and st["skipped_writes"] >= 1
            assert any("unreachable" in m for m in caplog.messages)
            srv.start()
            await asyncio.sleep(0.6)  # past the backoff
            seqs2 = sc.batches(1, 1)[0]
            pool2 = PagedKVPool(sc.SPEC, 512)
            await engine.put(pool2, seqs2, sc.fill(pool2, seqs2))
            await engine.flush()
            assert engine.stats()["tiers"]["remote"]["bytes_written"] > 0, "writes resumed"

    try:
        asyncio.run(main())
    finally:
        srv.kill()


def test_lookup_promises_nothing_the_server_held_once_it_is_down(tmp_path: Path) -> None:
    """An engine whose only other tier is the server: its pages looked up while the
    server is up; once it is killed, lookup says 0 tokens, as retrieve delivers."""
    srv = ServerProc(tmp_path / "srv", token=TOKEN).start()

    async def main() -> None:
        tier = srv.tier(connect_timeout_s=0.5, timeout_s=1.0, backoff_initial_s=10.0)
        async with TieredStore(load_config({"tiers": [tier]}, env={})) as engine:
            seqs = sc.batches(4, 1)[0]
            pool = PagedKVPool(sc.SPEC, 512)
            await engine.put(pool, seqs, sc.fill(pool, seqs))
            await engine.flush()
            assert all(n > 0 for n in await engine.lookup(sc.SPEC, seqs))
            srv.kill()
            await asyncio.sleep(0.2)  # the engine's connections see the server go
            promised = await engine.lookup(sc.SPEC, seqs)
            got = await engine.retrieve(PagedKVPool(sc.SPEC, 512), seqs)
            assert promised == [0] * len(seqs) == got.num_tokens

    asyncio.run(main())


# ----------------------------------------------------------------------------- protocol


def test_a_plain_level3_client_puts_and_requests_a_tensor(server: ServerProc) -> None:
    """No extension announced: the spec's messages only, and the data comes back as a
    uint8 tensor pyhurray decodes."""
    r = Raw(server.port)
    kind, _, payload = r.hello(TOKEN)
    assert kind == Msg.SERVER_HELLO
    hello = tp.Hello.decode(payload)
    assert (
        hello.version == 1
        and hello.layouts == [0x01]
        and hello.devices == [0x00]
        and hello.capabilities == 0
    )
    data = bytes(range(256)) * 4099
    assert r.put("plain/tensor", data)[0] == Msg.TENSOR_PUT_ACK
    r.send(Msg.TENSOR_REQUEST, 11, tp.encode_request("plain/tensor"))
    kind, sid, payload = r.recv()
    assert (kind, sid) == (Msg.TENSOR_DESCRIPTOR, 11)
    d = hurray.Descriptor.decode(payload)
    assert (
        str(d.dtype) == "uint8"
        and tuple(d.shape) == (len(data),)
        and type(d.layout).__name__ == "RowMajorLayout"
    )
    # The spec's transport fields after the descriptor: total bytes u64, shard u32, shards u32.
    total, shard, shards = struct.unpack("<QII", payload[d.encoded_len :])
    assert (total, shard, shards) == (len(data), 0, 1)
    got = bytearray()
    while (m := r.recv())[0] == Msg.TENSOR_DATA:
        assert m[1] == 11 and tp.DATA_OFFSET.unpack(m[2][:8])[0] == len(got)
        got += m[2][8:]
    assert m[:2] == (Msg.TENSOR_DATA_END, 11) and bytes(got) == data
    assert r.get("no/such/tensor") is None
    assert r.ping()
    r.close()


def test_extension_messages_need_the_extension(server: ServerProc) -> None:
    r = Raw(server.port)
    # A token travels in the extension data, so announce none but the token.
    r.send(Msg.CLIENT_HELLO, 1, tp.Hello(ext={"token": TOKEN}).encode())
    assert r.recv()[0] == Msg.SERVER_HELLO
    r.send(Msg.X_STATS, 3)
    code, _ = r.error()
    assert code == Err.INVALID_MESSAGE and r.is_closed()


def test_unknown_key_and_unserved_device_end_only_their_stream(server: ServerProc) -> None:
    r = Raw(server.port)
    r.hello(TOKEN)
    r.send(Msg.TENSOR_REQUEST, 3, tp.encode_request("missing"))
    assert r.error()[0] == Err.UNKNOWN_TENSOR
    r.send(Msg.TENSOR_REQUEST, 4, tp.encode_request("missing", device=0x01))
    assert r.error()[0] == Err.DEVICE_UNAVAILABLE
    r.send(Msg.TENSOR_REQUEST, 5, tp.encode_request("missing", min_alignment=48))
    assert r.error()[0] == Err.INVALID_MESSAGE
    assert r.ping(), "the connection stays"
    r.close()


def test_stats_over_the_extension(server: ServerProc) -> None:
    r = Raw(server.port)
    r.hello(TOKEN)
    r.send(Msg.X_STATS, 8)
    kind, sid, payload = r.recv()
    assert (kind, sid) == (Msg.X_STATS_REPLY, 8)
    stats = json.loads(payload)
    assert stats["server"]["connections"] >= 1 and "cpu" in stats["tiers"]


def test_http_metrics_and_health(server: ServerProc) -> None:
    base = f"http://127.0.0.1:{server.metrics_port}"
    with urllib.request.urlopen(base + "/healthz", timeout=5) as resp:
        assert resp.status == 200 and resp.read() == b"ok\n"
    with urllib.request.urlopen(base + "/readyz", timeout=5) as resp:
        assert resp.status == 200
    with urllib.request.urlopen(base + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert "hurray_store_server_connections" in text
    assert "hurray_store_server_requests_total" in text
    assert 'hurray_store_tier_bytes{tier="cpu"}' in text


# ----------------------------------------------------------------------------- bad input


def test_garbage_bytes_get_error_and_close(server: ServerProc, bystander: Raw) -> None:
    r = Raw(server.port)
    r.s.sendall(os.urandom(7) + b"\x00\x00\x00\x00\x00" + os.urandom(64))
    code, _ = r.error()
    assert code in (Err.INVALID_MESSAGE, Err.MESSAGE_TOO_LARGE)
    assert r.is_closed()


def test_header_announcing_a_payload_over_the_limit(server: ServerProc, bystander: Raw) -> None:
    r = Raw(server.port)
    r.hello(TOKEN)
    r.s.sendall(tp.HEADER.pack(Msg.TENSOR_REQUEST, 3, 0xFFFFFFF0))
    code, text = r.error()
    assert code == Err.MESSAGE_TOO_LARGE, text
    assert r.is_closed()


def test_truncated_message_times_out_with_error(server: ServerProc, bystander: Raw) -> None:
    r = Raw(server.port)
    r.hello(TOKEN)
    r.s.sendall(
        tp.HEADER.pack(Msg.TENSOR_REQUEST, 3, 100) + b"\x05\x00\x00\x00abc"
    )  # 8 of 100 bytes, then silence
    code, _ = r.error()
    assert code == Err.TIMEOUT
    assert r.is_closed()


def test_truncated_message_then_hang_up(server: ServerProc, bystander: Raw) -> None:
    r = Raw(server.port)
    r.hello(TOKEN)
    r.s.sendall(tp.HEADER.pack(Msg.TENSOR_PUT, 3, 60) + b"\x01\x00")
    r.close()  # mid-message: the server drops the connection and holds nothing for it
    for _ in range(100):
        bystander.send(Msg.X_STATS, 9)
        kind, _, payload = bystander.recv()
        assert kind == Msg.X_STATS_REPLY
        srv = json.loads(payload)["server"]
        # The bystander alone: the hung-up connection is gone; and no budget held (the
        # bystander's own put holds its share until its write-through lands).
        if srv["connections"] == 1 and srv["inflight_put_bytes"] == 0:
            break
        time.sleep(0.05)
    assert srv["connections"] == 1 and srv["inflight_put_bytes"] == 0


def test_unknown_message_type(server: ServerProc, bystander: Raw) -> None:
    r = Raw(server.port)
    r.hello(TOKEN)
    r.send(0x77, 3, b"")
    code, text = r.error()
    assert code == Err.INVALID_MESSAGE and "unknown message type" in text
    assert r.is_closed()


def test_put_without_hello(server: ServerProc, bystander: Raw) -> None:
    r = Raw(server.port)
    r.send(Msg.TENSOR_PUT, 3, tp.encode_put("sneaky", 4))
    code, text = r.error()
    assert code == Err.INVALID_MESSAGE and "CLIENT_HELLO" in text
    assert r.is_closed()


@pytest.mark.parametrize("token", ["wrong-token", "", None], ids=["wrong", "empty", "absent"])
def test_wrong_or_missing_token(server: ServerProc, bystander: Raw, token: str | None) -> None:
    r = Raw(server.port)
    kind, _, payload = r.hello(token, ext=token is not None)
    assert kind == Msg.ERROR
    assert tp.decode_error(memoryview(payload)).code == Err.AUTH_FAILED
    assert r.is_closed()


def test_data_frame_at_the_wrong_offset(server: ServerProc, bystander: Raw) -> None:
    r = Raw(server.port)
    r.hello(TOKEN)
    r.send(Msg.TENSOR_PUT, 3, tp.encode_put("gappy", 8))
    r.send(Msg.TENSOR_DATA, 3, tp.DATA_OFFSET.pack(4) + b"abcd")
    assert r.error()[0] == Err.INVALID_MESSAGE
    assert r.is_closed()


def test_object_over_the_limit_is_refused_on_its_stream(tmp_path: Path) -> None:
    srv = ServerProc(
        tmp_path / "srv", max_object_bytes=1 << 20, max_inflight_put_bytes=2 << 20
    ).start()
    try:
        r = Raw(srv.port)
        r.hello()
        big = b"z" * ((1 << 20) + 1)
        kind, _, payload = r.put("too/big", big)
        assert (
            kind == Msg.ERROR and tp.decode_error(memoryview(payload)).code == Err.MESSAGE_TOO_LARGE
        )
        assert r.put("fits", b"z" * 1000)[0] == Msg.TENSOR_PUT_ACK, "the connection stays"
    finally:
        srv.kill()


def test_empty_puts_are_not_free(tmp_path: Path) -> None:
    """Each object in flight costs its key and a fixed overhead besides its bytes: staged
    zero-byte objects run out of budget (BUSY) instead of growing without bound."""
    srv = ServerProc(
        tmp_path / "srv",
        max_object_bytes=4096,
        max_inflight_put_bytes=64 << 10,
        request_timeout_s=0.2,
    ).start()
    try:
        r = Raw(srv.port)
        r.hello()
        kinds = [r.put(f"hurray/s/{{{i:032x}}}/0", b"", sid=1 + 2 * i)[0] for i in range(70)]
        acks = kinds.count(Msg.TENSOR_PUT_ACK)
        assert 0 < acks < 64 and kinds.count(Msg.ERROR) == 70 - acks, kinds
    finally:
        srv.kill()


def test_connection_limit(tmp_path: Path) -> None:
    srv = ServerProc(tmp_path / "srv", max_connections=2).start()
    try:
        a, b = Raw(srv.port), Raw(srv.port)
        assert a.hello()[0] == Msg.SERVER_HELLO and b.hello()[0] == Msg.SERVER_HELLO
        c = Raw(srv.port)
        c.send(Msg.CLIENT_HELLO, 1, tp.Hello(ext={"extensions": tp.EXTENSION}).encode())
        assert c.error()[0] == Err.BUSY and c.is_closed()
        assert a.ping() and b.ping()
    finally:
        srv.kill()


def test_connections_that_never_say_hello_cannot_lock_a_client_out(tmp_path: Path) -> None:
    """Silent connections beyond ``max_unauthenticated`` push out the oldest silent one,
    never the newcomer, and none of them counts against ``max_connections``: a client
    with the token that says hello at once is served."""
    srv = ServerProc(tmp_path / "srv", max_connections=2, max_unauthenticated=4).start()
    try:
        silent = [Raw(srv.port) for _ in range(12)]
        time.sleep(0.3)  # all accepted
        assert all(r.is_closed(wait_s=0.3) for r in silent[:8]), "the 8 oldest pushed out"
        assert not any(r.is_closed(wait_s=0.1) for r in silent[8:]), "the 4 newest queued"
        a = Raw(srv.port)
        assert a.hello()[0] == Msg.SERVER_HELLO and a.ping()
        assert silent[8].is_closed(wait_s=0.3), "the newcomer pushed out the oldest silent one"
        b = Raw(srv.port)
        assert b.hello()[0] == Msg.SERVER_HELLO, "the limit counts served connections only"
        c = Raw(srv.port)
        c.send(Msg.CLIENT_HELLO, 1, tp.Hello(ext={"extensions": tp.EXTENSION}).encode())
        assert c.error()[0] == Err.BUSY, "max_connections still holds for served ones"
    finally:
        srv.kill()


def test_commit_of_a_corrupt_segment_is_refused_and_nothing_is_stored(server: ServerProc) -> None:
    """An engine's layer object altered on the way: X_COMMIT checks every page against
    the manifest, answers REJECTED, and no reader ever sees the segment."""

    async def main() -> None:
        local = load_config({"tiers": [{"type": "cpu", "capacity_bytes": 64 << 20}]}, env={})
        async with TieredStore(local) as builder:
            seqs = sc.batches(7, 1)[0]
            pool = PagedKVPool(sc.SPEC, 512)
            await builder.put(pool, seqs, sc.fill(pool, seqs))
            seg = builder.catalog.cached_manifest(builder.catalog.segments()[0])
            assert seg is not None
            objs = {lay.key: bytes(await builder.tiers[0].get(lay.key)) for lay in seg.layers}
            mkey = builder.catalog.key(seg.segment_id).manifest
        r = Raw(server.port)
        r.hello(TOKEN)
        for i, (k, v) in enumerate(objs.items()):
            if i == 0:
                v = v[:-1] + bytes([v[-1] ^ 1])
            assert r.put(k, v, sid=20 + i)[0] == Msg.TENSOR_PUT_ACK
        r.send(Msg.X_COMMIT, 40, b"".join(bytes(p) for p in tp.encode_commit(mkey, seg.to_bytes())))
        code, text = r.error()
        assert code == Err.REJECTED and "differs" in text
        r.send(Msg.X_CONTAINS, 41, tp.encode_keys([mkey, *objs]))
        kind, _, payload = r.recv()
        assert kind == Msg.X_CONTAINS_REPLY and tp.decode_sizes(memoryview(payload)) == [None] * (
            1 + len(objs)
        )

    asyncio.run(main())


def test_sigterm_finishes_the_put_in_flight_flushes_and_exits_0(tmp_path: Path) -> None:
    srv = ServerProc(tmp_path / "srv").start()
    try:
        r, idle = Raw(srv.port), Raw(srv.port)
        r.hello()
        idle.hello()
        data = os.urandom(3 << 20)
        half = len(data) // 2
        r.send(Msg.TENSOR_PUT, 3, tp.encode_put("late/object", len(data)))
        r.send(Msg.TENSOR_DATA, 3, tp.DATA_OFFSET.pack(0) + data[:half])
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while True:  # draining: not ready any more, and no new connections
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/readyz", timeout=2)
            except urllib.error.HTTPError as e:
                assert e.code == 503
                break
            assert time.monotonic() < deadline, "/readyz still says ready while draining"
            time.sleep(0.05)
        r.send(Msg.TENSOR_DATA, 3, tp.DATA_OFFSET.pack(half) + data[half:])
        r.send(Msg.TENSOR_DATA_END, 3)
        assert r.recv()[0] == Msg.TENSOR_PUT_ACK, "the put in flight was finished"
        assert srv.proc.wait(timeout=30) == 0
        srv.proc = None
        assert idle.is_closed()
        srv.start()  # on the same disk: the object was flushed before the exit
        r2 = Raw(srv.port)
        r2.hello()
        assert r2.get("late/object") == data
    finally:
        srv.kill()


def test_a_put_left_half_sent_times_out_and_gives_its_memory_back(
    server: ServerProc, bystander: Raw
) -> None:
    r = Raw(server.port)
    r.hello(TOKEN)
    r.send(Msg.TENSOR_PUT, 3, tp.encode_put("stalled", 2000))
    r.send(Msg.TENSOR_DATA, 3, tp.DATA_OFFSET.pack(0) + b"a" * 1000)  # whole frames, then silence
    code, _ = r.error()
    assert code == Err.TIMEOUT and r.is_closed()
    bystander.send(Msg.X_STATS, 9)
    kind, _, payload = bystander.recv()
    assert kind == Msg.X_STATS_REPLY and json.loads(payload)["server"]["inflight_put_bytes"] == 0


def test_a_connection_level_error_names_the_offending_stream(server: ServerProc) -> None:
    r = Raw(server.port)
    r.hello(TOKEN)
    r.send(0x77, 1234, b"")
    kind, sid, payload = r.recv()
    assert (kind, sid) == (Msg.ERROR, 1234)


def test_write_back_engine_flushes_its_segments_to_the_server(tmp_path: Path) -> None:
    """write_mode back: a put stays in the engine's own tier until flush moves it to
    the server (its first persistent tier); then a fresh engine reads it there."""
    srv = ServerProc(tmp_path / "srv").start()

    async def main() -> None:
        cfg = load_config(
            {
                "policy": {"write_mode": "back"},
                "tiers": [{"type": "gpu", "device": "cpu", "capacity_bytes": 64 << 20}, srv.tier()],
            },
            env={},
        )
        seqs = sc.batches(3, 1)[0]
        async with TieredStore(cfg) as engine:
            pool = PagedKVPool(sc.SPEC, 512)
            await engine.put(pool, seqs, sc.fill(pool, seqs))
            assert engine.stats()["tiers"]["remote"]["bytes_written"] == 0, (
                "write-back: nothing sent before flush"
            )
            await engine.flush()
            assert engine.stats()["tiers"]["remote"]["bytes_written"] > 0
        async with TieredStore(cfg) as fresh:
            dst = PagedKVPool(sc.SPEC, 512)
            res = await fresh.retrieve(dst, seqs)
            assert res.num_tokens == [len(t) // 8 * 8 for t in seqs]
            assert sc.check(dst, seqs, res.block_tables, res.num_tokens) == 0

    try:
        asyncio.run(main())
    finally:
        srv.kill()


def test_a_put_that_announces_much_and_sends_nothing_holds_little(tmp_path: Path) -> None:
    """Budget is taken as bytes arrive: a 1 MiB put announced and never sent does not
    make another client's put wait, in a server whose budget is 1 MiB."""
    srv = ServerProc(
        tmp_path / "srv",
        max_object_bytes=1 << 20,
        max_inflight_put_bytes=1 << 20,
        request_timeout_s=4.0,
    ).start()
    try:
        hog = Raw(srv.port)
        hog.hello()
        hog.send(Msg.TENSOR_PUT, 3, tp.encode_put("announced", 1 << 20))  # and nothing else
        r = Raw(srv.port)
        r.hello()
        assert r.put("real", b"y" * (512 << 10))[0] == Msg.TENSOR_PUT_ACK
        assert r.get("real") == b"y" * (512 << 10)
    finally:
        srv.kill()
