"""The bad-input corpus of the layer codec and the manifest: one test per case.

Every case raises the named FormatError subclass, and nothing else.
"""

from __future__ import annotations

import collections
import struct

import hurray
import numpy as np
import pytest
import torch

from hurray_store import FormatError, errors
from hurray_store.format import decode_layer, encode_layer
from tests.helpers import (
    add_shard,
    descriptor_len,
    hurray_stream,
    hurray_tensor,
    make_layer,
    patch,
    rewrite_key_descriptor,
    set_rank,
)


@pytest.fixture(scope="module")
def obj() -> bytes:
    return encode_layer(make_layer([[0, 1, 2], [0, 3]], 5, layer_index=3))


def key_end(obj: bytes) -> int:
    """Offset where the value descriptor starts."""
    d = hurray.Descriptor.decode(obj[: descriptor_len(obj)])
    return descriptor_len(obj) + sum(h.byte_size for h in d.buffer_handles)


def decode_raises(data: bytes, exc: type[FormatError], *, permissive: bool = False) -> FormatError:
    with pytest.raises(exc) as info:
        decode_layer(data, permissive=permissive)
    return info.value


def test_every_truncation_raises_format_error(obj: bytes) -> None:
    for n in range(len(obj)):
        with pytest.raises(FormatError):
            decode_layer(obj[:n])


def test_empty_input_is_truncated() -> None:
    decode_raises(b"", errors.TruncatedError)


def test_cut_exactly_after_the_key_descriptor(obj: bytes) -> None:
    err = decode_raises(obj[: descriptor_len(obj)], errors.TruncatedError)
    assert "remain" in str(err)


def test_cut_exactly_after_the_key_tensor_is_one_tensor(obj: bytes) -> None:
    err = decode_raises(obj[: key_end(obj)], errors.TensorCountError)
    assert "two tensors" in str(err)


def test_cut_inside_the_value_descriptor(obj: bytes) -> None:
    decode_raises(obj[: key_end(obj) + 30], errors.TruncatedError)


def test_trailing_bytes_after_the_value(obj: bytes) -> None:
    decode_raises(obj + b"\x00", errors.TensorCountError)


def test_a_third_tensor(obj: bytes) -> None:
    decode_raises(obj + obj[: key_end(obj)], errors.TensorCountError)


def test_garbage_bytes() -> None:
    decode_raises(bytes(range(256)) * 4, errors.DescriptorError)


def test_bad_magic(obj: bytes) -> None:
    decode_raises(b"HRRX" + obj[4:], errors.DescriptorError)


def test_newer_major_version(obj: bytes) -> None:
    decode_raises(patch(obj, 4, "<B", 2), errors.VersionError)


def test_descriptor_length_below_minimum(obj: bytes) -> None:
    decode_raises(patch(obj, 6, "<I", 8), errors.DescriptorError)


def test_single_bit_flips_in_header_and_index_buffers(obj: bytes) -> None:
    """Every bit of the key descriptor, and of both index buffers of the key and value
    tensors: each flip decodes to a valid layer or raises a FormatError, nothing else."""
    d = hurray.Descriptor.decode(obj[: descriptor_len(obj)])
    sizes = [h.byte_size for h in d.buffer_handles]
    k_bt = descriptor_len(obj) + sizes[0]
    v_start = key_end(obj)
    v_bt = v_start + descriptor_len(obj, v_start) + sizes[0]
    regions = [
        (0, descriptor_len(obj)),
        (k_bt, sizes[1] + sizes[2]),
        (v_start, descriptor_len(obj, v_start)),
        (v_bt, sizes[1] + sizes[2]),
    ]
    outcomes: dict[str, int] = {}
    for start, length in regions:
        for byte in range(start, start + length):
            for bit in range(8):
                b = bytearray(obj)
                b[byte] ^= 1 << bit
                try:
                    out = decode_layer(bytes(b))
                except FormatError as e:
                    outcomes[type(e).__name__] = outcomes.get(type(e).__name__, 0) + 1
                else:
                    outcomes["decoded"] = outcomes.get("decoded", 0) + 1
                    assert int(out.block_table.max()) < out.num_pages
    # The corpus really exercises several checks, not one.
    assert {"PagingMismatchError", "BufferSizeError", "DescriptorError"} <= set(outcomes)


def test_page_id_equal_to_num_pages() -> None:
    bad = hurray_stream(
        hurray_tensor(role="key", block_table=[0, 5, 0]),
        hurray_tensor(role="value", block_table=[0, 5, 0]),
    )
    err = decode_raises(bad, errors.PageIdError)
    assert "block_table[1] = 5" in str(err) and "num_pages = 5" in str(err)


def test_page_id_out_of_range_accepted_when_permissive_but_never_read() -> None:
    bad = hurray_stream(
        hurray_tensor(role="key", block_table=[0, 5, 0]),
        hurray_tensor(role="value", block_table=[0, 5, 0]),
    )
    out = decode_layer(bad, permissive=True)
    assert out.block_table.tolist() == [0, 5, 0]
    with pytest.raises(IndexError):
        out.keys.index_select(0, out.block_table)


