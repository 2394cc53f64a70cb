"""Every reader of untrusted bytes, fuzzed: layer objects, manifests, the transport's
payloads and the LMCache adapters' records. Each input decodes, or raises the reader's
own error class, and allocates no more than a bound proportional to the input (checked
with tracemalloc), as safetensors' fuzzer checks its header reader."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hurray_store import transport as tp
from hurray_store.errors import FormatError, ProtocolError
from hurray_store.format import Manifest, decode_layer, encode_layer
from hurray_store.format.records import parse_chunk_record, parse_l2_record
from hurray_store.keys import decode_member_list
from tests.helpers import make_layer
from tests.test_manifest import _rechecksum, sample

GOOD_LAYER = encode_layer(make_layer([[0, 1], [0, 2]], 3))
GOOD_MANIFEST = sample().to_bytes()
FUZZ = settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)


def mutations(good: bytes) -> st.SearchStrategy[bytes]:
    """``good`` with a few bytes overwritten (lengths and counts included), cut short, or
    grown; and plain random bytes."""

    def mutate(edits: list[tuple[int, int]], cut: int, tail: bytes) -> bytes:
        b = bytearray(good)
        for pos, val in edits:
            b[pos % len(b)] = val
        return bytes(b[: max(0, len(b) - cut)]) + tail

    edited = st.builds(
        mutate,
        st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=8),
        st.integers(0, 16),
        st.binary(max_size=16),
    )
    return st.one_of(edited, st.binary(max_size=512))


def bounded(fn: Callable[[bytes], object], data: bytes, error: type[Exception]) -> None:
    """``fn(data)`` returns or raises ``error``, allocating at most 64x the input plus
    1 MiB along the way."""
    tracemalloc.start()
    try:
        fn(data)
    except error:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak <= 64 * len(data) + (1 << 20), f"{peak} bytes allocated for {len(data)} in"


@FUZZ
@given(mutations(GOOD_LAYER))
def test_layer_objects(data: bytes) -> None:
    bounded(decode_layer, data, FormatError)


@FUZZ
@given(mutations(GOOD_MANIFEST))
def test_manifests_with_a_good_checksum(data: bytes) -> None:
    # Rechecksummed: the fuzzer reaches past the checksum into every field's checks.
    fixed = _rechecksum(data) if len(data) >= 24 else data
    bounded(Manifest.from_bytes, fixed, FormatError)


_DECODERS: list[Callable[[bytes], object]] = [
    lambda b: tp.Hello.decode(memoryview(b)),
    lambda b: tp.decode_request(memoryview(b)),
    lambda b: tp.decode_descriptor(memoryview(b), 1 << 20),
    lambda b: tp.decode_put(memoryview(b)),
    lambda b: tp.decode_error(memoryview(b)),
    lambda b: tp.decode_keys(memoryview(b)),
    lambda b: tp.decode_sizes(memoryview(b)),
    lambda b: tp.decode_ranges(memoryview(b)),
    lambda b: tp.decode_lookup(memoryview(b), 16),
    lambda b: tp.decode_lookup_reply(memoryview(b)),
    lambda b: tp.decode_commit(memoryview(b), 1 << 20),
]
_GOOD_PAYLOADS = [
    tp.Hello(ext={"token": "t"}).encode(),
    tp.encode_request("some/key"),
    tp.encode_descriptor(4096),
    tp.encode_put("k", 64),
    tp.encode_error(3, "no such object"),
    tp.encode_keys(["a", "bb", "ccc"]),
    tp.encode_sizes([1, None, 3]),
    tp.encode_ranges("k", [(0, 4), (8, 8)]),
    tp.encode_lookup([(0, [b"h" * 16, b"i" * 16])], claim=True, wait_ms=5),
    tp.encode_lookup_reply([2], [b"manifest"]),
    b"".join(bytes(p) for p in tp.encode_commit("k", b"manifest bytes")),
]


@FUZZ
@given(st.integers(0, len(_DECODERS) - 1), st.data())
def test_transport_payloads(which: int, data: st.DataObject) -> None:
    payload = data.draw(mutations(_GOOD_PAYLOADS[which] or b"\x00"))
    bounded(_DECODERS[which], payload, ProtocolError)


@FUZZ
@given(st.binary(max_size=2048))
def test_adapter_records_and_group_records(data: bytes) -> None:
    bounded(lambda b: parse_l2_record(b), data, FormatError)
    bounded(lambda b: parse_chunk_record(b, b"f" * 32, 8, 256, lambda n: n * 64), data, FormatError)
    got = decode_member_list(data)  # None for anything that is not a member list
    assert got is None or all(isinstance(k, str) and n >= 0 for k, n in got)
