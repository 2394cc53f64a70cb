"""The cache server against hostile tenants: every attack of issue Q's list that a
tenant (or anyone who can connect) can make, each a test named for it. Real
`hurray-store serve` processes, raw sockets; memory is the server's RSS from /proc."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from hurray_store import transport as tp
from hurray_store.server.segments import PER_OBJECT_BYTES
from hurray_store.server.tenants import STORED_OBJECT_BYTES
from tests.server_helpers import ROOT, Raw, ServerProc

Err, Msg = tp.Err, tp.Msg
ALICE = {"name": "alice", "token": "alice-token"}
BOB = {"name": "bob", "token": "bob-token"}


def _rss(srv: ServerProc) -> int:
    assert srv.proc is not None
    for line in Path(f"/proc/{srv.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _stats(r: Raw) -> dict:
    r.send(Msg.X_STATS, 9)
    kind, _, payload = r.recv()
    assert kind == Msg.X_STATS_REPLY
    return json.loads(payload)


def _seg(i: int, ns: str = "hurray") -> str:
    return f"{ns}/s/{{{i:032x}}}"


def _pipelined_puts(r: Raw, keys: list[str], data: bytes) -> list[int]:
    """Puts of ``keys`` sent 32 at a time before their answers are read; the kinds."""
    kinds: list[int] = []
    for b in range(0, len(keys), 32):
        batch = keys[b : b + 32]
        for i, key in enumerate(batch):
            sid = 1 + 2 * (b + i)
            r.send(Msg.TENSOR_PUT, sid, tp.encode_put(key, len(data)))
            r.send(Msg.TENSOR_DATA, sid, tp.DATA_OFFSET.pack(0) + data)
            r.send(Msg.TENSOR_DATA_END, sid)
        kinds += [r.recv()[0] for _ in batch]
    return kinds


def test_abandoned_large_messages_give_their_memory_back(tmp_path: Path) -> None:
    """Rounds of connections that stop halfway through a 64 MiB message (a put's data
    frame, an X_COMMIT) and then hang up: the server's memory does not grow round after
    round, and its log shows no exception left unretrieved, no coroutine never awaited."""
    srv = ServerProc(tmp_path / "srv", request_timeout_s=1.0).start()
    big = 64 << 20
    try:
        after = []
        for rnd in range(3):
            conns = []
            for i in range(8):
                r = Raw(srv.port)
                r.hello()
                if i % 2:
                    r.send(Msg.TENSOR_PUT, 3, tp.encode_put(f"big{rnd}-{i}", big))
                    head = tp.HEADER.pack(Msg.TENSOR_DATA, 3, big) + tp.DATA_OFFSET.pack(0)
                else:
                    head = tp.HEADER.pack(Msg.X_COMMIT, 3, big)
                r.s.sendall(head + b"\1" * (big // 2))
                conns.append(r)
            time.sleep(1.5)  # past request_timeout_s: each connection is cut
            for r in conns:
                r.close()
            time.sleep(0.3)
            after.append(_rss(srv))
        assert after[2] - after[0] < 96 << 20, f"RSS after each round (MiB): {after}"
        log = srv.log.read_text()
        for bad in ("never retrieved", "was never awaited", "Traceback"):
            assert bad not in log, f"server log: {bad}"
    finally:
        srv.kill()


def test_claim_floods_are_capped_per_connection_and_tenant(tmp_path: Path) -> None:
    """Claiming lookups of many fresh pages claim at most the connection's and the
    tenant's caps; another tenant still claims its own; a closed connection's claims
    end; claims past their timeout end."""
    srv = ServerProc(
        tmp_path / "srv",
        token="ops-token",
        tenants=[ALICE, BOB],
        max_claims_per_connection=1000,
        max_claims_per_tenant=1500,
        claim_timeout_s=2.0,
    ).start()

    def lookup(r: Raw, start: int, n: int, sid: int) -> None:
        hashes = [(start + i).to_bytes(16, "little") for i in range(n)]
        r.send(Msg.X_LOOKUP, sid, tp.encode_lookup([(0, hashes)], claim=True))
        kind, rsid, _ = r.recv()
        assert (kind, rsid) == (Msg.X_LOOKUP_REPLY, sid)

    try:
        ops = Raw(srv.port)
        ops.hello("ops-token")  # the server's token: admin, sees every tenant's claims
        a1, a2, b = Raw(srv.port), Raw(srv.port), Raw(srv.port)
        a1.hello(ALICE["token"])
        a2.hello(ALICE["token"])
        b.hello(BOB["token"])
        for i in range(5):
            lookup(a1, i * 5000, 5000, 11 + 2 * i)
        assert _stats(ops)["server"]["claimed_pages"] == 1000, "the connection's cap"
        lookup(a2, 10**6, 5000, 11)
        assert _stats(ops)["server"]["claimed_pages"] == 1500, "the tenant's cap"
        lookup(b, 2 * 10**6, 300, 11)
        assert _stats(ops)["server"]["claimed_pages"] == 1800, "another tenant claims its own"
        a1.close()
        time.sleep(0.3)
        assert _stats(ops)["server"]["claimed_pages"] == 800, "a closed connection's claims end"
        time.sleep(2.5)
        assert _stats(ops)["server"]["claimed_pages"] == 0, "claims past their timeout end"
    finally:
        srv.kill()


def test_staging_past_the_quota_is_dropped_and_counted(tmp_path: Path) -> None:
    """A tenant's staged segment objects count against its quota from the first byte:
    it cannot stage more than its quota (NOT_STORED), its counts show what it stages,
    and another tenant's put is served meanwhile."""
    quota = 256 << 10
    srv = ServerProc(tmp_path / "srv", tenants=[{**ALICE, "quota_bytes": quota}, BOB]).start()
    try:
        a, b = Raw(srv.port), Raw(srv.port)
        a.hello(ALICE["token"])
        b.hello(BOB["token"])
        keys = [f"{_seg(i, 'alice')}/0" for i in range(12)]
        kinds = _pipelined_puts(a, keys, b"s" * (32 << 10))
        acks = kinds.count(Msg.TENSOR_PUT_ACK)
        assert 0 < acks < 12 and acks * (32 << 10) <= quota, kinds
        staged = _stats(a)["tenant"]["staged_bytes"]
        assert 0 < staged <= quota, staged
        assert b.put("bob-object", b"b" * (512 << 10))[0] == Msg.TENSOR_PUT_ACK
        assert b.get("bob-object") == b"b" * (512 << 10)
    finally:
        srv.kill()


