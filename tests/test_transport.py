"""The transport's payload codecs and the object descriptor: every field round-trips,
and every malformed payload is a ProtocolError (or FormatError) by name, raised before
anything is allocated for it."""

from __future__ import annotations

import struct

import hurray
import pytest

from hurray_store import transport as tp
from hurray_store.errors import FormatError, ProtocolError
from hurray_store.format import blob_descriptor, parse_blob_descriptor

Err = tp.Err


def test_blob_descriptor_roundtrips_through_pyhurray() -> None:
    for n in (0, 1, 4097, 1 << 33):
        raw = blob_descriptor(n)
        d = hurray.Descriptor.decode(raw)
        assert (
            str(d.dtype) == "uint8"
            and tuple(d.shape) == (n,)
            and d.buffer_handles[0].byte_size == n
        )
        assert parse_blob_descriptor(raw + b"transport fields") == (n, len(raw))


@pytest.mark.parametrize(
    "case",
    [
        "float32_tensor",
        "rank_2",
        "cuda_device",
        "byte_size_differs",
        "not_a_descriptor",
        "truncated",
        "dynamic_length",
    ],
)
def test_parse_blob_descriptor_rejects(case: str) -> None:
    raw = bytearray(blob_descriptor(64))
    if case == "float32_tensor":
        raw = bytearray(hurray.zeros((16,), dtype=hurray.float32).descriptor.encode())
    elif case == "rank_2":
        raw = bytearray(hurray.zeros((4, 16), dtype=hurray.uint8).descriptor.encode())
    elif case == "cuda_device":
        raw[49] = 0x01  # the buffer handle's device tag
    elif case == "byte_size_differs":
        struct.pack_into("<Q", raw, 37, 65)
    elif case == "not_a_descriptor":
        raw = bytearray(b"HRRY" + b"\xff" * 60)
    elif case == "truncated":
        raw = raw[:30]
    elif case == "dynamic_length":
        struct.pack_into("<Q", raw, 20, 2**64 - 1)  # shape[0]: a dynamic dimension
    with pytest.raises(FormatError):
        parse_blob_descriptor(raw)


def test_hello_roundtrip_with_and_without_extension_data() -> None:
    h = tp.Hello(max_message_size=1 << 20, ext={"extensions": tp.EXTENSION, "token": "t"})
    assert tp.Hello.decode(h.encode()) == h
    plain = tp.Hello()
    assert tp.Hello.decode(plain.encode()) == plain and tp.Hello.decode(plain.encode()).ext is None


def test_hello_skips_extension_layout_entries() -> None:
    raw = (
        struct.pack("<IIQ", 1, 4096, 0)
        + struct.pack("<H", 2)
        + bytes([0xF3])
        + struct.pack("<H", 3)
        + b"abc"
        + bytes([0x0A])
    )
    raw += struct.pack("<H", 1) + b"\x00" + struct.pack("<H", 0)
    assert tp.Hello.decode(raw).layouts == [0x0A]


def test_request_roundtrip() -> None:
    req = tp.decode_request(
        memoryview(tp.encode_request("k/é", device=0, min_alignment=4096, flags=1))
    )
    assert (req.key, req.layouts, req.device, req.min_alignment, req.flags) == (
        "k/é",
        [1],
        0,
        4096,
        1,
    )


def _request(key: bytes, align: int = 64, flags: int = 0) -> memoryview:
    """A TENSOR_REQUEST payload with no layout preference."""
    return memoryview(
        struct.pack("<I", len(key))
        + key
        + struct.pack("<H", 0)
        + struct.pack("<BII", 0, align, flags)
    )


def _put_of(desc: bytes, total: int) -> bytes:
    return tp.key_field("k") + struct.pack("<I", len(desc)) + desc + struct.pack("<Q", total)


