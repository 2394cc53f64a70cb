"""KV events for routers (docs/events.md): vLLM's wire format over real ZMQ sockets.

- A batch we encode is read by vLLM's own msgspec classes (in the vLLM environment).
- The publisher numbers its batches, replays a missed range through its ROUTER socket,
  and never blocks on a subscriber that does not read; one huge SUBSCRIBE or replay
  request from a hostile peer costs it no memory (its sockets cut the peer off).
- A store's port publishes what its tiers gain and lose, with each tier's medium; the
  cache server publishes each tenant's pages under that tenant's topic only; nothing is
  published without a config asking for it.
- ``hurray-store events`` prints one line an event.
"""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import threading
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from hurray_store.cli import main
from hurray_store.engine import EnginePort, Save
from hurray_store.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqPublisher,
)
from hurray_store.events.subscriber import Received, Subscriber
from hurray_store.events.wire import ENCODER
from hurray_store.testing.services import free_port
from tests import server_client as sc
from tests.server_helpers import ServerProc
from tests.test_tenants import TENANTS, _engine, _put

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"


def _endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def _collect(sub: Subscriber, want: int, timeout_s: float = 20.0) -> list[Received]:
    """Batches until ``want`` events came (or ``timeout_s`` passed with none)."""
    out: list[Received] = []
    while sum(len(r.batch.events) for r in out) < want:
        got = sub.recv(timeout_s)
        if not got:
            break
        out += got
    return out


def _through(sub: Subscriber, seq: int, timeout_s: float = 10.0) -> list[Received]:
    """What ``sub`` receives until the batch numbered ``seq``."""
    out: list[Received] = []
    while not out or out[-1].seq < seq:
        got = sub.recv(timeout_s)
        assert got, f"batch {seq} never came"
        out += got
    return out


def _events(got: list[Received]) -> list[Any]:
    return [e for r in got for e in r.batch.events]


