"""The GPU check: hurray_store's CUDA paths in one command, without vLLM.

    python tools/gpu_check.py                 # on CUDA (an H200: about 2-4 minutes)
    python tools/gpu_check.py --device cpu    # the same checks on the CPU (CI runs it)

On a machine that has torch with CUDA, transformers, safetensors, xxhash, PyYAML and
prometheus_client but not the rest (no network): ``make gpu-wheels`` here puts the
wheels of pyhurray, redis-py and aiofiles in ``build/gpu-wheels``; there::

    pip install --no-index --no-deps build/gpu-wheels/*.whl
    PYTHONPATH=. python tools/gpu_check.py --out gpu_check.md

Checks, each a PASS or FAIL line (the exit status is 1 if any failed):

1. ``layouts``: ``vllm/layout.py: pages_of`` / ``write_pages`` on the device, for every
   ``KVCacheLayout``, fp16/bf16/fp32, kernel blocks smaller than manager blocks and a V
   of another head size, against the same calls on a CPU copy: identical pages, and the
   whole buffer identical after the writes.
2. ``transfers``: the connector's data path (``vllm/transfer.py: BlockTransfers``: side
   stream, pinned host buffers, events) on device KV views of Qwen2.5-0.5B's geometry
   in FlashAttention's layout (LBNHC): saves written to a cpu + disk store behind the
   caller, a fresh store loads them into other blocks of views in FlashInfer's layout
   (LBHNC), exact.
3. ``store``: ``configs/gpu.yaml`` (gpu -> cpu -> disk; the gpu tier on ``--device``, the
   disk in a temporary folder): put and retrieve of device pools with a shared prefix,
   exact, and again from the disk alone in a fresh store.
4. ``speed``: GB/s of the save path (copy-out of blocks into pinned buffers) and the
   load path (pinned pages into blocks) against torch's pinned copies of the same bytes
   in the same run.
5. ``prefill``: ``prefill_with_cache`` with a random model of Qwen2.5-0.5B's geometry in
   bfloat16 on the device: next-token logits loaded vs recomputed (same top token,
   cosine), and the time to first token with and without the cache.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hurray_store import KVSpec, PagedKVPool  # noqa: E402
from hurray_store.adapters.vllm.layout import LAYOUTS, allocate, pages_of, write_pages  # noqa: E402
from hurray_store.adapters.vllm.transfer import BlockTransfers, Transfer  # noqa: E402
from hurray_store.engine import EnginePort  # noqa: E402
from hurray_store.store import open_store  # noqa: E402

# Qwen2.5-0.5B: 24 layers, hidden 896, 14 query heads, 2 KV heads of 64.
QWEN = {"layers": 24, "hidden": 896, "heads": 14, "kv_heads": 2, "head_dim": 64}

Rows = list[str]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def layer_views(
    layout: str, dtype: torch.dtype, L: int, B: int, H: int, N: int, C: int, device: Any, seed: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A buffer in ``layout``'s memory order, random, and its per-layer ``[B, H, N, C]``
    views, as vLLM allocates them."""
    raw, views = allocate(layout, (L, B, H, N, C), dtype, device)
    g = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randn(raw.shape, generator=g).to(dtype))
    return raw, views


def check_layouts(device: torch.device, quick: bool) -> Rows:
    cases = [  # heads, kernel tokens, kernel blocks per block, head size, V head size
        (2, 16, 1, 64, 64),
        (8, 16, 1, 128, 128),
        (4, 8, 2, 64, 64),
        (2, 16, 1, 64, 32),
    ]
    dtypes = [torch.bfloat16] if quick else [torch.float16, torch.bfloat16, torch.float32]
    n = 0
    for layout in sorted(LAYOUTS):
        for dtype in dtypes:
            for ci, (H, nk, r, hs, hv) in enumerate(cases):
                raw, views = layer_views(layout, dtype, 2, 12 * r, H, nk, hs + hv, device, ci)
                cpu_raw, cpu_views = layer_views(
                    layout, dtype, 2, 12 * r, H, nk, hs + hv, "cpu", ci
                )
                ids = [9, 2, 5, 11]
                kw = {"block_size": nk * r}
                for v, cv in zip(views, cpu_views, strict=True):
                    k, val = pages_of(v, layout, hs, ids, **kw)
                    ck, cval = pages_of(cv, layout, hs, ids, **kw)
                    assert torch.equal(k.cpu(), ck) and torch.equal(val.cpu(), cval), layout
                    g = torch.Generator().manual_seed(n)
                    nk2 = torch.randn(ck.shape, generator=g).to(dtype)
                    nv2 = torch.randn(cval.shape, generator=g).to(dtype)
                    write_pages(v, layout, hs, [3, 0], nk2[:2].to(device), nv2[:2].to(device), **kw)
                    write_pages(cv, layout, hs, [3, 0], nk2[:2], nv2[:2], **kw)
                    n += 1
                sync(device)
                assert torch.equal(raw.cpu(), cpu_raw), f"{layout} {dtype} case {ci}: writes differ"
    return [f"{n} layer views: pages and writes on {device} == on the CPU, every layout"]