def test_a_commit_is_checked_against_its_staged_objects_before_it_is_parsed(
    tmp_path: Path,
) -> None:
    """X_COMMIT of a segment with nothing staged, or of a manifest far larger than its
    staged objects, is REJECTED on its stream at once; the connection stays."""
    srv = ServerProc(tmp_path / "srv").start()
    try:
        r = Raw(srv.port)
        r.hello()
        garbage = b"\x07" * (8 << 20)
        r.send(
            Msg.X_COMMIT, 3, b"".join(bytes(p) for p in tp.encode_commit(f"{_seg(1)}/m", garbage))
        )
        code, why = r.error()
        assert code == Err.REJECTED and "no staged layer objects" in why, why
        assert r.put(f"{_seg(2)}/0", b"l" * 100)[0] == Msg.TENSOR_PUT_ACK  # staged
        r.send(
            Msg.X_COMMIT, 5, b"".join(bytes(p) for p in tp.encode_commit(f"{_seg(2)}/m", garbage))
        )
        code, why = r.error()
        assert code == Err.REJECTED and "at most" in why, why
        assert r.ping(), "the connection stays"
    finally:
        srv.kill()


def test_the_books_charge_what_an_object_really_costs(tmp_path: Path) -> None:
    """Empty staged objects and 1-byte stored objects (each written to the disk tier
    too): past the first 10,000 of each (the server's buffers and threads warming up),
    its memory grows by no more per object than the put budget and the tenant counts
    charge."""
    srv = ServerProc(tmp_path / "srv", max_object_bytes=4096).start()
    warm, n = 10_000, 20_000

    def grown(keys: list[str], data: bytes) -> float:
        assert set(_pipelined_puts(r, keys[:warm], data)) == {Msg.TENSOR_PUT_ACK}
        time.sleep(0.3)
        before = _rss(srv)
        assert set(_pipelined_puts(r, keys[warm:], data)) == {Msg.TENSOR_PUT_ACK}
        time.sleep(0.3)
        return (_rss(srv) - before) / (len(keys) - warm)

    try:
        r = Raw(srv.port)
        r.hello()
        staged = [f"{_seg(i)}/0" for i in range(warm + n)]
        per_staged = grown(staged, b"")
        assert per_staged <= PER_OBJECT_BYTES + len(staged[0]), per_staged
        per_stored = grown([f"o{i:08d}" for i in range(warm + n)], b"x")
        assert per_stored <= STORED_OBJECT_BYTES + 1, per_stored
        assert _stats(r)["server"]["inflight_put_bytes"] >= (warm + n) * PER_OBJECT_BYTES
    finally:
        srv.kill()