def test_seq_ptr_decreasing() -> None:
    t = dict(block_table=[0, 1, 0], seq_ptr=[0, 2, 1, 3])
    err = decode_raises(
        hurray_stream(hurray_tensor(role="key", **t), hurray_tensor(role="value", **t)),
        errors.SeqPtrError,
    )
    assert "non-decreasing" in str(err)


def test_seq_ptr_first_not_zero() -> None:
    t = dict(block_table=[0, 1, 0], seq_ptr=[1, 2, 3])
    decode_raises(
        hurray_stream(hurray_tensor(role="key", **t), hurray_tensor(role="value", **t)),
        errors.SeqPtrError,
    )


def test_seq_ptr_last_wrong() -> None:
    t = dict(block_table=[0, 1, 0], seq_ptr=[0, 2, 2])
    err = decode_raises(
        hurray_stream(hurray_tensor(role="key", **t), hurray_tensor(role="value", **t)),
        errors.SeqPtrError,
    )
    assert "len(block_table) = 3" in str(err)


def test_rank_2(obj: bytes) -> None:
    decode_raises(
        rewrite_key_descriptor(obj, set_rank(obj[: descriptor_len(obj)], 2)), errors.RankError
    )


def test_rank_4(obj: bytes) -> None:
    decode_raises(
        rewrite_key_descriptor(obj, set_rank(obj[: descriptor_len(obj)], 4)), errors.RankError
    )


def test_roles_swapped() -> None:
    bad = hurray_stream(hurray_tensor(role="value"), hurray_tensor(role="key"))
    err = decode_raises(bad, errors.RoleError)
    assert "first tensor must have kv_role key" in str(err)


def test_role_repeated() -> None:
    decode_raises(
        hurray_stream(hurray_tensor(role="key"), hurray_tensor(role="key")), errors.RoleError
    )


def test_fused_role_rejected() -> None:
    decode_raises(
        hurray_stream(hurray_tensor(role="key"), hurray_tensor(role="fused")), errors.RoleError
    )


def test_mismatched_layers() -> None:
    bad = hurray_stream(hurray_tensor(role="key", layer=1), hurray_tensor(role="value", layer=2))
    err = decode_raises(bad, errors.LayerMismatchError)
    assert "key layer 1, value layer 2" in str(err)


def test_mismatched_block_tables() -> None:
    bad = hurray_stream(
        hurray_tensor(role="key", block_table=[0, 1, 0]),
        hurray_tensor(role="value", block_table=[0, 1, 1]),
    )
    decode_raises(bad, errors.PagingMismatchError)


def test_mismatched_page_size() -> None:
    bad = hurray_stream(
        hurray_tensor(role="key"), hurray_tensor(role="value", page_size=2, num_pages=10)
    )
    decode_raises(bad, errors.PagingMismatchError)


def test_mismatched_dtypes() -> None:
    bad = hurray_stream(
        hurray_tensor(role="key"), hurray_tensor(role="value", dtype=hurray.bfloat16)
    )
    decode_raises(bad, errors.PagingMismatchError)


def test_a_shard(obj: bytes) -> None:
    err = decode_raises(
        rewrite_key_descriptor(obj, add_shard(obj[: descriptor_len(obj)])), errors.ShardError
    )
    assert "shard" in str(err)


def test_paged_axis_not_zero(obj: bytes) -> None:
    decode_raises(patch(obj, 64, "<I", 1), errors.PagedAxisError)


def test_not_block_paged() -> None:
    row_major = hurray.Tensor(bytes(64), hurray.float16, [4, 2, 4])
    decode_raises(hurray_stream(row_major, row_major), errors.LayoutError)


def test_unsupported_dtype() -> None:
    bad = hurray_stream(
        hurray_tensor(role="key", dtype=hurray.int32, elem=4),
        hurray_tensor(role="value", dtype=hurray.int32, elem=4),
    )
    decode_raises(bad, errors.DtypeError)


def _quantized(role: str, q) -> hurray.Tensor:
    return hurray_tensor(
        role=role, dtype=hurray.int8, elem=1, quantization=q, scales=bytes(5 * 4 * 2)
    )


def test_quantization_block_size_not_page_size() -> None:
    # pyhurray refuses to build it, so patch a valid one: block_size sits 8 bytes into the
    # quantization section, which starts after the 4 buffer handles and its u32 length.
    q = hurray.PerBlockAffine.symmetric(0, 4, 3, hurray.float16)
    good = hurray_stream(_quantized("key", q), _quantized("value", q))
    assert decode_layer(good).keys.dtype == torch.float16
    section = 85 + 4 * 16 + 4
    assert struct.unpack_from("<I", good, section + 8)[0] == 4
    err = decode_raises(patch(good, section + 8, "<I", 8), errors.QuantizationError)
    assert "block_size" in str(err)