def qwen_spec(layers: int, dtype: torch.dtype, page: int = 16) -> KVSpec:
    return KVSpec("gpu-check", layers, QWEN["kv_heads"], QWEN["head_dim"], page, dtype)


def _store_cfg(work: Path, name: str) -> dict[str, Any]:
    disk = {"type": "disk", "path": str(work / name), "capacity_bytes": 1 << 34}
    return {"namespace": "gpucheck", "tiers": [{"type": "cpu", "capacity_bytes": 1 << 32}, disk]}


def check_transfers(device: torch.device, layers: int, work: Path) -> Rows:
    sp = qwen_spec(layers, torch.bfloat16)
    H, D, bs = sp.num_kv_heads, sp.head_dim, sp.page_size
    _, src = layer_views("LBNHC", sp.dtype, layers, 64, H, bs, 2 * D, device, 1)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 150000, (n * bs,), generator=g).tolist() for n in (8, 5, 3)]
    blocks = [list(range(40, 48)), [3, 9, 1, 60, 33], [20, 21, 22]]
    pairs = enumerate(zip(prompts, blocks, strict=True))
    saves = [Transfer(f"r{i}", p, b, 0, b"") for i, (p, b) in pairs]
    st = EnginePort(_store_cfg(work, "transfers"), name="gpu-check-save", saves_in_flight=1)
    try:
        xfer = BlockTransfers(st, sp, src, "LBNHC")
        t0 = time.perf_counter()
        xfer.save(saves)
        returned = time.perf_counter() - t0
        assert xfer.drain(120) and xfer.counts["blocks_saved"] == 16, xfer.counts
    finally:
        st.close()
    st2 = EnginePort(_store_cfg(work, "transfers"), name="gpu-check-load", saves_in_flight=1)
    try:
        _, dst = layer_views("LBHNC", sp.dtype, layers, 64, H, bs, 2 * D, device, 3)
        xfer2 = BlockTransfers(st2, sp, dst, "LBHNC")
        there = [list(range(0, 8)), list(range(10, 15)), list(range(50, 53))]
        pairs = enumerate(zip(prompts, there, strict=True))
        loads = [Transfer(f"r{i}", p, t, 0, b"") for i, (p, t) in pairs]
        loading = xfer2.start_load(loads)
        for li in range(layers):
            assert xfer2.wait_layer(loading, li, 120)
        got = xfer2.finish_load(loading, 120)
        sync(device)
        assert got == [len(p) for p in prompts], got
        for s_v, d_v in zip(src, dst, strict=True):
            for b_src, b_dst in zip(blocks, there, strict=True):
                for x, y in zip(b_src, b_dst, strict=True):
                    assert torch.equal(s_v[x].cpu(), d_v[y].cpu())
    finally:
        st2.close()
    return [
        f"16 blocks x {layers} layers saved from LBNHC views (save() returned in "
        f"{returned * 1e3:.2f} ms), loaded by a fresh store into LBHNC views: exact"
    ]


def _pool(sp: KVSpec, n: int, device: Any, seed: int) -> PagedKVPool:
    pool = PagedKVPool(sp, n, device=device)
    g = torch.Generator().manual_seed(seed)
    for layer in pool.layers:
        layer.copy_(torch.randn(layer.shape, generator=g).to(sp.dtype))
    return pool