def test_silent_connection_floods_never_reset_a_legitimate_hello(tmp_path: Path) -> None:
    """Threads opening connections that never speak, as fast as they can, while an
    engine connects and says hello 40 times: every one of its hellos is answered."""
    srv = ServerProc(tmp_path / "srv", max_unauthenticated=32, hello_timeout_s=30.0).start()
    stop = threading.Event()
    opened = [0]

    def flood() -> None:
        held: list[socket.socket] = []
        while not stop.is_set():
            try:
                held.append(socket.create_connection(("127.0.0.1", srv.port), timeout=2))
                opened[0] += 1
            except OSError:
                pass
            if len(held) > 200:
                for s in held[:100]:
                    s.close()
                del held[:100]
        for s in held:
            s.close()

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        answered = 0
        for _ in range(40):
            r = Raw(srv.port)
            try:
                answered += r.hello()[0] == Msg.SERVER_HELLO
            finally:
                r.close()
        assert answered == 40
        assert opened[0] > 200, "the flood ran"
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        srv.kill()


def test_failed_hellos_are_throttled_per_peer(tmp_path: Path) -> None:
    """Past ``hello_failures_per_s`` (bursts of 10x), a wrong token is answered only
    after a second; a right token from the same address is still served."""
    srv = ServerProc(tmp_path / "srv", token="right", hello_failures_per_s=1.0).start()
    try:
        waits = []
        for _ in range(13):
            r = Raw(srv.port)
            t0 = time.monotonic()
            r.send(Msg.CLIENT_HELLO, 1, tp.Hello(ext={"token": "wrong"}).encode())
            assert r.error()[0] == Err.AUTH_FAILED
            waits.append(time.monotonic() - t0)
            r.close()
        assert min(waits[11:]) >= 0.9, waits  # the burst of 10 spent
        ok = Raw(srv.port)
        assert ok.hello("right")[0] == Msg.SERVER_HELLO
    finally:
        srv.kill()


