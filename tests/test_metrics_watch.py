"""Hit rate you can watch (issue W): an in-process engine port serves its store's metrics
on engine.metrics_port, and after a lookup that hits, the engine's counters say what was
asked and found; the Grafana dashboard in deploy/ names only metrics the registry
really exports."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from hurray_store.engine import EnginePort
from hurray_store.server.metrics import ServerMetrics

ROOT = Path(__file__).resolve().parent.parent


def _value(text: str, name: str, engine: str) -> float:
    m = re.search(rf'^{name}{{engine="{engine}"}} ([0-9.e+]+)$', text, re.M)
    assert m, f"{name} not exported"
    return float(m.group(1))


def test_an_engine_ports_metrics_show_what_it_asked_for_and_found(tmp_path: Path) -> None:
    p = EnginePort(
        {
            "tiers": [{"type": "disk", "path": str(tmp_path / "d"), "capacity_bytes": 1 << 24}],
            "engine": {"metrics_port": 0},
        },
        name="watched",
    )
    try:
        assert p.metrics_port
        assert p.save_lent([[("a", b"x" * 100), ("b", b"y" * 100)]]) == [True, True]
        assert p.lookup(["a", "b", "c", "d"]).n == 2
        got = []
        assert p.load(["a", "b"], 100, lambda j, b: "", lambda j, t: got.append(j)) == 2
        with urllib.request.urlopen(f"http://127.0.0.1:{p.metrics_port}/metrics") as r:
            text = r.read().decode()
        assert _value(text, "hurray_store_engine_objects_asked_total", "watched") == 4
        assert _value(text, "hurray_store_engine_objects_held_total", "watched") == 2
        assert _value(text, "hurray_store_engine_loaded_total", "watched") == 2
        assert _value(text, "hurray_store_engine_calls_late_total", "watched") == 0
        assert 'hurray_store_tier_hits_total{tier="disk"}' in text
    finally:
        p.close()


def test_every_metric_the_dashboard_names_is_exported(tmp_path: Path) -> None:
    p = EnginePort(
        {"tiers": [{"type": "cpu", "capacity_bytes": 1 << 20}]},
        name="dash",
    )
    try:
        p.save_lent([[("a", b"x" * (600 << 10))]])
        p.save_lent([[("b", b"y" * (600 << 10))]])  # evicts a: a move, counted
        p.lookup(["a"])
        exported = generate_latest(p.store.metrics.registry).decode()
    finally:
        p.close()
    server = CollectorRegistry()
    ServerMetrics(server)
    exported += generate_latest(server).decode()
    names = {ln.split("{")[0].split(" ")[0] for ln in exported.splitlines() if ln[:1] != "#"}
    dash = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dash["panels"] for t in panel["targets"]]
    assert exprs
    used = {m for e in exprs for m in re.findall(r"\bhurray_store_[a-z_]+", e)}
    assert used and not used - names, sorted(used - names)
    doc = (ROOT / "docs" / "metrics.md").read_text()
    for m in re.findall(r"`(hurray_store_[a-z_]+)", doc):
        if not m.endswith("_"):  # a family written with "..." or <counter>
            assert m in names or m + "_total" in names or m + "_bucket" in names, m
