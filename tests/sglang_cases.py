"""Run in the SGLang environment (``.venv-sglang``, with ``tests/sglang_env`` on
``PYTHONPATH``) by tests/test_sglang.py: SGLang's own host pool
(``MHATokenToKVPoolHost`` on CPU tensors, from ``MHABufferInfo``) and our backend made
by SGLang's ``StorageBackendFactory`` as its ``dynamic`` backend, then registered with
the pool as SGLang's cache controller does.

``python tests/sglang_cases.py '<json>'`` with ``{"op": "set" | "get" | ..., ...}``
prints one JSON line of what it saw (``RESULT {...}``).

A page's contents follow from its key alone (``page_data``), so a process that sets a
page and another that reads it agree without sharing anything but the store. The
expected positions in the pool come from SGLang's own per-layer views of it
(``k_data_refs``/``v_data_refs``), not from the backend's code.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from hurray_store.adapters.sglang import cpu_host_pool, cpu_mla_host_pool

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
LAYERS, HEADS, HEAD_DIM = 3, 2, 16  # HEADS: the model's KV heads
# The model's KV heads this process's rank holds, [start, end): set by ``run`` from the
# case's tp_rank and tp_size as SGLang splits them (more ranks than heads: replicated).
RANK_HEADS = (0, HEADS)
MLA = False  # the case runs an MLA pool (one latent of MLA_DIM per token and layer)
MLA_DIM = 40


def make_pool(layout: str, dtype: torch.dtype, page_size: int, pages: int) -> Any:
    if MLA:
        pool = cpu_mla_host_pool(layout, dtype, page_size, pages, layers=LAYERS, dim=MLA_DIM)
        pool.kv_buffer.fill_(-7)
        return pool
    heads = RANK_HEADS[1] - RANK_HEADS[0]
    pool = cpu_host_pool(
        layout, dtype, page_size, pages, layers=LAYERS, heads=heads, head_dim=HEAD_DIM
    )
    pool.kv_buffer.fill_(-7)  # a sentinel: what no page holds
    return pool


def page_data(key: str, dtype: torch.dtype, page_size: int) -> torch.Tensor:
    """Page ``key``'s K and V of this rank's heads, ``[2, layers, page_size, heads,
    head_dim]`` (a slice of the model's page: every rank of every TP size agrees)."""
    g = torch.Generator().manual_seed(xxhash.xxh64_intdigest(key.encode()) >> 1)
    if MLA:  # the latent, [1, layers, page_size, 1, dim]: every rank's
        return torch.randn((1, LAYERS, page_size, 1, MLA_DIM), generator=g).to(dtype)
    page = torch.randn((2, LAYERS, page_size, HEADS, HEAD_DIM), generator=g).to(dtype)
    return page[:, :, :, RANK_HEADS[0] : RANK_HEADS[1]].contiguous()


def layer_slot(pool: Any, role: int, layer: int, start: int) -> torch.Tensor:
    """``[page_size, heads, head_dim]`` of the page at host token ``start``, through
    SGLang's own views of its pool."""
    P = pool.page_size
    if MLA:  # SGLang's MLA host layouts (MLATokenToKVPoolHost.init_kv_buffer)
        kv = pool.kv_buffer
        if pool.layout == "layer_first":  # [layers, tokens, 1, dim]
            return kv[layer, start : start + P]
        if pool.layout == "page_first":  # [tokens, layers, 1, dim]
            return kv[start : start + P, layer]
        return kv[start // P, layer]  # page_first_direct: [pages, layers, P, 1, dim]
    if pool.layout == "page_head":  # (2, pages, heads, P, layers, D): no per-layer refs
        return pool.kv_buffer[role, start // P, :, :, layer].permute(1, 0, 2)
    refs = pool.k_data_refs if role == 0 else pool.v_data_refs
    if pool.layout == "page_first_direct":  # refs[layer]: [pages, P, heads, D]
        return refs[layer][start // P]
    return refs[layer][start : start + P]  # [tokens, heads, D]


def write_page(pool: Any, start: int, data: torch.Tensor) -> None:
    for r in range(data.shape[0]):
        for li in range(LAYERS):
            layer_slot(pool, r, li, start).copy_(data[r, li])


def read_page(pool: Any, start: int) -> torch.Tensor:
    roles = 1 if MLA else 2
    return torch.stack(
        [
            torch.stack([layer_slot(pool, r, li, start) for li in range(LAYERS)])
            for r in range(roles)
        ]
    )


def make_backend(spec: dict[str, Any], pool: Any) -> Any:
    extra = {
        "backend_name": "hurray",
        "module_path": "hurray_store.adapters.sglang",
        "class_name": "HurrayHiCacheStorage",
        "interface_v1": 1,
        "config": spec.get("config"),
        "model_path": spec["model"],
        **spec.get("extra", {}),
    }
    cfg = HiCacheStorageConfig(
        tp_rank=spec.get("tp_rank", 0),
        tp_size=spec.get("tp_size", 1),
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=spec.get("mla", False),
        enable_storage_metrics=False,
        is_page_first_layout=pool is not None and pool.layout == "page_first",
        model_name=spec.get("model_name", "test-model"),
        extra_config=extra,
    )
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    if pool is not None:
        backend.register_mem_pool_host(pool)
    # A subscriber connecting to the events' PUB socket (bound just now) gets what is
    # published only once it has joined: a loaded machine may take a while.
    time.sleep(spec.get("settle_s", 0.0))
    return backend


def indices(pool: Any, slots: list[int]) -> torch.Tensor:
    """The host indices of pages in these page slots (as SGLang hands them over)."""
    P = pool.page_size
    return torch.cat([torch.arange(s * P, (s + 1) * P, dtype=torch.int64) for s in slots])


def run(spec: dict[str, Any]) -> dict[str, Any]:
    global RANK_HEADS, MLA
    MLA = bool(spec.get("mla", False))
    tp, rank = spec.get("tp_size", 1), spec.get("tp_rank", 0)
    if spec["op"] != "batch":
        w = max(1, HEADS // tp)
        start = rank * w if tp <= HEADS else rank // (tp // HEADS)
        RANK_HEADS = (start, start + w)
    dtype = DTYPES[spec.get("dtype", "float32")]
    P = spec.get("page_size", 16)
    keys: list[str] = spec.get("keys", [])
    op = spec["op"]
    if op == "batch":  # several runs in one process (SGLang takes 6 s to import here)
        return {"runs": [run({**spec, **r, "op": r["op"]}) for r in spec["runs"]]}
    if op == "bad_args":  # SGLang's argument rules, then calls after close()
        pool = make_pool(spec.get("layout", "layer_first"), dtype, P, 6)
        b = make_backend(spec, pool)
        ok = indices(pool, [1, 2])
        shuffled = ok.clone()
        shuffled[[0, 1]] = shuffled[[1, 0]]  # a page's indices out of order
        cases = {
            "float_indices": b.batch_set_v1(["a", "b"], ok.to(torch.float32)),
            "more_indices": b.batch_set_v1(["a"], ok),
            "not_consecutive": b.batch_set_v1(["a", "b"], shuffled),
            "key_twice": b.batch_set_v1(["a", "a"], ok),
            "get_more_indices": b.batch_get_v1(["a"], ok),
            "good": b.batch_set_v1(["a", "b"], ok),
        }
        b.close()
        t0 = time.perf_counter()
        after = {
            "exists": b.batch_exists(["a", "b"]),
            "set": b.batch_set_v1(["c"], indices(pool, [3])),
            "get": b.batch_get_v1(["a"], indices(pool, [4])),
        }
        return {"cases": cases, "after": after, "after_s": time.perf_counter() - t0}
    if op == "evict_between":  # exists, other sets fill the tier, then the get
        return _evict_between(spec, dtype, P)
    if op == "down_remote":  # the remote tier's server hangs under the backend
        return _down_remote(spec, dtype, P)
    if op == "weights_change":  # the weights replaced in the folder, then clear()
        return _weights_change(spec, dtype, P)
    if op == "hybrid":  # SGLang's hybrid pools through the v2 calls
        return _hybrid(spec, dtype, P)
    if op == "construct":
        try:
            make_backend(spec, None)
        except ValueError as e:
            return {"error": str(e)}
        return {"error": ""}
    pool = make_pool(spec.get("layout", "layer_first"), dtype, P, max(len(keys), 1) + 2)
    b = make_backend(spec, pool)
    out: dict[str, Any] = {"disabled": b.disabled}
    slots = list(range(1, len(keys) + 1))[::-1]  # pages land in slots in no given order
    idx = indices(pool, slots)
    legacy = spec.get("legacy", False)
    if op == "set":
        for s, k in zip(slots, keys, strict=True):
            write_page(pool, s * P, page_data(k, dtype, P))
        if legacy:
            data = [pool.get_data_page(s * P, flat=True) for s in slots]
            out["set"] = b.batch_set(keys, data)
        else:
            out["set"] = b.batch_set_v1(keys, idx)
    elif op == "get":
        out["exists"] = b.batch_exists(keys)
        if legacy:
            dummies = [pool.get_dummy_flat_data_page() for _ in keys]
            got = b.batch_get(keys, dummies)
            out["get"] = [g is not None for g in got]
            for s, g in zip(slots, got, strict=True):
                if g is not None:
                    pool.set_from_flat_data_page(s * P, g)
        else:
            if spec.get("kill_pid"):
                import os
                import signal

                def kill() -> None:
                    time.sleep(spec.get("kill_after_s", 0.05))
                    os.kill(spec["kill_pid"], signal.SIGKILL)

                threading.Thread(target=kill).start()
            t0 = time.perf_counter()
            out["get"] = b.batch_get_v1(keys, idx)
            out["get_s"] = time.perf_counter() - t0
        # Per page: equal to its data, or untouched (every element still the sentinel).
        out["equal"] = [
            bool(torch.equal(read_page(pool, s * P), page_data(k, dtype, P)))
            for s, k in zip(slots, keys, strict=True)
        ]
        out["untouched"] = [bool((read_page(pool, s * P) == -7).all()) for s in slots]
        out["names"] = [b.name_of(k) for k in keys]
    out["counts"] = dict(b.counts)
    stats = b.get_stats()
    out["stats_pages"] = [*stats.prefetch_pgs, *stats.backup_pgs]
    b.close()
    return out


def _set(b: Any, pool: Any, keys: list[str], slots: list[int], dtype: Any, P: int) -> list[bool]:
    for s, k in zip(slots, keys, strict=True):
        write_page(pool, s * P, page_data(k, dtype, P))
    return list(b.batch_set_v1(keys, indices(pool, slots)))


def _evict_between(spec: dict[str, Any], dtype: Any, P: int) -> dict[str, Any]:
    """Four pages set and found by batch_exists; eight more set into a cpu tier with
    room for eight (the first four are the least recent); then the get of the four."""
    import tempfile

    pool = make_pool("layer_first", dtype, P, 10)
    with tempfile.TemporaryDirectory() as d:  # one page object's size, from a disk tier
        probe = make_backend({**spec, "config": {"tiers": [_disk(d)]}}, pool)
        _set(probe, pool, ["probe"], [1], dtype, P)
        probe.close()
        size = max(f.stat().st_size for f in Path(d).rglob("*") if f.is_file())
    cfg = {"tiers": [{"type": "cpu", "capacity_bytes": 8 * size + size // 2}]}
    b = make_backend({**spec, "config": cfg}, pool)
    first = [f"first{i}" for i in range(4)]
    out: dict[str, Any] = {"set": _set(b, pool, first, [1, 2, 3, 4], dtype, P)}
    out["exists"] = b.batch_exists(first)
    for r in range(2):
        more = [f"more{r}{i}" for i in range(4)]
        out[f"more{r}"] = _set(b, pool, more, [5, 6, 7, 8], dtype, P)
    pool.kv_buffer.fill_(-7)
    out["get"] = b.batch_get_v1(first, indices(pool, [1, 2, 3, 4]))
    out["equal"] = [
        bool(torch.equal(read_page(pool, s * P), page_data(k, dtype, P)))
        for s, k in zip([1, 2, 3, 4], first, strict=True)
    ]
    out["after"] = b.batch_exists(first)  # the get ended the leases: fair game again
    b.close()
    return out


def _weights_change(spec: dict[str, Any], dtype: Any, P: int) -> dict[str, Any]:
    """Six pages set; the model's weights file replaced in place (other values, as
    update_weights_from_disk after a checkpoint is rewritten); then clear() (as after a
    weight sync in memory). What exists and get find at each point."""
    from safetensors.torch import save_file

    pool = make_pool("layer_first", dtype, P, 10)
    b = make_backend(spec, pool)
    keys = [f"page{i}" for i in range(6)]
    slots = [1, 2, 3, 4, 5, 6]
    out: dict[str, Any] = {"set": _set(b, pool, keys, slots, dtype, P)}
    out["exists_before"] = b.batch_exists(keys)
    first = b.identity
    g = torch.Generator().manual_seed(99)
    save_file(
        {"w": torch.randn(16, 16, generator=g)}, str(Path(spec["model"]) / "model.safetensors")
    )
    time.sleep(1.2)  # past the backend's folder check interval (1 s)
    out["exists_after_replace"] = b.batch_exists(keys)
    out["get_after_replace"] = b.batch_get_v1(keys, indices(pool, slots))
    end = time.monotonic() + 30
    while "generation" in b.weights.value and time.monotonic() < end:
        time.sleep(0.05)  # the new weights hashed on the backend's thread
    out["new_identity"] = b.identity != first and "generation" not in b.weights.value
    b.batch_exists(keys)  # the backend takes the new identity on its next call
    out["rehashed"] = b.identity == b.weights.value
    out["set_new"] = _set(b, pool, keys, slots, dtype, P)
    out["exists_new"] = b.batch_exists(keys)
    b.clear()
    out["exists_after_clear"] = b.batch_exists(keys)
    out["identity_after_clear"] = b.identity
    b.close()
    return out


def _disk(d: str) -> dict[str, Any]:
    return {"type": "disk", "path": d, "capacity_bytes": 1 << 30}


def _down_remote(spec: dict[str, Any], dtype: Any, P: int) -> dict[str, Any]:
    """Pages set into a remote tier, then its server SIGSTOPped for ``hang_s``: every
    exists, get and set of the backend meanwhile, timed; then SIGCONT and the pages
    found again once the tier's probe sees the server."""
    import os
    import signal

    pool = make_pool("layer_first", dtype, P, 10)
    b = make_backend(spec, pool)
    keys = [f"page{i}" for i in range(4)]
    out: dict[str, Any] = {"set": _set(b, pool, keys, [1, 2, 3, 4], dtype, P)}
    out["exists_before"] = b.batch_exists(keys)
    os.kill(spec["server_pid"], signal.SIGSTOP)
    exists, gets, sets, longest = [], [], [], 0.0
    end = time.monotonic() + spec["hang_s"]
    try:
        while time.monotonic() < end:
            t0 = time.monotonic()  # SGLang's prefetch: exists, then get
            exists.append(b.batch_exists(keys))
            gets.append(any(b.batch_get_v1(keys, indices(pool, [5, 6, 7, 8]))))
            longest = max(longest, time.monotonic() - t0)
            k = f"new{len(sets)}"  # its backup thread: a set (lent memory: it waits)
            sets.append(any(_set(b, pool, [k], [9], dtype, P)))
            time.sleep(0.02)
    finally:
        os.kill(spec["server_pid"], signal.SIGCONT)
    out.update(exists=exists, gets=gets, sets=sets, longest_s=longest)
    end = time.monotonic() + 30
    while b.batch_exists(keys) < 4 and time.monotonic() < end:
        time.sleep(0.05)
    out["exists_after"] = b.batch_exists(keys)
    out["get_after"] = b.batch_get_v1(keys, indices(pool, [5, 6, 7, 8]))
    out["port"] = b.port.stats()["port"]
    out["not_stored"] = b.port.stats()["not_stored"]
    b.close()
    return out


MAMBA_LAYERS, TEMPORAL, CONV = 2, (4, 8, 16), ((3, 96),)


def state_data(key: str) -> list[torch.Tensor]:
    """Key ``key``'s Mamba state: its temporal and conv states per layer (from the key
    alone, as ``page_data``)."""
    g = torch.Generator().manual_seed(xxhash.xxh64_intdigest(b"state:" + key.encode()) >> 1)
    return [torch.randn((MAMBA_LAYERS, *shape), generator=g) for shape in (TEMPORAL, *CONV)]


def _hybrid(spec: dict[str, Any], dtype: Any, P: int) -> dict[str, Any]:
    """A hybrid model's pools as SGLang's hybrid cache controller hands them: the KV
    pool (the full-attention layers), a sliding window's KV pool (``swa``: the last
    ``window`` pages of a prefix) and a Mamba state pool (``mamba``: the state at the
    prefix's last page), each SGLang's own class on CPU tensors. ``sets``: per key
    list, which pools to store it in; then ``asks``: per key list, what
    ``batch_exists_v2`` finds and, where it finds pages, what ``batch_get_v2`` reads
    (each page's bytes compared with what its key's page holds)."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    from hurray_store.adapters.sglang import cpu_host_pool, cpu_mamba_host_pool

    n = 8
    pool = make_pool("layer_first", dtype, P, n + 2)
    swa = cpu_host_pool("layer_first", dtype, P, n + 2, layers=1, heads=2, head_dim=HEAD_DIM)
    mamba = cpu_mamba_host_pool(n + 2, layers=MAMBA_LAYERS, temporal=TEMPORAL, conv=CONV)
    b = make_backend(spec, pool)
    b.register_mem_host_pool_v2(swa, PoolName.SWA)
    b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    window = spec.get("window", 2)
    trailing = PoolHitPolicy.TRAILING_PAGES

    def swa_page(key: str) -> torch.Tensor:
        return page_data("swa:" + key, dtype, P)[:, :1].contiguous()  # its one layer

    def transfers(keys: list[str], slots: list[int], pools: list[str]) -> list[PoolTransfer]:
        out = []
        if "swa" in pools:
            w = keys[-window:]
            out.append(
                PoolTransfer(
                    PoolName.SWA, indices(swa, slots[-len(w) :]), keys=w, hit_policy=trailing
                )
            )
        if "mamba" in pools:
            out.append(
                PoolTransfer(
                    PoolName.MAMBA, torch.tensor([slots[-1]]), keys=keys[-1:], hit_policy=trailing
                )
            )
        return out

    out: dict[str, Any] = {"disabled": b.disabled, "sets": [], "asks": []}
    for keys, pools in spec.get("sets", []):
        slots = list(range(1, len(keys) + 1))
        for s, k in zip(slots, keys, strict=True):
            write_page(pool, s * P, page_data(k, dtype, P))
            swa_slot = swa.k_data_refs[0][s * P : (s + 1) * P]
            swa_slot.copy_(swa_page(k)[0, 0])
            swa.v_data_refs[0][s * P : (s + 1) * P].copy_(swa_page(k)[1, 0])
        for t, c in zip(
            state_data(keys[-1]), [mamba.temporal_buffer, *mamba.conv_buffer], strict=True
        ):
            c[slots[-1]].copy_(t.view(c[slots[-1]].shape))  # its slot: [layers, 1, ...]
        kv = b.batch_set_v1(keys, indices(pool, slots)) if "kv" in pools else []
        side = b.batch_set_v2(transfers(keys, slots, pools))
        out["sets"].append({"kv": kv, **{str(k): v for k, v in side.items()}})
    for keys in spec.get("asks", []):
        for t in (pool.kv_buffer, swa.kv_buffer, mamba.temporal_buffer, *mamba.conv_buffer):
            t.fill_(-7)
        asked = transfers(keys, list(range(1, len(keys) + 1)), ["swa", "mamba"])
        r = b.batch_exists_v2(keys, asked)
        got: dict[str, Any] = {
            "pages": r.kv_hit_pages,
            "hits": {str(k): v for k, v in r.extra_pool_hit_pages.items()},
        }
        m = r.kv_hit_pages
        if m:
            hit, slots = keys[:m], list(range(1, m + 1))
            got["kv"] = b.batch_get_v1(hit, indices(pool, slots))
            side = b.batch_get_v2(transfers(hit, slots, ["swa", "mamba"]))
            got.update({str(k): v for k, v in side.items()})
            got["kv_exact"] = all(
                torch.equal(read_page(pool, s * P), page_data(k, dtype, P))
                for s, k in zip(slots, hit, strict=True)
            )
            got["swa_exact"] = all(
                torch.equal(swa.k_data_refs[0][s * P : (s + 1) * P], swa_page(k)[0, 0])
                and torch.equal(swa.v_data_refs[0][s * P : (s + 1) * P], swa_page(k)[1, 0])
                for s, k in list(zip(slots, hit, strict=True))[-window:]
            )
            state = [mamba.temporal_buffer[slots[-1]], *(c[slots[-1]] for c in mamba.conv_buffer)]
            want = state_data(hit[-1])
            got["mamba_exact"] = all(
                torch.equal(a.reshape(-1), w.reshape(-1)) for a, w in zip(state, want, strict=True)
            )
        out["asks"].append(got)
    out["counts"] = dict(b.counts)
    out["state_names"] = {k: b.side["mamba"].name_of(k) for k in spec.get("name_states", [])}
    b.close()
    return out


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    print("RESULT " + json.dumps(run(json.loads(sys.argv[1]))))
