"""The one codec of chunk objects (``format/chunk.py``), which LMCache's chunks and
SGLang's pages are both written in: its parts decode with pyhurray, and each way a read
object can differ from its record is named in the check's answer."""

from __future__ import annotations

import hurray
import pytest
import torch

from hurray_store.adapters.lmcache.layout import ChunkLayout
from hurray_store.adapters.sglang.pages import PageCodec, page_fingerprint
from hurray_store.format import checksum
from hurray_store.format.chunk import ChunkFormat

L, H, D, P = 3, 2, 8, 4
FP = b"f" * 32


def obj_of(fmt: ChunkFormat, pages: int, tokens: int, seed: int = 0) -> tuple[bytes, list[int]]:
    """An object of ``pages`` pages holding ``tokens`` tokens; the sums of its pools."""
    g = torch.Generator().manual_seed(seed)
    nb = fmt.token_bytes(tokens)
    pools = []
    for _ in range(2 * fmt.num_layers):
        pool = bytearray(fmt.token_bytes(pages * fmt.page_size))
        pool[:nb] = torch.randint(0, 256, (nb,), generator=g, dtype=torch.uint8).numpy().tobytes()
        pools.append(bytes(pool))
    sums = [checksum(p[:nb]) for p in pools]
    raw = b"".join(bytes(p) for p in fmt.parts(pages, pools))
    return raw + fmt.record(FP, tokens, pages, sums), sums


def test_an_object_is_a_stream_pyhurray_reads_and_its_size_gives_its_pages() -> None:
    fmt = ChunkFormat(L, H, D, P, torch.float16, max_tokens=16)
    for pages in range(1, 5):
        raw, _ = obj_of(fmt, pages, pages * P)
        assert len(raw) == fmt.layout(pages)[1]
        assert fmt.pages_of(len(raw)) == pages and fmt.pages_of(len(raw) + 1) is None
        tensors = list(hurray.StreamReader(raw))
        assert len(tensors) == 2 * L + 1
        assert [t.layout.kv_role for t in tensors[:2]] == ["key", "value"]
        assert tensors[0].layout.num_pages == pages and tensors[0].layout.page_size == P


def test_the_check_passes_the_object_it_wrote() -> None:
    fmt = ChunkFormat(L, H, D, P, torch.float16, max_tokens=16)
    raw, sums = obj_of(fmt, 3, 10)  # a partial last page
    rec = raw[-fmt.record_bytes :]
    assert fmt.check(rec, FP, 10, 3, sums) == ""
    assert fmt.parse(rec, FP, 3)[0] == 10


@pytest.mark.parametrize(
    "case, want",
    [
        ("another_fingerprint", "another layout"),
        ("another_page_count", "another object"),
        ("a_pool_differs", "layer 1: its bytes differ"),
        ("a_corrupt_record", "checksum differs"),
        ("a_short_record", "shorter than its header"),
        ("fewer_tokens_than_read", "tokens, not"),
    ],
)
def test_each_way_an_object_differs_from_its_record_is_named(case: str, want: str) -> None:
    fmt = ChunkFormat(L, H, D, P, torch.float16, max_tokens=16)
    raw, sums = obj_of(fmt, 3, 12)
    rec = bytearray(raw[-fmt.record_bytes :])
    fp, pages, tokens = FP, 3, 12
    if case == "another_fingerprint":
        fp = b"g" * 32
    elif case == "another_page_count":
        pages = 2  # a reader that took it for an object of 2 pages
        tokens = 8
    elif case == "a_pool_differs":
        sums = list(sums)
        sums[3] ^= 1
    elif case == "a_corrupt_record":
        rec[10] ^= 1
    elif case == "a_short_record":
        rec = rec[:20]
    elif case == "fewer_tokens_than_read":
        raw, sums = obj_of(fmt, 3, 9)
        rec = bytearray(raw[-fmt.record_bytes :])
    why = fmt.check(bytes(rec), fp, tokens, pages, sums)
    assert want in why, why


