"""tools/bench_trace.py's parts: the trace reader (each bad line named), the ideal hit
rate as vLLM counts hits, vLLM's counters read from a Prometheus page, the table; and a
smoke run on a few requests in the vLLM environment: a row starts its servers, vLLM's own
client replays the requests, and every process the tool started is gone afterwards, after
Ctrl-C too. The full run is a benchmark (``make bench-trace``), not a test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import bench_trace as bt  # noqa: E402

VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
needs_vllm = pytest.mark.skipif(
    not VLLM_PY.exists(), reason="the vLLM environment (.venv-vllm): make test builds it"
)


def _line(**over: object) -> str:
    d = {"timestamp": 0, "input_length": 80, "output_length": 4, "hash_ids": [1, 2, 3]}
    d.update(over)
    return json.dumps(d)


def test_the_shipped_trace_reads_and_its_ideal_is_the_traces_own_figure() -> None:
    reqs = bt.read_trace(bt.TRACE)
    assert len(reqs) == 187
    ideal = bt.ideal_hits(reqs, 32)
    # the figures its README gives: 6,526 blocks, 2,255 distinct, 65.4 % hit
    assert (ideal.blocks, ideal.distinct_blocks) == (6526, 2255)
    assert round(ideal.block_rate * 100, 1) == 65.4
    assert ideal.tokens == 208_832
    assert 0.6 < ideal.token_rate <= ideal.block_rate
    assert len(bt.read_trace(bt.TRACE, limit=5)) == 5


@pytest.mark.parametrize(
    ("case", "text"),
    [
        ("not_json", "{not json"),
        ("no_hash_ids", json.dumps({"timestamp": 0, "input_length": 3, "output_length": 1})),
        ("hash_ids_not_a_list", _line(hash_ids=7)),
        ("empty_hash_ids", _line(hash_ids=[])),
        ("zero_input", _line(input_length=0)),
        ("negative_output", _line(output_length=-1)),
        ("input_not_a_number", _line(input_length="many")),
    ],
)
def test_a_bad_trace_line_is_refused_by_its_line_number(
    case: str, text: str, tmp_path: Path
) -> None:
    p = tmp_path / f"{case}.jsonl"
    p.write_text(_line() + "\n" + text + "\n")
    with pytest.raises(ValueError, match=rf"{p.name}:2: "):
        bt.read_trace(p)


def test_an_empty_trace_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "empty.jsonl"
    p.write_text("\n\n")
    with pytest.raises(ValueError, match="no requests"):
        bt.read_trace(p)


def test_the_ideal_counts_whole_blocks_and_never_a_prompts_last_token() -> None:
    R = bt.Request
    # 96 tokens = 3 whole blocks; then the same prompt (vLLM computes its last token: 2
    # blocks hit), then a sibling that shares 2 blocks, then one of 70 tokens (2 whole
    # blocks and a piece of 6) behind the first block
    reqs = [
        R(0, 96, 1, (1, 2, 3)),
        R(1, 96, 1, (1, 2, 3)),
        R(2, 96, 1, (1, 2, 9)),
        R(3, 70, 1, (1, 5, 6)),
    ]
    assert reqs[3].prompt_blocks(32) == (2, 70)
    ideal = bt.ideal_hits(reqs, 32)
    assert ideal.tokens == 96 * 3 + 70
    assert ideal.token_hits == 64 + 64 + 32
    assert (ideal.blocks, ideal.block_hits) == (12, 3 + 2 + 1)
    assert ideal.distinct_blocks == 3 + 1 + 1  # a prompt's last piece of 6 is never cached
    # what the first half saw counts for the second
    seen: set[tuple[int, ...]] = set()
    bt.ideal_hits(reqs[:1], 32, seen)
    assert bt.ideal_hits(reqs[1:], 32, seen).token_hits == 64 + 64 + 32


def test_vllms_counters_are_read_from_its_metrics_page() -> None:
    page = "\n".join([
        "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in tokens.",
        "# TYPE vllm:prefix_cache_queries_total counter",
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0',
        'vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9',
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0',
        'vllm:external_prefix_cache_queries_total{engine="0",model_name="m"} 750.0',
        'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 5e2',
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0',
    ])  # fmt: skip
    c = bt.parse_counters(page)
    assert c == {
        "vllm:prefix_cache_queries": 1000.0,
        "vllm:prefix_cache_hits": 250.0,
        "vllm:external_prefix_cache_queries": 750.0,
        "vllm:external_prefix_cache_hits": 500.0,
    }
    assert bt.hit_rates(c) == (0.25, 0.5, 0.75)


def _bench(duration: float, ttfts: list[float]) -> dict:
    n = len(ttfts)
    return {
        "duration": duration,
        "completed": n,
        "ttfts": ttfts,
        "input_lens": [100] * n,
        "output_lens": [10] * n,
        "start_times": [float(i) for i in range(n)],
        "itls": [[0.01] * 9 for _ in range(n)],
    }


def test_the_table_gives_each_row_as_a_ratio_to_the_first() -> None:
    counters = dict.fromkeys(bt.COUNTERS, 0.0)
    ref = bt.Result(bt.ROWS["apc"], "vLLM's 512 blocks", _bench(10.0, [0.4] * 4), counters)
    hit = {**counters, "vllm:prefix_cache_queries": 400.0, "vllm:external_prefix_cache_hits": 200.0}
    ours = bt.Result(bt.ROWS["hurray"], "cpu 1 GiB + disk 16 GiB", _bench(5.0, [0.1] * 4), hit)
    restart = bt.Result(
        bt.ROWS["restart"], "cpu 1 GiB + disk 16 GiB", _bench(2.0, [0.2] * 2), hit, first=2
    )
    ideal = bt.Ideal(blocks=10, block_hits=6, tokens=400, token_hits=240, distinct_blocks=4)
    out = bt.render([ref, ours, restart], ideal, ideal)
    rows = {ln.split("|")[1].strip(): ln for ln in out.splitlines() if ln.startswith("| ")}
    assert "1.00x (44)" in rows["vLLM's prefix cache alone"]  # 440 tokens in 10 s
    ours_row = rows["hurray_store, cpu + disk"]
    assert "2.00x (88)" in ours_row and "0.25x (100 ms)" in ours_row
    assert "50.0%" in ours_row and "83.3%" in ours_row  # external hit, and 50 % of the ideal 60 %
    # the restart's figures stand beside the other rows' figures for the same requests
    assert "hurray_store after a vLLM restart (a fresh vLLM)" in rows
    assert "| 2 " in rows["hurray_store, cpu + disk (the same vLLM)"]


def _marked(mark: str) -> list[int]:
    """Processes whose environment carries ``mark`` (the tool's servers and their
    children inherit it, whatever they call themselves)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if mark.encode() in (d / "environ").read_bytes():
                    found.append(int(d.name))
            except OSError:
                pass
    return found