def check_store(device: torch.device, layers: int, work: Path) -> Rows:
    cfg = yaml.safe_load((ROOT / "configs" / "gpu.yaml").read_text())
    cfg["tiers"][0]["device"] = str(device) if device.type == "cpu" else "cuda:0"
    cfg["tiers"][2]["path"] = str(work / "gpu-yaml-disk")
    for t in cfg["tiers"][:2]:  # an unpinned cpu tier reserves its capacity up front
        t["capacity_bytes"] = min(int(t["capacity_bytes"]), 4 << 30)
    sp = qwen_spec(layers, torch.bfloat16)
    src = _pool(sp, 64, device, 4)
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 150000, (4 * sp.page_size,), generator=g).tolist()
    toks = [
        prefix + torch.randint(0, 150000, (n * sp.page_size,), generator=g).tolist() for n in (3, 1)
    ]
    shared = src.allocate(4)
    tables = [shared + src.allocate(3), shared + src.allocate(1)]

    async def go() -> list[str]:
        out = []
        async with await open_store(cfg) as store:
            r = await store.put(src, toks, tables)
            assert r.pages_written == 8, r
            await store.flush()
            dst = PagedKVPool(sp, 32, device=device)
            got = await store.retrieve(dst, toks)
            assert got.num_tokens == [len(t) for t in toks], got.num_tokens
            _same(src, tables, dst, got.block_tables)
            assert got.block_tables[0][:4] == got.block_tables[1][:4]  # shared once
            out.append("configs/gpu.yaml: 8 pages put from a device pool, retrieved exact")
        cfg_disk = {"namespace": cfg.get("namespace", "hurray"), "tiers": [cfg["tiers"][2]]}
        async with await open_store(cfg_disk) as store:
            dst = PagedKVPool(sp, 32, device=device)
            got = await store.retrieve(dst, toks)
            assert got.num_tokens == [len(t) for t in toks], got.num_tokens
            _same(src, tables, dst, got.block_tables)
            out.append("a fresh store on its disk tier alone: retrieved exact")
        return out

    return asyncio.run(go())


def _same(src: PagedKVPool, st: list[list[int]], dst: PagedKVPool, dt: list[list[int]]) -> None:
    for a, b in zip(src.layers, dst.layers, strict=True):
        for ts, td in zip(st, dt, strict=True):
            assert torch.equal(a[:, ts].cpu(), b[:, td].cpu())


def _timed(fn: Callable[[], Any], device: torch.device, reps: int = 5) -> float:
    fn()  # warm up
    sync(device)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def check_speed(device: torch.device, layers: int, work: Path) -> Rows:
    sp = qwen_spec(layers, torch.bfloat16)
    H, D, bs = sp.num_kv_heads, sp.head_dim, sp.page_size
    nb = 512  # 96 MiB of Qwen2.5-0.5B's KV on 24 layers
    _, views = layer_views("LBNHC", sp.dtype, layers, nb + 8, H, bs, 2 * D, device, 6)
    st = EnginePort(_store_cfg(work, "speed"), name="gpu-check-speed", saves_in_flight=1)
    try:
        xfer = BlockTransfers(st, sp, views, "LBNHC")
        ids = list(range(3, 3 + nb))
        nbytes = nb * xfer.page_bytes
        pin = device.type == "cuda"

        def save() -> None:
            bufs, ev = xfer.copy_out(ids)
            if ev is not None:
                ev.synchronize()

        dev_src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        t_save = _timed(save, device)
        t_d2h = _timed(lambda: host.copy_(dev_src, non_blocking=pin), device)
        pool_layers = [b for b in xfer.copy_out(ids)[0]]
        sync(device)
        src_pages = list(range(nb))

        def load() -> None:
            evs = [xfer.copy_in(pool_layers[li], li, src_pages, ids) for li in range(layers)]
            for ev in evs:
                if ev is not None:
                    ev.synchronize()

        t_load = _timed(load, device)
        t_h2d = _timed(lambda: dev_src.copy_(host, non_blocking=pin), device)
    finally:
        st.close()
    gb = nbytes / 1e9
    d2h, h2d = ("D2H", "H2D") if pin else ("copy", "copy")
    return [
        f"save path (blocks -> pinned buffers): {gb / t_save:.1f} GB/s; torch {d2h} of "
        f"the same {nbytes >> 20} MiB: {gb / t_d2h:.1f} GB/s; ratio {t_d2h / t_save:.2f}",
        f"load path (pinned pages -> blocks): {gb / t_load:.1f} GB/s; torch {h2d}: "
        f"{gb / t_h2d:.1f} GB/s; ratio {t_h2d / t_load:.2f}",
    ]