def test_quantization_per_channel_on_the_paged_axis() -> None:
    q = hurray.PerChannelAffine.symmetric(axis=1, scale_buffer_index=3)

    def t(role: str) -> hurray.Tensor:
        return hurray_tensor(
            role=role, dtype=hurray.int8, elem=1, quantization=q, scales=bytes(2 * 2)
        )

    good = hurray_stream(t("key"), t("value"))
    decode_raises(good, errors.UnsupportedQuantizationError)  # legal, but not ours to dequantize
    section = 85 + 4 * 16 + 4
    assert struct.unpack_from("<I", good, section + 4)[0] == 1  # the axis
    decode_raises(patch(good, section + 4, "<I", 0), errors.QuantizationError)


def test_quantization_scales_wrong_size() -> None:
    q = hurray.PerBlockAffine.symmetric(0, 4, 3, hurray.float16)

    def t(role: str) -> hurray.Tensor:
        return hurray_tensor(role=role, dtype=hurray.int8, elem=1, quantization=q, scales=bytes(6))

    decode_raises(hurray_stream(t("key"), t("value")), errors.BufferSizeError)


def test_quantization_per_tensor_is_unsupported_not_wrong() -> None:
    q = hurray.PerTensorAffine(0.5, 0)
    t = lambda role: hurray_tensor(role=role, dtype=hurray.int8, elem=1, quantization=q)  # noqa: E731
    decode_raises(hurray_stream(t("key"), t("value")), errors.UnsupportedQuantizationError)


def test_pool_size_inconsistent_with_fields() -> None:
    t = lambda role: hurray_tensor(role=role, pool=bytes(5 * 4 * 2 * 8 * 2 + 2))  # noqa: E731
    decode_raises(hurray_stream(t("key"), t("value")), errors.BufferSizeError)


def test_shape_inconsistent_with_block_table() -> None:
    t = lambda role: hurray_tensor(role=role, total_tokens=16)  # noqa: E731
    decode_raises(hurray_stream(t("key"), t("value")), errors.BufferSizeError)


def test_declared_buffer_far_larger_than_input(obj: bytes) -> None:
    # The pool's byte_size set to 2**60: inconsistent with the fields, and never allocated.
    decode_raises(patch(obj, 85, "<Q", 2**60), errors.BufferSizeError)


def test_declared_pool_far_larger_than_input_with_consistent_fields(obj: bytes) -> None:
    # num_pages and the pool size agree with each other (2**40 pages), the bytes are absent.
    huge = 2**40
    b = patch(obj, 56, "<Q", huge)
    b = patch(b, 85, "<Q", huge * 4 * 2 * 8 * 2)
    err = decode_raises(b, errors.TruncatedError)
    assert "remain" in str(err)


def test_huge_block_table_index_type_u64_values() -> None:
    t = dict(index_type="uint64", block_table=[0, 2**63 + 1, 0])
    decode_raises(
        hurray_stream(hurray_tensor(role="key", **t), hurray_tensor(role="value", **t)),
        errors.PageIdError,
    )


def test_nothing_but_format_errors_from_random_inputs() -> None:
    """300 mutated objects: each decodes, or raises one of the format's own errors; and
    the mutations reach several distinct checks (counted as safetensors' fuzzer does)."""
    rng = np.random.default_rng(0)
    good = encode_layer(make_layer([[0, 1]], 2))
    seen: collections.Counter[str] = collections.Counter()
    for _ in range(300):
        b = bytearray(good)
        for pos in rng.integers(0, len(b), size=int(rng.integers(1, 6))):
            b[pos] = int(rng.integers(0, 256))
        try:
            decode_layer(bytes(b))
            seen["decoded"] += 1
        except FormatError as e:
            seen[type(e).__name__] += 1
    assert sum(seen.values()) == 300
    assert len(set(seen) - {"decoded"}) >= 4, seen


def test_errors_are_value_errors(obj: bytes) -> None:
    with pytest.raises(ValueError):
        decode_layer(obj[:10])
    assert issubclass(errors.PageIdError, ValueError)


def test_permissive_still_checks_structure(obj: bytes) -> None:
    decode_raises(obj[:50], errors.TruncatedError, permissive=True)
    decode_raises(patch(obj, 85, "<Q", 2**60), errors.BufferSizeError, permissive=True)


def test_layer_index_not_layer_scoped() -> None:
    t = lambda role: hurray_tensor(role=role, layer=0xFFFFFFFF)  # noqa: E731
    decode_raises(hurray_stream(t("key"), t("value")), errors.LayerMismatchError)


def test_struct_sanity_of_offsets(obj: bytes) -> None:
    """The offsets the helpers patch are where the spec puts them."""
    assert struct.unpack_from("<Q", obj, 56)[0] == 5  # num_pages
    assert struct.unpack_from("<I", obj, 68)[0] == 2  # num_seqs
    assert decode_layer(obj).keys.dtype == torch.float16
