"""Round trips of the layer codec, and interoperability with pyhurray."""

from __future__ import annotations

import hurray
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hurray_store.format import (
    LayerKV,
    decode_layer,
    encode_layer,
    encode_layer_buffers,
    layout,
    quantize_int8,
)
from tests.helpers import H_DTYPES, hurray_stream, hurray_tensor, make_layer

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@st.composite
def layers(draw):
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    heads = draw(st.integers(1, 4))
    dim = draw(st.sampled_from([1, 8, 64]))
    dtype = draw(st.sampled_from(DTYPES))
    num_pages = draw(st.integers(0, 12))
    num_seqs = draw(st.integers(0, 5)) if num_pages else 0
    tables = [
        draw(st.lists(st.integers(0, num_pages - 1), max_size=8)) if num_pages else []
        for _ in range(num_seqs)
    ]
    layer_index = draw(st.integers(0, 200))
    seed = draw(st.integers(0, 2**16))
    return make_layer(
        tables,
        num_pages,
        page_size=page_size,
        heads=heads,
        dim=dim,
        dtype=dtype,
        layer_index=layer_index,
        seed=seed,
    )


def assert_same_paging(a: LayerKV, b: LayerKV) -> None:
    assert a.layer_index == b.layer_index
    assert torch.equal(a.block_table, b.block_table)
    assert torch.equal(a.seq_ptr, b.seq_ptr)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers())
def test_round_trip_is_bit_exact(layer: LayerKV) -> None:
    out = decode_layer(encode_layer(layer))
    assert_same_paging(layer, out)
    assert out.keys.dtype == layer.dtype
    assert torch.equal(out.keys.view(torch.uint8), layer.keys.view(torch.uint8))
    assert torch.equal(out.values.view(torch.uint8), layer.values.view(torch.uint8))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers().filter(lambda layer: layer.page_size >= 2))
def test_quantized_round_trip_within_bound(layer: LayerKV) -> None:
    out = decode_layer(encode_layer(layer, quantization="int8"))
    assert_same_paging(layer, out)
    assert out.keys.dtype == layer.dtype  # the scale type records the original dtype
    for orig, got in ((layer.keys, out.keys), (layer.values, out.values)):
        slots = orig.shape[0] * orig.shape[1]
        if not slots:
            assert got.numel() == 0
            continue
        x = orig.float().reshape(slots, -1)
        y = got.float().reshape(slots, -1)
        amax = x.abs().amax(dim=1, keepdim=True)
        # Documented bound: half a quantization step (absmax/127, rounded up by at most
        # 2 ulp when stored), plus the output dtype's rounding of the dequantized value.
        eps = torch.finfo(orig.dtype).eps
        bound = amax / 254.0 * (1 + 4 * eps) + x.abs() * eps + torch.finfo(orig.dtype).tiny * 64
        assert bool(((x - y).abs() <= bound).all())


@given(st.sampled_from(DTYPES), st.sampled_from([None, "int8"]))
@settings(max_examples=12, deadline=None)
def test_pyhurray_stream_reader_reads_our_bytes(dtype, quant) -> None:
    layer = make_layer([[0, 1, 2], [0, 3], []], 5, dtype=dtype, layer_index=7)
    obj = encode_layer(layer, quantization=quant)
    tensors = list(hurray.StreamReader(obj))
    assert [t.layout.kv_role for t in tensors] == ["key", "value"]
    for t, src in zip(tensors, (layer.keys, layer.values), strict=True):
        lay = t.layout
        assert (
            lay.tag,
            lay.page_size,
            lay.num_pages,
            lay.num_seqs,
            lay.paged_axis,
            lay.layer_index,
        ) == (
            0x0A,
            4,
            5,
            3,
            0,
            7,
        )
        assert lay.block_table_index_type == "uint32"
        assert t.shape == (5 * 4, 2, 8)
        bt = np.from_dlpack(t.buffer(1)).view(np.uint32)
        sp = np.from_dlpack(t.buffer(2)).view(np.uint32)
        assert bt.tolist() == [0, 1, 2, 0, 3] and sp.tolist() == [0, 3, 5, 5]
        pool = torch.from_dlpack(t.buffer(0))
        if quant is None:
            assert t.dtype == H_DTYPES[dtype]
            assert torch.equal(pool, src.reshape(-1).view(torch.uint8))
        else:
            assert t.dtype == hurray.int8 and t.quantization.scale_type == H_DTYPES[dtype]
            q, sc = quantize_int8(src)
            assert torch.equal(pool.view(torch.int8), q.reshape(-1))
            assert torch.equal(torch.from_dlpack(t.buffer(3)), sc.reshape(-1).view(torch.uint8))


