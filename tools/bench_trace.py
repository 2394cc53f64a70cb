"""A production trace, head to head: vLLM's own client replays a Mooncake-format trace
against vLLM's prefix cache alone, hurray_store and LMCache, and prints one table.

Run it with the vLLM environment (``make bench-trace`` builds both environments first):

    .venv-vllm/bin/python tools/bench_trace.py [--trace FILE] [--rows apc,hurray,...]

What it does, one row after another on this machine:
- builds a random-weight Llama (``--model-layers`` 8, ``--hidden`` 512, 2 KV heads of 64,
  float32) and a word-level tokenizer in its folder (vLLM's ``timed_trace`` dataset draws
  token ids from the tokenizer's vocabulary); nothing is downloaded;
- for each row starts its servers on free loopback ports (vLLM's OpenAI server, and the
  row's cache server where it has one), each in a process group of its own;
- replays the trace with vLLM's own client, ``vllm bench serve --dataset-name timed_trace``
  (closed loop: ``--max-concurrency`` requests in flight, ``PYTHONHASHSEED=0`` so that a
  trace block id gives the same 32 tokens in every row);
- reads vLLM's ``/metrics`` before and after (``vllm:prefix_cache_*``: vLLM's own hits;
  ``vllm:external_prefix_cache_*``: the connector's) and, for hurray_store's rows, the
  connector's counts (blocks loaded and saved, load errors);
- stops every process it started (on every exit path, Ctrl-C included) and prints the
  table: throughput and TTFT as ratios to the first row, hit rates and the share of the
  trace's ideal hit rate (an unbounded prefix cache, counted as vLLM counts: whole blocks,
  never a prompt's last token).

Rows (``--rows``, in this order by default):
- ``apc``: vLLM's prefix cache alone, the reference;
- ``control``: the connector configured as a ``kv_consumer`` over an empty store: what
  configuring a connector alone costs or gives vLLM;
- ``apc-reserved``: vLLM's prefix cache alone with vLLM's default thread binding, which
  keeps a core from the model without a connector (every other row runs with
  ``--vllm-env``, ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``: docs/benchmarks.md says why);
- ``hurray``: hurray_store, cpu tier + disk tier (the default config's tiers, the cpu tier
  at ``--cpu-gib``);
- ``restart``: hurray_store, the trace's first half of requests served by one vLLM process,
  then the second half by a fresh one over the same cache (vLLM's own cache is cold there,
  the disk tier is not); its figures are the second half's, beside the ``hurray`` row's
  figures for the same requests;
- ``apc-restart``: the same split with vLLM's prefix cache alone (what a restart costs
  vLLM without a persistent tier);
- ``server``: hurray_store over the cache server (``hurray-store serve``, a cpu tier of
  ``--cpu-gib``; the engine's only tier is ``remote``): the fleet form;
- ``lmcache``, ``lmcache-32``: LMCache 0.5.6 multiprocess (``lmcache server`` with an L1 of
  ``--cpu-gib``, engine-driven transfers, vLLM's ``LMCacheMPConnector``) at LMCache's
  default chunk of 256 tokens and at 32 (the block size), from ``.venv-lmcache-mp``;
- ``lmcache-l2``: the same at chunk 256 with hurray_store's ``HurrayL2Adapter`` (a disk
  tier) as its L2.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from _bench import free_port, table  # noqa: E402

TRACE = ROOT / "tools" / "traces" / "mooncake-conversation-40.jsonl"
VLLM_ENV = ROOT / ".venv-vllm"
LMCACHE_ENV = ROOT / ".venv-lmcache-mp"
GIB = 1 << 30
# Every vLLM server of every row runs with it: vLLM's CPU worker otherwise keeps one core
# of its OpenMP threads for the scheduler process when no KV connector is configured
# (and none when one is, on this 2-core machine), so vLLM alone would compute on one core
# of two (docs/benchmarks.md, "Why vLLM ran 2x faster with a connector").
VLLM_ENV_VARS = "VLLM_CPU_NUM_OF_RESERVED_CPU=0"
RESERVED = "VLLM_CPU_NUM_OF_RESERVED_CPU"


# --- the trace ---------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """One line of a Mooncake-format trace: a prompt of ``input_length`` tokens made of
    ``block``-token pieces, one per hash id (equal ids are equal pieces)."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def prompt_blocks(self, block: int) -> tuple[int, int]:
        """(whole blocks, tokens) of the prompt vLLM's ``timed_trace`` makes of it: one
        ``block``-token piece per id until ``input_length`` is reached (the last one
        shorter), never more pieces than ids."""
        left, tokens, whole = self.input_length, 0, 0
        for _ in self.hash_ids:
            n = block if left >= block else left
            tokens += n
            whole += n == block
            left -= n
            if left <= 0:
                break
        return whole, tokens