def _gone(mark: str, within: float = 30) -> list[int]:
    deadline = time.monotonic() + within
    while (left := _marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _tool(args: list[str], mark: str) -> list[str]:
    return [str(VLLM_PY), str(ROOT / "tools" / "bench_trace.py"), *args]


def _env(mark: str) -> dict[str, str]:
    return {**os.environ, "LMCACHE_TRACK_USAGE": "false", "BENCH_TRACE_TEST_MARK": mark}


@needs_vllm
def test_a_few_requests_replayed_by_vllms_client_against_two_rows(tmp_path: Path) -> None:
    mark = uuid.uuid4().hex
    out = tmp_path / "rows.json"
    args = [
        "--requests",
        "4",
        "--rows",
        "apc,hurray",
        "--work",
        str(tmp_path / "w"),
        "--json",
        str(out),
    ]
    p = subprocess.run(
        _tool(args, mark), capture_output=True, text=True, env=_env(mark), timeout=900
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    rows = {r["row"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"apc", "hurray"}
    assert all(r["completed"] == 4 for r in rows.values())
    assert rows["apc"]["counters"]["vllm:prefix_cache_queries"] > 0
    # the connector saved the prompts' whole blocks, and loaded nothing it did not have
    stats = rows["hurray"]["stats"]
    assert stats["blocks_saved"] > 0 and stats["load_errors"] == 0
    assert "| vLLM's prefix cache alone" in p.stdout and "1.00x" in p.stdout
    assert "[2/2] hurray_store, cpu + disk:" in p.stdout
    assert _gone(mark) == []


@needs_vllm
def test_ctrl_c_stops_every_process_the_tool_started(tmp_path: Path) -> None:
    mark = uuid.uuid4().hex
    work = tmp_path / "w"
    args = ["--requests", "4", "--rows", "server", "--work", str(work)]
    p = subprocess.Popen(
        _tool(args, mark), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env(mark)
    )
    try:
        # the cache server is up and vLLM is starting: both running under the tool
        deadline = time.monotonic() + 300
        while not (work / "server.vllm.log").exists() and time.monotonic() < deadline:
            assert p.poll() is None, p.stdout.read().decode() if p.stdout else ""
            time.sleep(0.5)
        time.sleep(3)
        assert len(_marked(mark)) >= 3  # the tool, the cache server, vLLM
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=120) == 128 + signal.SIGINT
        assert _gone(mark) == []
    finally:
        if p.poll() is None:
            p.kill()