def test_we_read_streams_built_with_pyhurray() -> None:
    pool_k = torch.randn(5, 4, 2, 8).half()
    pool_v = torch.randn(5, 4, 2, 8).half()
    obj = hurray_stream(
        hurray_tensor(role="key", layer=3, pool=pool_k.numpy().tobytes()),
        hurray_tensor(role="value", layer=3, pool=pool_v.numpy().tobytes()),
    )
    out = decode_layer(obj)
    assert out.layer_index == 3
    assert out.block_table.tolist() == [0, 1, 0] and out.seq_ptr.tolist() == [0, 2, 3]
    assert torch.equal(out.keys, pool_k) and torch.equal(out.values, pool_v)


def test_pyhurray_built_uint64_index_stream_is_read() -> None:
    obj = hurray_stream(
        hurray_tensor(role="key", index_type="uint64"),
        hurray_tensor(role="value", index_type="uint64"),
    )
    out = decode_layer(obj)
    assert out.block_table.tolist() == [0, 1, 0]


def test_our_descriptors_equal_pyhurray_built_ones() -> None:
    """The template fast path writes the same bytes pyhurray writes for the same tensor."""
    layer = make_layer([[0, 1, 2, 2], [4]], 6, page_size=4, heads=2, dim=8, layer_index=9)
    obj = encode_layer(layer)
    ref = hurray_stream(
        hurray_tensor(
            role="key",
            layer=9,
            num_pages=6,
            block_table=[0, 1, 2, 2, 4],
            seq_ptr=[0, 4, 5],
            pool=layer.keys.numpy().tobytes(),
        ),
        hurray_tensor(
            role="value",
            layer=9,
            num_pages=6,
            block_table=[0, 1, 2, 2, 4],
            seq_ptr=[0, 4, 5],
            pool=layer.values.numpy().tobytes(),
        ),
    )
    assert obj == ref


def test_empty_batch_round_trips() -> None:
    layer = make_layer([], 0)
    out = decode_layer(encode_layer(layer))
    assert out.num_seqs == 0 and out.num_pages == 0 and out.block_table.numel() == 0
    assert len(list(hurray.StreamReader(encode_layer(layer)))) == 2


def test_aliasing_is_preserved_and_not_rejected() -> None:
    layer = make_layer([[2, 2, 2], [2]], 3)
    out = decode_layer(encode_layer(layer))
    assert out.block_table.tolist() == [2, 2, 2, 2]


def test_decoded_pools_are_zero_copy_views() -> None:
    layer = make_layer([[0, 1]], 2)
    obj = bytearray(encode_layer(layer))
    out = decode_layer(obj)
    base = np.frombuffer(obj, dtype=np.uint8).ctypes.data
    assert base <= out.keys.data_ptr() < base + len(obj)
    assert base <= out.values.data_ptr() < base + len(obj)


def test_dtype_argument_converts() -> None:
    layer = make_layer([[0, 1]], 2, dtype=torch.float32)
    out = decode_layer(encode_layer(layer), dtype=torch.float16)
    assert out.keys.dtype == torch.float16
    assert torch.equal(out.keys, layer.keys.half())


def test_buffers_join_to_the_object_and_offsets_locate_pages() -> None:
    layer = make_layer([[0, 1, 2], [1]], 3, dtype=torch.bfloat16)
    enc = encode_layer_buffers(layer)
    obj = b"".join(enc.buffers)
    assert obj == encode_layer(layer) and len(obj) == enc.nbytes
    for p in range(3):
        k = obj[enc.key_pool_offset + p * enc.page_bytes :][: enc.page_bytes]
        v = obj[enc.value_pool_offset + p * enc.page_bytes :][: enc.page_bytes]
        assert k == layer.keys[p].contiguous().view(torch.uint8).numpy().tobytes()
        assert v == layer.values[p].contiguous().view(torch.uint8).numpy().tobytes()


def test_large_pool_switches_to_uint64_index() -> None:
    assert layout.index_type_for(2**32 - 1, 10) == "uint32"
    assert layout.index_type_for(2**32, 10) == "uint64"
    assert layout.index_type_for(10, 2**32) == "uint64"


def test_encoder_rejects_invalid_layers() -> None:
    from hurray_store import errors

    with pytest.raises(errors.PageIdError):
        encode_layer(make_layer([[0, 5]], 5))
    with pytest.raises(ValueError, match="quantization"):
        encode_layer(make_layer([[0]], 1), quantization="fp4")
    with pytest.raises(errors.QuantizationError, match="power of two"):
        encode_layer(make_layer([[0]], 1, page_size=3), quantization="int8")
    with pytest.raises(ValueError, match="values must match keys"):
        LayerKV(
            0,
            torch.zeros(1, 4, 2, 8),
            torch.zeros(1, 4, 2, 4),
            torch.tensor([0]),
            torch.tensor([0, 1]),
        )
