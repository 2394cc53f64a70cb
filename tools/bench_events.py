"""What KV events cost the save path, in one run: saves through the engine port with
events off and on (a real ZMQ subscriber reading every batch), rounds alternating.

Run: ``.venv/bin/python tools/bench_events.py``. Each round saves ``--objects`` objects
of ``--kib`` KiB into a fresh cpu + disk store (write-through to disk, as an engine's
store), handing them over in steps of 16 as an engine does, and waits until every save
is written through. With events on, every object is two ``BlockStored`` (cpu, disk),
and the cpu tier's budget evicts, so there are ``BlockRemoved`` too. The subscriber is
``hurray-store events`` in a process of its own, as a router's is. Prints the median
seconds per round of each, the ratio (aim: events on <= 1.02x off), and the events per
second of a round the subscriber received.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _bench import free_port, table

from hurray_store.engine import EnginePort, Save


def one_round(objects: int, kib: int, events: bool) -> tuple[float, int]:
    """Seconds to save and write through every object; events the subscriber got."""
    data = bytes(range(256)) * (kib * 4)
    with tempfile.TemporaryDirectory() as d:
        tiers = [
            {"type": "cpu", "capacity_bytes": objects * len(data) // 2},
            {"type": "disk", "path": str(Path(d) / "disk"), "capacity_bytes": 1 << 34},
        ]
        cfg: dict[str, Any] = {"namespace": "bench", "tiers": tiers}
        ep = f"tcp://127.0.0.1:{free_port()}"
        if events:
            cfg["events"] = {"endpoint": ep, "interval_ms": 50}
        port = EnginePort(cfg, name="bench-events")
        sub = None
        if events:
            assert port.publish_events(lambda n: (n.encode(),), model="bench", block_size=16)
            # A router's subscriber is a process of its own: the CLI, one line an event.
            cmd = [sys.executable, "-m", "hurray_store.cli", "events", "--endpoint", ep]
            sub = subprocess.Popen([*cmd, "--idle", "3"], stdout=subprocess.PIPE)
            time.sleep(2.0)  # it starts and joins
        t0 = time.perf_counter()
        for i in range(0, objects, 16):
            port.save([Save(f"o{j}", data, len(data), lambda ok: None) for j in range(i, i + 16)])
        port.flush()
        took = time.perf_counter() - t0
        port.close()  # the last batch sent
        got = 0
        if sub is not None:
            out, _ = sub.communicate(timeout=120)
            got = len(out.splitlines())
        return took, got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--objects", type=int, default=4096)
    ap.add_argument("--kib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    off: list[float] = []
    on: list[float] = []
    received: list[float] = []
    one_round(256, a.kib, True)  # warm: imports, the page cache's first files
    for _ in range(a.rounds):
        off.append(one_round(a.objects, a.kib, False)[0])
        s, n = one_round(a.objects, a.kib, True)
        on.append(s)
        received.append(n / s)
    mo, mn = statistics.median(off), statistics.median(on)
    mb = a.objects * a.kib / 1024
    print(
        f"\n{a.objects} saves of {a.kib} KiB ({mb:.0f} MiB) into cpu + disk, "
        f"medians of {a.rounds} rounds\n"
    )
    print(
        table(
            ["events", "s per round", "MiB/s", "x events off", "events/s received"],
            [
                ["off", f"{mo:.3f}", f"{mb / mo:.0f}", "1.000", "-"],
                [
                    "on",
                    f"{mn:.3f}",
                    f"{mb / mn:.0f}",
                    f"{mn / mo:.3f}",
                    f"{statistics.median(received):.0f}",
                ],
            ],
        )
    )


if __name__ == "__main__":
    main()