@pytest.mark.skipif(not VLLM_PY.exists(), reason="the vLLM environment: make test builds it")
def test_a_batch_is_read_by_vllms_own_classes() -> None:
    stored = BlockStored(
        block_hashes=[b"\x01" * 16, 7],
        parent_block_hash=None,
        token_ids=list(range(32)),
        block_size=16,
        lora_id=None,
        medium="STORAGE",
        lora_name=None,
        locality="LOCAL",
        ownership="disk",
    )
    batch = KVEventBatch(
        ts=1.5, events=[stored, BlockRemoved([b"\x02" * 16], "CPU"), AllBlocksCleared()]
    )
    script = (
        "import sys, json, msgspec\n"
        "from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved\n"
        "b = msgspec.msgpack.Decoder(KVEventBatch).decode(sys.stdin.buffer.read())\n"
        "s, r, c = b.events\n"
        "print(json.dumps([b.ts, type(s).__name__, [h.hex() if isinstance(h, bytes) else h "
        "for h in s.block_hashes], s.token_ids[-1], s.block_size, s.medium, s.locality, "
        "s.ownership, type(r).__name__, r.block_hashes[0].hex(), r.medium, type(c).__name__]))\n"
    )
    p = subprocess.run(
        [str(VLLM_PY), "-c", script],
        input=ENCODER.encode(batch),
        capture_output=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    got = json.loads(p.stdout.decode().strip().splitlines()[-1])
    assert got == [
        1.5,
        "BlockStored",
        ["01" * 16, 7],
        31,
        16,
        "STORAGE",
        "LOCAL",
        "disk",
        "BlockRemoved",
        "02" * 16,
        "CPU",
        "AllBlocksCleared",
    ]


def _joined(pub: ZmqPublisher, sub: Subscriber) -> int:
    """Publish until ``sub`` receives (a SUB socket joins some time after it connects);
    the sequence number it first saw."""
    for _ in range(200):
        pub.publish("t", KVEventBatch(ts=0.0, events=[BlockRemoved([-1], "CPU")]))
        if got := sub.recv(0.05):
            return got[-1].seq
    raise AssertionError("the subscriber never joined")


def test_the_publisher_numbers_batches_and_replays_a_missed_range() -> None:
    pub = ZmqPublisher(_endpoint(), _endpoint(), buffer_batches=3)
    sub = Subscriber(pub.endpoint, "t", pub.replay_endpoint)
    late = Subscriber(pub.endpoint, "t", pub.replay_endpoint, start=0)
    try:
        _joined(pub, sub)
        _joined(pub, late)
        assert pub.flush()
        first = pub.sent
        for i in range(5):
            pub.publish("t", KVEventBatch(ts=float(i), events=[BlockRemoved([i], "CPU")]))
        got = [r for r in _through(sub, first + 4) if r.seq >= first]
        assert [r.seq for r in got] == list(range(first, first + 5)), "numbered in order"
        assert [r.batch.events[0].block_hashes for r in got] == [[i] for i in range(5)]
        # Replays give what the publisher keeps (3 batches), from the number asked.
        again = sub.replay(first + 3)
        assert [(r.seq, r.batch.events[0].block_hashes) for r in again] == [
            (first + 3, [3]),
            (first + 4, [4]),
        ]
        assert [r.seq for r in sub.replay(0)] == [first + 2, first + 3, first + 4]
        # A subscriber that wanted everything from 0 and joined late saw a gap: what was
        # kept of it came back by replay before the next batch, the rest is counted.
        pub.publish("t", KVEventBatch(ts=9.0, events=[BlockRemoved([9], "CPU")]))
        seen = [r.seq for r in _through(late, first + 5)]
        assert seen == sorted(seen) and seen[-1] == first + 5
        assert first + 2 in seen, "the kept part of the gap, replayed"
        assert pub.dropped == 0
    finally:
        sub.close()
        late.close()
        pub.close()


def test_a_subscriber_that_does_not_read_never_blocks_the_publisher() -> None:
    """A save publishes through ``publish``, which only queues: with a subscriber that
    reads nothing, 20,000 batches of 64 KiB are queued, sent or dropped, never waited
    for (the hang guard is the join's timeout, not a speed)."""
    pub = ZmqPublisher(_endpoint(), max_waiting=64)
    sub = Subscriber(pub.endpoint)  # connected, never reading
    done = threading.Event()
    big = [BlockRemoved([bytes(65536)], "STORAGE")]

    def flood() -> None:
        for i in range(20_000):
            pub.publish("t", KVEventBatch(ts=float(i), events=big))
        done.set()

    t = threading.Thread(target=flood)
    t.start()
    t.join(timeout=120)
    try:
        assert done.is_set(), "publish blocked"
        assert pub.flush(60)
        assert pub.sent + pub.dropped == 20_000
    finally:
        sub.close()
        pub.close()


def _rss(field: str = "VmRSS") -> int:
    """This process's resident set (``VmHWM``: its peak since ``_reset_peak``), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field}")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from the current RSS on


# A hostile peer in a process of its own (its 64 MiB frame is not in this process's
# memory): ``kind`` sub sends one SUBSCRIBE of a 64 MiB topic to the PUB socket, ``replay``
# one 64 MiB replay request to the ROUTER socket; then it waits to be cut off.
_HOSTILE = """
import sys, time, zmq
kind, endpoint = sys.argv[1], sys.argv[2]
ctx = zmq.Context()
big = bytes(64 << 20)
if kind == "sub":
    s = ctx.socket(zmq.SUB); s.connect(endpoint); s.setsockopt(zmq.SUBSCRIBE, big)
else:
    s = ctx.socket(zmq.DEALER); s.connect(endpoint); s.send_multipart([b"", big])
time.sleep(3)
print("sent", flush=True)
"""


@pytest.mark.parametrize("kind", ["sub", "replay"])
def test_one_huge_message_to_the_events_ports_costs_the_publisher_nothing(kind: str) -> None:
    """libzmq keeps a subscription as a trie node per byte (a 64 MiB SUBSCRIBE grew a
    publisher by about 3 GiB) and reads a request whole before it is handled: the
    publisher's sockets cut off a peer whose message part is longer than a topic or a
    replay request may be, before storing it, and go on serving the others."""
    pub = ZmqPublisher(_endpoint(), _endpoint(), buffer_batches=8)
    sub = Subscriber(pub.endpoint, "t", pub.replay_endpoint)
    try:
        _joined(pub, sub)
        _reset_peak()
        before = _rss()
        target = pub.endpoint if kind == "sub" else pub.replay_endpoint
        p = subprocess.run(
            [sys.executable, "-c", _HOSTILE, kind, target],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.stdout.strip() == "sent", p.stderr[-2000:]
        # while the message came in too, not only after it was dropped
        grown = _rss("VmHWM") - before
        assert grown < 32 << 20, f"the publisher grew {grown >> 20} MiB"
        # the others are served: the live stream and a replay
        seq = _joined(pub, sub)
        assert [r.seq for r in sub.replay(seq)][:1] == [seq]
    finally:
        sub.close()
        pub.close()


def test_a_subscription_to_a_topic_of_the_longest_length_is_served() -> None:
    """The bound cuts off only what is past it: a topic of ``MAX_TOPIC_BYTES`` (sent
    behind ZMTP's SUBSCRIBE command name) is subscribed to and served."""
    from hurray_store.events.publisher import MAX_TOPIC_BYTES

    topic = "k" * MAX_TOPIC_BYTES
    pub = ZmqPublisher(_endpoint())
    sub = Subscriber(pub.endpoint, topic)
    try:
        for _ in range(200):
            pub.publish(topic, KVEventBatch(ts=0.0, events=[BlockRemoved([-1], "CPU")]))
            if got := sub.recv(0.05):
                assert got[-1].topic == topic
                break
        else:
            raise AssertionError("the subscriber was cut off")
    finally:
        sub.close()
        pub.close()


def test_a_topic_longer_than_a_subscription_may_be_is_said_at_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from hurray_store.config import EventsConfig
    from hurray_store.events.publisher import MAX_TOPIC_BYTES
    from hurray_store.events.relay import default_topic

    with caplog.at_level("WARNING", logger="hurray_store.events.relay"):
        short = default_topic(EventsConfig(instance="pod-1"), "m")
        assert short == "kv@pod-1@m" and not caplog.records
        long = default_topic(EventsConfig(instance="pod-1"), "m" * MAX_TOPIC_BYTES)
    assert long.endswith("m" * MAX_TOPIC_BYTES)
    (msg,) = [r.getMessage() for r in caplog.records]
    assert msg.startswith("KV events: the topic 'kv@pod-1@mmm") and "set events.topic" in msg


def _port(tmp_path: Path, events: dict[str, Any] | None) -> EnginePort:
    tiers = [
        {"type": "cpu", "capacity_bytes": 3 * 4096 + 100},
        {"type": "disk", "path": str(tmp_path / "disk"), "capacity_bytes": 1 << 30},
    ]
    cfg: dict[str, Any] = {"namespace": "ev", "tiers": tiers}
    if events:
        cfg["events"] = events
    return EnginePort(cfg, name="events-test")


def test_a_port_publishes_what_its_tiers_gain_and_lose(tmp_path: Path) -> None:
    ep, rep = _endpoint(), _endpoint()
    port = _port(tmp_path, {"endpoint": ep, "replay_endpoint": rep, "interval_ms": 20})
    sub = Subscriber(ep, "kv@", rep)
    try:
        assert port.publish_events(lambda n: (n.encode(),), model="m", block_size=16)
        assert port.relay is not None
        for i in range(4):  # the cpu tier holds 3: the first is evicted from it
            port.save([Save(f"p{i}", bytes([i]) * 4096, 4096, lambda ok: None)])
            port.flush()
        port.call(port.store.delete_object("p3"))
        port.relay.send()
        assert port.relay.publisher.flush()
        # stored in cpu and disk (4 x 2), evicted from cpu (1), deleted from both (2):
        # all of it kept for replay, whenever this subscriber joined
        got = sub.replay(0)
        evs = _events(got)
        assert {r.topic for r in got} == {port.relay.cfg.topic or got[0].topic}
        assert got[0].topic.startswith("kv@") and got[0].topic.endswith("@m")
        seen = [(type(e).__name__, e.medium, e.ownership, e.block_hashes[0].decode()) for e in evs]
        for i in range(4):
            assert ("BlockStored", "CPU", "cpu", f"p{i}") in seen
            assert ("BlockStored", "STORAGE", "disk", f"p{i}") in seen
        assert ("BlockRemoved", "CPU", "cpu", "p0") in seen, "an eviction"
        assert ("BlockRemoved", "CPU", "cpu", "p3") in seen, "a delete, from every tier"
        assert ("BlockRemoved", "STORAGE", "disk", "p3") in seen
        stored = next(e for e in evs if isinstance(e, BlockStored))
        assert stored.block_size == 16 and stored.locality == "LOCAL"
        assert port.stats()["port"]["kv_events_published"] == len(evs)
    finally:
        sub.close()
        port.close()


def test_nothing_is_published_without_an_endpoint(tmp_path: Path) -> None:
    port = _port(tmp_path, None)
    try:
        assert not port.publish_events(lambda n: (n.encode(),), model="m", block_size=16)
        assert port.relay is None and "kv_events_published" not in port.stats()["port"]
    finally:
        port.close()


def test_the_cache_server_publishes_each_tenants_pages_under_its_own_topic(
    tmp_path: Path,
) -> None:
    ep = _endpoint()
    srv = ServerProc(
        tmp_path / "srv", token="", tenants=TENANTS, events={"endpoint": ep, "interval_ms": 20}
    ).start()
    alice = Subscriber(ep, "kv@alice@")
    everyone = Subscriber(ep, "")

    async def main() -> None:
        async with _engine(srv, TENANTS[0]) as a:
            await _put(a, sc.batches(1, 1)[0])
        async with _engine(srv, TENANTS[1]) as b:
            await _put(b, sc.batches(2, 1)[0])

    try:
        asyncio.run(main())
        got: list[Received] = []
        while {r.topic for r in got} != {"kv@alice@server", "kv@bob@server"}:
            more = everyone.recv(20)
            assert more, {r.topic for r in got}
            got += more
        mine = _collect(alice, 2)
        assert {r.topic for r in mine} == {"kv@alice@server"}, "never another tenant's"
        stored = [e for e in _events(mine) if isinstance(e, BlockStored)]
        assert stored and all(e.medium in ("CPU", "STORAGE") for e in stored)
        # A segment is its sequences' page hashes, with their tokens.
        seg = stored[0]
        assert seg.block_size == sc.SPEC.page_size
        assert len(seg.token_ids) == len(seg.block_hashes) * sc.SPEC.page_size
    finally:
        alice.close()
        everyone.close()
        srv.kill()


def test_the_events_command_prints_one_line_an_event() -> None:
    pub = ZmqPublisher(_endpoint(), _endpoint())
    out = io.StringIO()
    args = ["events", "--endpoint", pub.endpoint, "--replay", pub.replay_endpoint]

    def run() -> None:
        with redirect_stdout(out):
            main([*args, "--replay-from", "0", "--count", "2", "--idle", "10"])

    try:
        pub.publish(
            "kv@x@m",
            KVEventBatch(
                ts=0.0,
                events=[
                    BlockStored([b"\xab" * 8], None, [1] * 16, 16, None, "STORAGE", None),
                    BlockRemoved([b"\xcd" * 8], "CPU", ownership="cpu"),
                ],
            ),
        )
        assert pub.flush()
        t = threading.Thread(target=run)
        t.start()
        t.join(timeout=30)
        lines = out.getvalue().splitlines()
        assert lines == [
            f"0 kv@x@m stored  STORAGE - 1 block(s) {'ab' * 8} tokens=16",
            f"0 kv@x@m removed CPU     cpu 1 block(s) {'cd' * 8}",
        ]
    finally:
        pub.close()