def read_trace(path: Path, limit: int | None = None) -> list[Request]:
    """The trace's requests in file order; ValueError naming the line of a bad one."""
    out: list[Request] = []
    with open(path, encoding="utf-8") as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(out) >= limit:
                break
            try:
                d = json.loads(line)
                r = Request(
                    float(d["timestamp"]),
                    int(d["input_length"]),
                    int(d["output_length"]),
                    tuple(int(h) for h in d["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{no}: not a trace request ({e})") from None
            if r.input_length <= 0 or r.output_length <= 0 or not r.hash_ids:
                raise ValueError(f"{path}:{no}: a request needs input, output and hash ids")
            out.append(r)
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


@dataclass(frozen=True)
class Ideal:
    """What an unbounded prefix cache hits on a trace: by blocks (the trace's own figure)
    and by tokens as vLLM counts them (whole blocks only, never a prompt's last token)."""

    blocks: int
    block_hits: int
    tokens: int
    token_hits: int
    distinct_blocks: int

    @property
    def block_rate(self) -> float:
        return self.block_hits / self.blocks

    @property
    def token_rate(self) -> float:
        return self.token_hits / self.tokens


def ideal_hits(
    reqs: Sequence[Request], block: int, seen: set[tuple[int, ...]] | None = None
) -> Ideal:
    """An unbounded cache of block prefixes over ``reqs`` in order (``seen``: prefixes
    cached before the first, updated in place)."""
    seen = set() if seen is None else seen
    blocks = block_hits = tokens = token_hits = 0
    for r in reqs:
        whole, n = r.prompt_blocks(block)
        hit = 0
        while hit < whole and r.hash_ids[: hit + 1] in seen:
            hit += 1
        blocks += len(r.hash_ids)
        block_hits += sum(r.hash_ids[: i + 1] in seen for i in range(len(r.hash_ids)))
        tokens += n
        token_hits += min(hit, (n - 1) // block) * block
        seen.update(r.hash_ids[: i + 1] for i in range(whole))
    return Ideal(blocks, block_hits, tokens, token_hits, len(seen))


def restart_at(reqs: Sequence[Request]) -> int:
    """Where a restart row's fresh vLLM takes over: the trace's second half."""
    return len(reqs) // 2


def write_trace(reqs: Iterable[Request], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in reqs:
            d = {
                "timestamp": r.timestamp,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }
            f.write(json.dumps(d) + "\n")


# --- the model ---------------------------------------------------------------------


def build_model(out: Path, layers: int, hidden: int, vocab: int = 1024) -> None:
    """A random-weight Llama (2 KV heads of 64, float32) and a word-level tokenizer of
    ``vocab`` words (``<pad>`` ``<s>`` ``</s>`` then ``w3`` ...) in ``out``; a stamp of
    the geometry makes a second call with the same arguments a no-op."""
    stamp = out / "bench-trace.json"
    want = {"layers": layers, "hidden": hidden, "vocab": vocab}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    shutil.rmtree(out, ignore_errors=True)
    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = tf.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    cfg = tf.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).save_pretrained(str(out))
    fast.save_pretrained(str(out))
    stamp.write_text(json.dumps(want))


def kv_bytes_per_block(layers: int, block: int) -> int:
    """K and V of every layer for one block: 2 KV heads of 64, float32."""
    return layers * 2 * 2 * 64 * 4 * block


# --- processes ---------------------------------------------------------------------


class Procs:
    """Every process the tool starts, each in a process group of its own; ``stop_all``
    ends them (SIGTERM, then SIGKILL) and runs at exit and on SIGINT/SIGTERM."""

    def __init__(self) -> None:
        self.live: list[subprocess.Popen[bytes]] = []
        atexit.register(self.stop_all)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stop_all()
        raise SystemExit(128 + signum)

    def start(
        self, cmd: Sequence[str], log: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            p = subprocess.Popen(
                list(cmd),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=ROOT,
                start_new_session=True,
            )
        self.live.append(p)
        return p

    def stop(self, p: subprocess.Popen[bytes], grace: float = 60) -> None:
        """SIGTERM to the process (vLLM's server and LMCache's shut their children down in
        order: a vLLM worker writes its queued saves first), then SIGKILL to its whole
        process group: the leader after ``grace`` seconds, any child it left behind."""
        if p in self.live:
            self.live.remove(p)
        if p.poll() is None:
            p.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()

    def stop_all(self) -> None:
        for p in list(reversed(self.live)):
            self.stop(p, grace=20)


def wait_http(
    url: str, proc: subprocess.Popen[bytes], what: str, log: Path, timeout: float
) -> None:
    """Wait until ``url`` answers 200; RuntimeError (with the log's tail) when the process
    exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} did not answer {url} in {timeout:.0f} s:\n{tail(log)}")


def tail(log: Path, n: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-n:]
    except OSError:
        return ""


# --- metrics -----------------------------------------------------------------------

METRIC = re.compile(r"^(vllm:[a-z_]+?)(?:_total)?(?:\{[^}]*\})? ([0-9.eE+-]+)$")
COUNTERS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
)


def parse_counters(text: str) -> dict[str, float]:
    """vLLM's prefix-cache counters from a Prometheus page (summed over labels)."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        m = METRIC.match(line)
        if m and m.group(1) in out:
            out[m.group(1)] += float(m.group(2))
    return out


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return parse_counters(r.read().decode())


# --- rows --------------------------------------------------------------------------


@dataclass
class Row:
    key: str
    label: str
    connector: str = ""  # "" | "hurray" | "lmcache"
    role: str = "kv_both"
    store: str = ""  # hurray: "empty" | "tiers" | "server"; lmcache: "" | "l2"
    chunk: int = 256
    restart: bool = False
    env: dict[str, str] = field(default_factory=dict)


ROWS = {
    r.key: r
    for r in (
        Row("apc", "vLLM's prefix cache alone"),
        Row(
            "apc-reserved", "vLLM's prefix cache alone, vLLM's default binding", env={RESERVED: ""}
        ),
        Row("control", "connector as kv_consumer, empty store", "hurray", "kv_consumer", "empty"),
        Row("hurray", "hurray_store, cpu + disk", "hurray", store="tiers"),
        Row("restart", "hurray_store after a vLLM restart", "hurray", store="tiers", restart=True),
        Row("apc-restart", "vLLM's prefix cache alone after a restart", restart=True),
        Row("server", "hurray_store over the cache server", "hurray", store="server"),
        Row("lmcache", "LMCache 0.5.6 multiprocess, chunk 256", "lmcache"),
        Row("lmcache-32", "LMCache 0.5.6 multiprocess, chunk 32", "lmcache", chunk=32),
        Row("lmcache-l2", "LMCache 0.5.6 multiprocess + HurrayL2Adapter", "lmcache", store="l2"),
    )
}
DEFAULT_ROWS = (
    "apc,apc-reserved,control,hurray,restart,apc-restart,server,lmcache,lmcache-32,lmcache-l2"
)


@dataclass
class Result:
    row: Row
    capacity: str
    bench: dict  # vllm bench serve's saved result (per-request details included)
    counters: dict[str, float]
    stats: dict = field(default_factory=dict)  # the connector's counts (hurray rows)
    first: int = 0  # index in the trace of the first request measured


class Bench:
    def __init__(self, a: argparse.Namespace, work: Path, procs: Procs) -> None:
        self.a = a
        self.work = work
        self.procs = procs
        self.model = work / "model"
        self.block = 32
        self.vllm_env = dict(kv.split("=", 1) for kv in a.vllm_env.split(",") if kv)

    # the servers of a row

    def vllm_cmd(self, row: Row, port: int, kv: dict | None) -> list[str]:
        env = LMCACHE_ENV if row.connector == "lmcache" else VLLM_ENV
        kv_bytes = self.a.kv_blocks * kv_bytes_per_block(self.a.model_layers, self.block)
        cmd = [
            str(env / "bin" / "vllm"), "serve", str(self.model),
            "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--block-size", str(self.block),
            "--max-model-len", "8192", "--max-num-seqs", str(self.a.concurrency),
            "--enforce-eager", "--kv-cache-memory-bytes", str(kv_bytes),
            "--seed", "0", "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        return cmd

    def start_vllm(
        self, row: Row, kv: dict | None, tag: str
    ) -> tuple[subprocess.Popen[bytes], int]:
        port = free_port()
        log = self.work / f"{row.key}{tag}.vllm.log"
        env = {**os.environ, **self.vllm_env, **row.env, "LMCACHE_TRACK_USAGE": "false"}
        env = {k: v for k, v in env.items() if v}  # a row's "" unsets a variable
        p = self.procs.start(self.vllm_cmd(row, port, kv), log, env)
        wait_http(
            f"http://127.0.0.1:{port}/health", p, f"vLLM ({row.key})", log, self.a.start_timeout
        )
        return p, port

    def hurray_kv(self, row: Row, cfg: Path, stats: Path) -> dict:
        return {
            "kv_connector": "HurrayConnector",
            "kv_connector_module_path": "hurray_store.adapters.vllm",
            "kv_role": row.role,
            "kv_connector_extra_config": {"config": str(cfg), "stats_file": str(stats)},
        }

    def hurray_config(self, row: Row, d: Path) -> tuple[Path, str, subprocess.Popen[bytes] | None]:
        """The engine's YAML for a hurray row; its capacity in words; the cache server."""
        cpu = int(self.a.cpu_gib * GIB)
        disk = {"type": "disk", "path": str(d / "disk"), "capacity_bytes": 16 * GIB, "fsync": False}
        server = None
        if row.store == "empty":
            tiers: list[dict] = [{"type": "cpu", "capacity_bytes": cpu}]
            cap = "nothing stored (kv_consumer)"
        elif row.store == "tiers":
            tiers = [{"type": "cpu", "capacity_bytes": cpu}, disk]
            cap = f"cpu {self.a.cpu_gib:g} GiB + disk 16 GiB"
        else:
            port, mport = free_port(), free_port()
            scfg = d / "server.yaml"
            scfg.write_text(json.dumps({
                "namespace": "bench",
                "tiers": [{"type": "cpu", "capacity_bytes": cpu}],
                "server": {"host": "127.0.0.1", "port": port,
                           "metrics_host": "127.0.0.1", "metrics_port": mport},
            }))  # fmt: skip
            log = self.work / f"{row.key}.server.log"
            server = self.procs.start(
                [str(VLLM_ENV / "bin" / "hurray-store"), "serve", "--config", str(scfg)], log
            )
            wait_http(f"http://127.0.0.1:{mport}/readyz", server, "hurray-store serve", log, 60)
            tiers = [{"type": "remote", "url": f"hurray://127.0.0.1:{port}", "connections": 4}]
            cap = f"server cpu {self.a.cpu_gib:g} GiB"
        cfg = d / "store.yaml"
        cfg.write_text(json.dumps({"namespace": "bench", "tiers": tiers}))  # JSON is YAML
        return cfg, cap, server

    def lmcache_server(self, row: Row, d: Path) -> tuple[subprocess.Popen[bytes], int, str]:
        port, http = free_port(), free_port()
        cmd = [
            str(LMCACHE_ENV / "bin" / "lmcache"), "server",
            "--host", "127.0.0.1", "--port", str(port),
            "--http-host", "127.0.0.1", "--http-port", str(http),
            "--l1-size-gb", f"{self.a.cpu_gib:g}", "--eviction-policy", "LRU",
            "--chunk-size", str(row.chunk), "--supported-transfer-mode", "engine_driven",
        ]  # fmt: skip
        cap = f"L1 {self.a.cpu_gib:g} GiB"
        if row.store == "l2":
            cfg = d / "l2.yaml"
            disk = {
                "type": "disk",
                "path": str(d / "l2"),
                "capacity_bytes": 16 * GIB,
                "fsync": False,
            }
            cfg.write_text(json.dumps({"namespace": "bench", "tiers": [disk]}))
            adapter = {
                "type": "plugin",
                "module_path": "hurray_store.adapters.lmcache",
                "class_name": "HurrayL2Adapter",
                "adapter_params": {"config": str(cfg), "model_path": str(self.model)},
            }
            cmd += ["--l2-adapter", json.dumps(adapter)]
            cap += " + L2 (hurray_store disk 16 GiB)"
        log = self.work / f"{row.key}.lmcache.log"
        env = {**os.environ, "LMCACHE_TRACK_USAGE": "false"}
        p = self.procs.start(cmd, log, env)
        wait_http(f"http://127.0.0.1:{http}/status", p, "lmcache server", log, 120)
        return p, port, cap

    # the client

    def replay(self, row: Row, port: int, trace: Path, n: int, tag: str) -> dict:
        out = self.work / f"{row.key}{tag}.result.json"
        cmd = [
            str(VLLM_ENV / "bin" / "vllm"), "bench", "serve",
            "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}",
            "--model", str(self.model), "--tokenizer", str(self.model),
            "--dataset-name", "timed_trace", "--dataset-path", str(trace),
            "--timed-trace-chunk-hash-size", str(self.block), "--num-prompts", str(n),
            "--no-self-timed", "--max-concurrency", str(self.a.concurrency),
            "--request-rate", "inf",
            "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--save-detailed", "--result-dir", str(self.work),
            "--result-filename", out.name, "--disable-tqdm",
        ]  # fmt: skip
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        log = self.work / f"{row.key}{tag}.client.log"
        p = self.procs.start(cmd, log, env)
        rc = p.wait()
        self.procs.stop(p)
        if rc or not out.exists():
            raise RuntimeError(f"vllm bench serve ({row.key}) failed ({rc}):\n{tail(log)}")
        res: dict = json.loads(out.read_text())
        if res.get("completed", 0) != n:
            raise RuntimeError(
                f"{row.key}: {res.get('completed')} of {n} requests completed:\n{tail(log)}"
            )
        return res

    def run_row(self, row: Row, reqs: list[Request]) -> Result:
        d = self.work / row.key
        d.mkdir(parents=True, exist_ok=True)
        server: subprocess.Popen[bytes] | None = None
        kv: dict | None = None
        stats = d / "connector-stats.json"
        cap = f"vLLM's {self.a.kv_blocks} blocks"
        try:
            if row.connector == "hurray":
                cfg, cap, server = self.hurray_config(row, d)
                kv = self.hurray_kv(row, cfg, stats)
            elif row.connector == "lmcache":
                server, lport, cap = self.lmcache_server(row, d)
                kv = {
                    "kv_connector": "LMCacheMPConnector",
                    "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {
                        "lmcache.mp.host": "tcp://127.0.0.1",
                        "lmcache.mp.port": lport,
                    },
                }
            first = restart_at(reqs) if row.restart else 0
            if row.restart:
                # the first half fills the cache; its vLLM stops (saves flushed at shutdown)
                head = d / "first-half.jsonl"
                write_trace(reqs[:first], head)
                p, port = self.start_vllm(row, kv, ".first")
                self.replay(row, port, head, first, ".first")
                self.procs.stop(p)
            trace = d / "trace.jsonl"
            write_trace(reqs[first:], trace)
            p, port = self.start_vllm(row, kv, "")
            before = scrape(port)
            res = self.replay(row, port, trace, len(reqs) - first, "")
            after = scrape(port)
            self.procs.stop(p)
        finally:
            if server is not None:
                self.procs.stop(server)
        counters = {k: after[k] - before[k] for k in COUNTERS}
        got = json.loads(stats.read_text()) if stats.exists() else {}
        return Result(row, cap, res, counters, got, first)


# --- the table ---------------------------------------------------------------------


def pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


@dataclass(frozen=True)
class Figures:
    """One row's figures over a set of its requests."""

    requests: int
    duration: float
    tokens: int  # prompt + output tokens
    ttft: tuple[float, ...]  # seconds

    @property
    def tok_s(self) -> float:
        return self.tokens / self.duration

    @property
    def req_s(self) -> float:
        return self.requests / self.duration

    @property
    def mean_ttft(self) -> float:
        return sum(self.ttft) / len(self.ttft)


def figures(bench: dict, keep: Callable[[int], bool] = lambda i: True) -> Figures:
    """A saved ``vllm bench serve`` result's figures; ``keep(i)``: the requests (by their
    index in the replayed trace) to count. The whole run is timed by the client's own
    duration; a part of it from the first kept request's start to the last one's end."""
    ttfts = bench["ttfts"]
    idx = [i for i in range(len(ttfts)) if keep(i)]
    tokens = sum(bench["input_lens"][i] + bench["output_lens"][i] for i in idx)
    if len(idx) == len(ttfts):
        duration = float(bench["duration"])
    else:
        starts = bench["start_times"]
        ends = [starts[i] + bench["ttfts"][i] + sum(bench["itls"][i]) for i in idx]
        duration = max(ends) - min(starts[i] for i in idx)
    return Figures(len(idx), duration, tokens, tuple(ttfts[i] for i in idx))


def hit_rates(c: dict[str, float]) -> tuple[float, float, float]:
    """(vLLM's own, the external tier's, both) as shares of the prompt tokens vLLM looked
    up (the external tier is asked for what vLLM's cache did not hold)."""
    q = c["vllm:prefix_cache_queries"] or float("nan")
    own, ext = c["vllm:prefix_cache_hits"], c["vllm:external_prefix_cache_hits"]
    return own / q, ext / q, (own + ext) / q


def ratio(x: float, ref: float, raw: str) -> str:
    return f"{x / ref:.2f}x ({raw})"


def render(results: list[Result], ideal: Ideal, ideal_tail: Ideal | None) -> str:
    """The head-to-head table (each figure a ratio to the first row), then the restart
    comparison where a restart row ran."""
    full = [r for r in results if not r.row.restart]
    lines = []
    if full:
        ref = figures(full[0].bench)
        rows = []
        for r in full:
            f = figures(r.bench)
            own, ext, both = hit_rates(r.counters)
            rows.append([
                r.row.label, r.capacity,
                ratio(f.tok_s, ref.tok_s, f"{f.tok_s:,.0f}"),
                ratio(f.req_s, ref.req_s, f"{f.req_s:.2f}"),
                ratio(f.mean_ttft, ref.mean_ttft, f"{f.mean_ttft * 1e3:,.0f} ms"),
                f"{pct(f.ttft, 50) * 1e3:,.0f} ms", f"{pct(f.ttft, 99) * 1e3:,.0f} ms",
                f"{own:.1%}", f"{ext:.1%}", f"{both:.1%}", f"{both / ideal.token_rate:.1%}",
            ])  # fmt: skip
        lines.append(
            table(
                [
                    "row",
                    "capacity",
                    "tok/s",
                    "req/s",
                    "mean TTFT",
                    "p50 TTFT",
                    "p99 TTFT",
                    "vLLM hit",
                    "external hit",
                    "both",
                    "x ideal",
                ],
                rows,
            )  # fmt: skip
        )
    restarts = [r for r in results if r.row.restart]
    if restarts and ideal_tail is not None:
        first = restarts[0].first
        # every row's figures over the second half's requests; a restart row measured only those
        half = [
            (r, figures(r.bench) if r.row.restart else figures(r.bench, lambda i: i >= first))
            for r in results
        ]
        warm = next((f for r, f in half if r.row.key == "hurray"), half[0][1])
        rows = [
            [
                r.row.label + (" (a fresh vLLM)" if r.row.restart else " (the same vLLM)"),
                f.requests,
                f"{f.tok_s:,.0f}",
                ratio(f.mean_ttft, warm.mean_ttft, f"{f.mean_ttft * 1e3:,.0f} ms"),
                f"{pct(f.ttft, 50) * 1e3:,.0f} ms",
                f"{hit_rates(r.counters)[2]:.1%}" if r.row.restart else "-",
            ]
            for r, f in half
        ]
        lines.append(
            f"\nThe trace's second half (requests {first} on; an unbounded cache that saw the "
            f"first half hits {ideal_tail.token_rate:.1%} of its prompt tokens), mean TTFT as a "
            "ratio to hurray_store's warm row:\n"
        )
        heads = ["row", "requests", "tok/s", "mean TTFT", "p50 TTFT", "hit (both)"]
        lines.append(table(heads, rows))
    lines.append(
        f"\nIdeal (an unbounded prefix cache): {ideal.block_rate:.1%} of the trace's blocks, "
        f"{ideal.token_rate:.1%} of its prompt tokens as vLLM counts hits; "
        f"{ideal.distinct_blocks:,} distinct blocks."
    )
    return "\n".join(lines)


# --- main --------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trace", type=Path, default=TRACE, help="a Mooncake-format trace (JSONL)")
    ap.add_argument("--requests", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--rows", default=DEFAULT_ROWS, help=f"comma-separated, of: {', '.join(ROWS)}")
    ap.add_argument("--model-layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--kv-blocks", type=int, default=512, help="blocks of 32 in vLLM's KV cache")
    ap.add_argument("--concurrency", type=int, default=2, help="requests in flight")
    ap.add_argument(
        "--cpu-gib", type=float, default=1.0, help="the cpu tier's and LMCache L1's size"
    )
    ap.add_argument(
        "--vllm-env", default=VLLM_ENV_VARS, help="every vLLM server's environment (K=V,...)"
    )
    ap.add_argument("--start-timeout", type=float, default=300, help="seconds for vLLM to start")
    ap.add_argument("--work", type=Path, default=None, help="keep logs and results here")
    ap.add_argument("--json", type=Path, default=None, help="write the rows' figures here too")
    a = ap.parse_args(argv)

    keys = [k.strip() for k in a.rows.split(",") if k.strip()]
    bad = [k for k in keys if k not in ROWS]
    if bad or not keys:
        ap.error(f"--rows: unknown {', '.join(bad) or '(none)'}; rows are {', '.join(ROWS)}")
    if (
        any(ROWS[k].connector == "lmcache" for k in keys)
        and not (LMCACHE_ENV / "bin" / "lmcache").exists()
    ):
        ap.error(f"the LMCache rows need {LMCACHE_ENV.name}: run `make lmcache-mp-env`")
    if not (VLLM_ENV / "bin" / "vllm").exists():
        ap.error(f"needs {VLLM_ENV.name} (`make vllm-env`)")
    reqs = read_trace(a.trace, a.requests)
    ideal = ideal_hits(reqs, 32)
    seen: set[tuple[int, ...]] = set()
    ideal_hits(reqs[: restart_at(reqs)], 32, seen)
    ideal_tail = ideal_hits(reqs[restart_at(reqs) :], 32, seen)

    work = a.work or Path(tempfile.mkdtemp(prefix="bench-trace-"))
    work.mkdir(parents=True, exist_ok=True)
    procs = Procs()
    bench = Bench(a, work, procs)
    print(
        f"trace {a.trace.name}: {len(reqs)} requests, {ideal.tokens:,} prompt tokens; an unbounded "
        f"cache hits {ideal.token_rate:.1%} of them. Model: {a.model_layers} layers, hidden "
        f"{a.hidden}; vLLM's KV cache {a.kv_blocks} blocks of 32; {a.concurrency} in flight. "
        f"Logs in {work}",
        flush=True,
    )
    build_model(bench.model, a.model_layers, a.hidden)
    results: list[Result] = []
    t_all = time.monotonic()
    try:
        for i, k in enumerate(keys, 1):
            row = ROWS[k]
            print(f"[{i}/{len(keys)}] {row.label}: starting", flush=True)
            t0 = time.monotonic()
            r = bench.run_row(row, reqs)
            results.append(r)
            f = figures(r.bench)
            print(
                f"[{i}/{len(keys)}] {row.label}: {f.tok_s:,.0f} tok/s, mean TTFT "
                f"{f.mean_ttft * 1e3:,.0f} ms, hit {hit_rates(r.counters)[2]:.1%} "
                f"({time.monotonic() - t0:.0f} s)",
                flush=True,
            )
    finally:
        procs.stop_all()
    print(f"\n{len(results)} rows in {time.monotonic() - t_all:.0f} s\n")
    print(render(results, ideal, ideal_tail if any(r.row.restart for r in results) else None))
    for r in results:
        if r.stats:
            s = r.stats
            print(
                f"{r.row.key}: the connector loaded {s.get('blocks_loaded', 0):,} blocks, saved "
                f"{s.get('blocks_saved', 0):,}; load errors {s.get('load_errors', 0)}, saves "
                f"failed {s.get('saves_failed', 0)}, dropped {s.get('saves_dropped', 0)}"
            )
    if a.json:
        keep = ("duration", "completed", "total_input_tokens", "total_output_tokens",
                "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms")  # fmt: skip
        a.json.write_text(json.dumps([
            {"row": r.row.key, "capacity": r.capacity, "counters": r.counters, "stats": r.stats,
             "first": r.first, **{k: r.bench[k] for k in keep if k in r.bench}}
            for r in results
        ], indent=1))  # fmt: skip
    if a.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