def check_prefill(device: torch.device, layers: int, tokens: int, work: Path) -> Rows:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hurray_store.adapters.transformers import prefill_with_cache, run_model, spec_for_model

    cfg = Qwen2Config(
        vocab_size=151936,
        hidden_size=QWEN["hidden"],
        intermediate_size=4864,
        num_hidden_layers=layers,
        num_attention_heads=QWEN["heads"],
        num_key_value_heads=QWEN["kv_heads"],
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
    sp = spec_for_model(model, page_size=16)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 151936, (tokens,), generator=g).tolist()

    async def go() -> Rows:
        async with await open_store(_store_cfg(work, "prefill")) as store:
            pool = PagedKVPool(sp, tokens // 16 + 2, device=device)
            with torch.inference_mode():
                full, _ = run_model(model, torch.tensor([ids], device=device))
                ref = full[0, -1].float()

                def recompute() -> None:
                    run_model(model, torch.tensor([ids], device=device))

                t_full = _timed(recompute, device, reps=3)
                _, _, n0 = await prefill_with_cache(model, store, pool, ids)  # stores it
                assert n0 == 0
                await store.flush()
                times = []
                for _ in range(3):
                    sync(device)
                    t0 = time.perf_counter()
                    logits, _, n = await prefill_with_cache(
                        model, store, pool, ids, store_result=False
                    )
                    sync(device)
                    times.append(time.perf_counter() - t0)
                got = logits[0, -1].float()
        assert n == (tokens - 1) // 16 * 16, n
        cos = torch.nn.functional.cosine_similarity(got, ref, dim=0).item()
        same_top = int(got.argmax()) == int(ref.argmax())
        diff = (got - ref).abs().max().item()
        assert same_top and cos > 0.999, (same_top, cos, diff)
        t_cache = statistics.median(times)
        return [
            f"{layers} layers, {tokens} tokens, bf16: {n} loaded; next-token logits vs "
            f"recompute: same top token, cosine {cos:.6f}, max |diff| {diff:.4f}",
            f"TTFT: recompute {t_full * 1e3:.1f} ms, with the cache {t_cache * 1e3:.1f} ms "
            f"({t_cache / t_full:.2f}x)",
        ]

    return asyncio.run(go())


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=None, help="default: 24 on CUDA, 2 on the CPU")
    ap.add_argument("--tokens", type=int, default=None, help="default: 2000 on CUDA, 256 on CPU")
    ap.add_argument("--quick", action="store_true", help="bf16 only in the layout check")
    ap.add_argument("--out", default="", help="also write the report (markdown) here")
    a = ap.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    cuda = device.type == "cuda"
    layers = a.layers or (24 if cuda else 2)
    tokens = a.tokens or (2000 if cuda else 256)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    head = [
        f"# gpu_check on {name} ({device}), torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
    ]
    checks: list[tuple[str, Callable[[], Rows]]] = [
        ("layouts", lambda: check_layouts(device, a.quick)),
        ("transfers", lambda: check_transfers(device, layers, work)),
        ("store", lambda: check_store(device, layers, work)),
        ("speed", lambda: check_speed(device, layers, work)),
        ("prefill", lambda: check_prefill(device, layers, tokens, work)),
    ]
    lines, failed = list(head), 0
    print("\n".join(head), flush=True)
    for name_, fn in checks:
        t0 = time.perf_counter()
        try:
            rows = fn()
            status = "PASS"
        except Exception as e:  # report every check, then fail
            rows, status = [f"{type(e).__name__}: {e}"], "FAIL"
            failed += 1
        out = [f"- {status} {name_} ({time.perf_counter() - t0:.1f} s)"]
        out += [f"  - {r}" for r in rows]
        lines += out
        print("\n".join(out), flush=True)
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