def test_a_token_count_its_pages_cannot_hold_is_refused() -> None:
    fmt = ChunkFormat(L, H, D, P, torch.float16, max_tokens=16)
    raw, sums = obj_of(fmt, 3, 12)
    pools, size = fmt.layout(3)
    # a record that claims 4 tokens (one page's worth) for an object of three pages
    rec = fmt.record_of(FP, 4, size, pools, sums)
    assert "4 tokens in a chunk object of 3 pages" in fmt.check(rec, FP, 12, 3, sums)


def test_lmcache_chunks_and_sglang_pages_are_the_same_format() -> None:
    """A page object of SGLang is a one-page chunk object: the chunk codec checks it."""
    codec = PageCodec(L, H, D, P, torch.float16)
    chunk = ChunkLayout(L, H, D, P, torch.float16, False, P)
    assert codec.size == chunk.layout(1)[1] and codec.pools == chunk.layout(1)[0]
    pools = [memoryview(bytearray([i]) * codec.pool_bytes) for i in range(2 * L)]
    fp = page_fingerprint("prefix", "k")
    raw = b"".join(bytes(b) for b in codec.encode(pools, fp))
    sums = [checksum(p) for p in pools]
    assert chunk.check(raw[-chunk.record_bytes :], fp, P, 1, sums) == ""


def fused_obj(codec: PageCodec, seed: int = 0) -> tuple[bytes, torch.Tensor]:
    """An MLA page object (one fused latent per layer) and its page."""
    g = torch.Generator().manual_seed(seed)
    page = torch.randn(codec.shape, generator=g).to(codec.dtype)
    staging = page.unsqueeze(0).contiguous()
    pools = codec.pool_views(codec.staging_bytes(staging), 0)
    raw = b"".join(bytes(p) for p in codec.encode(pools, page_fingerprint("mla", "k")))
    return raw, page


def test_an_mla_page_is_one_fused_descriptor_per_layer_and_checks_itself() -> None:
    from hurray_store.adapters.sglang.page_io import copy_page
    from hurray_store.format.decode import parse_chunk

    codec = PageCodec(L, 1, 40, P, torch.float32, fused=True)
    assert codec.shape == (1, L, P, 1, 40)
    raw, page = fused_obj(codec)
    assert len(raw) == codec.size
    tensors = list(hurray.StreamReader(raw))
    assert [t.layout.kv_role for t in tensors[:L]] == ["fused"] * L and len(tensors) == L + 1
    layers, _ = parse_chunk(raw)
    assert len(layers) == L and all(k is v for k, v in layers)
    mv = memoryview(raw)
    rec = mv[codec.size - codec.record_bytes :]
    assert codec.check(rec, page_fingerprint("mla", "k"), codec.pool_sums(mv)) == ""
    out = torch.full(codec.shape, -7.0)
    copy_page(codec, torch.frombuffer(bytearray(raw), dtype=torch.uint8), out)
    assert torch.equal(out, page)
    bad = bytearray(raw)
    bad[codec.pools[1][0] + 5] ^= 0x10  # a byte of layer 1's latent
    mb = memoryview(bytes(bad))
    why = codec.check(
        mb[codec.size - codec.record_bytes :], page_fingerprint("mla", "k"), codec.pool_sums(mb)
    )
    assert "layer 1" in why
    assert codec.check(rec, page_fingerprint("mla", "other"), codec.pool_sums(mv)) != ""


def test_a_chunk_object_that_mixes_fused_and_key_value_layers_is_refused() -> None:
    """Layer 0 of an MLA page (fused), then layer 1 (a key and a value) and the record
    of a key/value object: no reader takes it."""
    from hurray_store.errors import RoleError
    from hurray_store.format.decode import parse_chunk

    fused, _ = fused_obj(PageCodec(2, 1, 8, P, torch.float32, fused=True))
    kv, _ = obj_of(ChunkFormat(2, 1, 8, P, torch.float32, max_tokens=P), 1, P)
    f_layers, _ = parse_chunk(fused)
    k_layers, _ = parse_chunk(kv)
    with pytest.raises(RoleError, match="mixes"):
        parse_chunk(fused[: f_layers[0][0].end] + kv[k_layers[1][0].offset :])
    with pytest.raises(RoleError, match="mixes"):
        parse_chunk(kv[: k_layers[0][1].end] + fused[f_layers[1][0].offset :])