def test_a_capacity_beyond_any_machine_is_a_config_error(tmp_path: Path) -> None:
    """``capacity_bytes: 10**30`` (and a cpu tier the machine cannot map) is one line
    on stderr and exit code 2, not a traceback."""
    for cap, says in ((10**30, "capacity_bytes"), (1 << 61, "cannot reserve")):
        cfg = tmp_path / f"c{cap}.yaml"
        cfg.write_text(yaml.safe_dump({"tiers": [{"type": "cpu", "capacity_bytes": cap}]}))
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "hurray_store.cli",
                "serve",
                "--config",
                str(cfg),
                "--port",
                "0",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**os.environ, "LMCACHE_TRACK_USAGE": "false"},
            timeout=120,
        )
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert says in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_large_non_put_messages_held_open_hold_no_more_than_their_budgets(
    tmp_path: Path,
) -> None:
    """One tenant opens connections that each announce a 16 MiB PING (or X_LOOKUP), send
    15 MiB of it and stall: the server holds at most the tenant's message budget for
    them (the rest wait without a byte allocated, then are told BUSY or cut at the
    request timeout); the other tenant's PINGs are answered meanwhile. It used to hold
    every such message whole: 48 of them, 3 GB."""
    big, budget = 16 << 20, 32 << 20
    srv = ServerProc(
        tmp_path / "srv",
        token="ops-token",
        tenants=[ALICE, BOB],
        max_inflight_message_bytes_per_tenant=budget,
        request_timeout_s=3.0,
    ).start()
    conns: list[Raw] = []
    try:
        ops = Raw(srv.port)
        ops.hello("ops-token")
        before = _rss(srv)
        for i in range(8):
            r = Raw(srv.port)
            r.hello(ALICE["token"])
            kind = Msg.PING if i % 2 else Msg.X_LOOKUP
            head = tp.HEADER.pack(kind, 5, big) + b"\1" * (15 << 20)
            # Sent from a thread: a message waiting for room is not read, its send blocks.
            threading.Thread(target=_send_quietly, args=(r, head), daemon=True).start()
            conns.append(r)
        time.sleep(2.0)
        held = _stats(ops)["server"]["inflight_message_bytes"]
        grown = _rss(srv) - before
        b = Raw(srv.port)
        b.hello(BOB["token"])
        t0 = time.monotonic()
        assert b.ping(), "the other tenant is still served"
        assert time.monotonic() - t0 < 1.0
        assert held == budget, f"{held} bytes of messages held; the budget is {budget}"
        assert grown < budget + (16 << 20), f"RSS grew {grown >> 20} MiB"
        # Each stalled one is cut at request_timeout_s (those that waited for room, once
        # they had it): every byte is given back.
        end = time.monotonic() + 20
        while _stats(ops)["server"]["inflight_message_bytes"] and time.monotonic() < end:
            time.sleep(0.2)
        assert _stats(ops)["server"]["inflight_message_bytes"] == 0
    finally:
        for r in conns:
            r.close()
        srv.kill()


def _send_quietly(r: Raw, data: bytes) -> None:
    with contextlib.suppress(OSError):
        r.s.sendall(data)


def test_a_flood_of_tiny_objects_fills_the_cpu_tier_by_what_they_really_cost(
    tmp_path: Path,
) -> None:
    """50,000 one-byte puts (nine times what the tier holds) into a server whose only
    tier is 8 MiB of CPU memory: the
    tier charges each object what it costs (1 byte used to be charged 1 byte: 33 GiB
    before the first eviction), so it evicts past about 8 MiB of them, and the
    server's memory grows by about the tier's budget, not by the flood."""
    from hurray_store.tiers.memory import memory_charge

    cap = 8 << 20
    srv = ServerProc(
        tmp_path / "srv", tiers=[{"type": "cpu", "capacity_bytes": cap}], max_object_bytes=4096
    ).start()
    try:
        r = Raw(srv.port)
        r.hello()
        warm, n = 10_000, 50_000
        assert set(_pipelined_puts(r, [f"w{i:08d}" for i in range(warm)], b"x")) == {
            Msg.TENSOR_PUT_ACK
        }
        time.sleep(0.3)
        before = _rss(srv)
        kinds = _pipelined_puts(r, [f"o{i:08d}" for i in range(n)], b"x")
        assert set(kinds) == {Msg.TENSOR_PUT_ACK}
        time.sleep(0.3)
        grown = _rss(srv) - before
        cpu = _stats(r)["tiers"]["cpu"]
        assert cpu["objects"] <= cap // memory_charge(1) and cpu["bytes"] <= cap
        assert cpu["evictions"] >= warm + n - cap // memory_charge(1)
        assert grown < 2 * cap, f"RSS grew {grown >> 20} MiB for an {cap >> 20} MiB tier"
    finally:
        srv.kill()