@pytest.mark.parametrize(
    ("case", "payload"),
    [
        ("hello_truncated", lambda: tp.Hello.decode(tp.Hello().encode()[:10])),
        ("hello_trailing_bytes", lambda: tp.Hello.decode(tp.Hello(ext={}).encode() + b"x")),
        ("request_alignment_not_power_of_two", lambda: tp.decode_request(_request(b"k", align=48))),
        ("request_reserved_flags", lambda: tp.decode_request(_request(b"k", flags=8))),
        ("request_empty_key", lambda: tp.decode_request(_request(b""))),
        ("request_key_not_utf8", lambda: tp.decode_request(_request(b"\xff\xfe"))),
        ("request_key_too_long", lambda: tp.decode_request(_request(b"k" * 2000))),
        (
            "request_key_length_past_the_end",
            lambda: tp.decode_request(memoryview(struct.pack("<I", 1 << 30) + b"k")),
        ),
        (
            "put_descriptor_of_another_tensor",
            lambda: tp.decode_put(
                memoryview(
                    _put_of(hurray.zeros((16,), dtype=hurray.float32).descriptor.encode(), 64)
                )
            ),
        ),
        (
            "put_total_differs",
            lambda: tp.decode_put(memoryview(tp.encode_put("k", 10)[:-8] + struct.pack("<Q", 11))),
        ),
        (
            "descriptor_two_shards",
            lambda: tp.decode_descriptor(
                memoryview(blob_descriptor(8) + struct.pack("<QII", 8, 0, 2)), 1 << 20
            ),
        ),
        (
            "descriptor_over_the_limit",
            lambda: tp.decode_descriptor(memoryview(tp.encode_descriptor(1 << 21)), 1 << 20),
        ),
        ("keys_too_many", lambda: tp.decode_keys(memoryview(struct.pack("<I", 1 << 20)))),
        (
            "lookup_reserved_flags",
            lambda: tp.decode_lookup(memoryview(struct.pack("<III", 2, 0, 0)), 16),
        ),
        (
            "lookup_hashes_past_the_end",
            lambda: tp.decode_lookup(
                memoryview(struct.pack("<IIIII", 1, 0, 1, 0, 5) + b"x" * 16), 16
            ),
        ),
        (
            "lookup_too_many_sequences",
            lambda: tp.decode_lookup(
                memoryview(
                    struct.pack("<III", 0, 0, tp.MAX_LOOKUP_SEQS + 1)
                    + struct.pack("<II", 0, 0) * (tp.MAX_LOOKUP_SEQS + 1)
                ),
                16,
            ),
        ),
        (
            "lookup_too_many_hashes",
            lambda: tp.decode_lookup(
                memoryview(
                    struct.pack("<IIIII", 0, 0, 1, 0, tp.MAX_LOOKUP_HASHES + 1)
                    + b"h" * 16 * (tp.MAX_LOOKUP_HASHES + 1)
                ),
                16,
            ),
        ),
        (
            "lookup_count_past_the_end",
            lambda: tp.decode_lookup(memoryview(struct.pack("<III", 0, 0, 2**32 - 1)), 16),
        ),
        (
            "ranges_truncated",
            lambda: tp.decode_ranges(memoryview(tp.encode_ranges("k", [(0, 4)])[:-3])),
        ),
        (
            "commit_manifest_over_the_limit",
            lambda: tp.decode_commit(
                memoryview(b"".join(bytes(p) for p in tp.encode_commit("k", b"m" * 100))), 50
            ),
        ),
        (
            "error_message_past_the_end",
            lambda: tp.decode_error(memoryview(struct.pack("<II", 6, 100) + b"short")),
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_malformed_payloads_are_protocol_errors(case: str, payload) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ProtocolError) as e:
        payload()
    assert e.value.code in (Err.INVALID_MESSAGE, Err.SHARD_MISMATCH, Err.MESSAGE_TOO_LARGE)


def test_lookup_and_reply_roundtrip() -> None:
    seqs = [(0, [b"a" * 16, b"b" * 16]), (1, [b"c" * 16])]
    claim, wait_ms, got = tp.decode_lookup(
        memoryview(tp.encode_lookup(seqs, claim=True, wait_ms=250)), 16
    )
    assert claim and wait_ms == 250 and got == seqs
    assert tp.decode_lookup_reply(memoryview(tp.encode_lookup_reply([2, 1], [b"m1", b"m22"]))) == (
        [2, 1],
        [b"m1", b"m22"],
    )
    assert tp.decode_sizes(memoryview(tp.encode_sizes([3, None, 0]))) == [3, None, 0]
