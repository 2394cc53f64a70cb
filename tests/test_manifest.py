"""The segment manifest: round trips and its bad-input corpus."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hurray_store import FormatError, errors
from hurray_store.format import Manifest, ManifestLayer, ManifestSeq, checksum


def sample(num_pages: int = 3, quant: str | None = None) -> Manifest:
    seqs = (
        ManifestSeq(tuple(range(10)), 0, 10, (b"a" * 16, b"b" * 16), (0, 1, 2)),
        ManifestSeq(tuple(range(8)), 1, 8, (b"c" * 16,), (2,)),
    )
    pb, sb = 64, (8 if quant else 0)
    layers = tuple(
        ManifestLayer(
            i,
            f"ns/seg/{i}",
            1000,
            1234 + i,
            100,
            400,
            700 if quant else 0,
            800 if quant else 0,
            tuple(range(num_pages)),
            tuple(range(10, 10 + num_pages)),
        )
        for i in range(2)
    )
    return Manifest(b"F" * 32, b"S" * 16, quant, 4, num_pages, pb, sb, seqs, layers)


def test_round_trip() -> None:
    for q in (None, "int8"):
        m = sample(quant=q)
        assert Manifest.from_bytes(m.to_bytes()) == m


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=40), st.integers(1, 8))
def test_round_trip_random_sequences(tokens: list[int], page_size: int) -> None:
    full = len(tokens) // page_size
    total = -(-len(tokens) // page_size)
    seq = ManifestSeq(
        tuple(tokens),
        0,
        len(tokens),
        tuple(bytes([i]) * 16 for i in range(full)),
        tuple(range(total)),
    )
    lay = ManifestLayer(
        0, "k", total * 128 + 10, 1, 0, total * 64, 0, 0, tuple(range(total)), tuple(range(total))
    )
    m = Manifest(b"", b"x", None, page_size, total, 64, 0, (seq,), (lay,))
    assert Manifest.from_bytes(m.to_bytes()) == m


def test_page_range() -> None:
    m = sample(quant="int8")
    assert m.page_range(1, "key", 2) == [(100 + 2 * 64, 64), (700 + 2 * 8, 8)]
    assert m.page_range(0, "value", 0) == [(400, 64), (800, 8)]
    with pytest.raises(IndexError):
        m.page_range(0, "key", 3)


def _rechecksum(b: bytes) -> bytes:
    body_end = len(b) - 8
    return b[:body_end] + struct.pack("<Q", checksum(b[:body_end]))


def test_bad_checksum() -> None:
    b = bytearray(sample().to_bytes())
    b[40] ^= 0x01
    with pytest.raises(errors.ChecksumError, match="checksum"):
        Manifest.from_bytes(bytes(b))


def test_every_truncation() -> None:
    b = sample().to_bytes()
    for n in range(len(b)):
        with pytest.raises(FormatError):
            Manifest.from_bytes(b[:n])


def test_bad_magic() -> None:
    with pytest.raises(errors.ManifestError, match="magic"):
        Manifest.from_bytes(b"HSMX" + sample().to_bytes()[4:])


def test_newer_version() -> None:
    b = sample().to_bytes()
    with pytest.raises(errors.VersionError):
        Manifest.from_bytes(_rechecksum(b[:4] + struct.pack("<H", 2) + b[6:]))


def test_reserved_flags() -> None:
    b = sample().to_bytes()
    with pytest.raises(errors.ManifestError, match="flags"):
        Manifest.from_bytes(_rechecksum(b[:6] + struct.pack("<H", 1) + b[8:]))


def test_huge_count_does_not_allocate() -> None:
    """A sequence count of 2**32-1 with a valid checksum is refused before any loop."""
    m = sample()
    b = m.to_bytes()
    # Offset of num_seqs: header 16, fingerprint 2+32, segment id 2+16, quant/page fields 29.
    off = 16 + 34 + 18 + 29
    assert struct.unpack_from("<I", b, off)[0] == 2
    bad = bytearray(b)
    struct.pack_into("<I", bad, off, 2**32 - 1)
    with pytest.raises(errors.TruncatedError, match="items"):
        Manifest.from_bytes(_rechecksum(bytes(bad)))


def test_a_huge_count_of_empty_page_hashes_is_refused_before_any_loop() -> None:
    """``n_hashes = 2**32 - 1`` of length 0 needs no bytes: refused at once by its hash
    length (it once looped four billion times before validating)."""
    m = sample()
    b = m.to_bytes()
    # The first sequence: first_page, seq_len, n_tok (u64 each), its tokens (u32 each),
    # then n_hashes u32 and hash_len u8.
    seq0 = 16 + 34 + 18 + 29 + 4
    n_tok = struct.unpack_from("<Q", b, seq0 + 16)[0]
    off = seq0 + 24 + 4 * n_tok
    assert struct.unpack_from("<IB", b, off) == (2, 16)
    bad = bytearray(b)
    struct.pack_into("<IB", bad, off, 2**32 - 1, 0)
    with pytest.raises(errors.ManifestError, match="page hashes of 0 bytes"):
        Manifest.from_bytes(_rechecksum(bytes(bad)))


def test_inconsistent_but_checksummed_is_rejected() -> None:
    """Validation does not rest on the checksum: a well-summed lie is still refused."""
    m = sample()
    bad = Manifest(
        m.fingerprint, m.segment_id, None, 4, 2, 64, 0, m.sequences, m.layers
    )  # page id 2 >= 2
    with pytest.raises(errors.ManifestError):
        bad.to_bytes()
    b = m.to_bytes()
    off = 16 + 34 + 18 + 5  # num_pages u64
    forged = bytearray(b)
    struct.pack_into("<Q", forged, off, 2)
    with pytest.raises(FormatError):
        Manifest.from_bytes(_rechecksum(bytes(forged)))


def test_token_count_must_match_seq_len() -> None:
    m = sample()
    s = m.sequences[0]
    bad = Manifest(
        m.fingerprint,
        m.segment_id,
        None,
        4,
        3,
        64,
        0,
        (ManifestSeq(s.token_ids[:5], 0, 10, s.page_hashes, s.block_table),),
        m.layers,
    )
    with pytest.raises(errors.ManifestError, match="token ids"):
        bad.to_bytes()


def test_encoded_size_is_the_length_of_to_bytes() -> None:
    import dataclasses

    m = _sample_manifest_for_size()
    assert m.encoded_size() == len(m.to_bytes())
    bigger = dataclasses.replace(
        m, layers=tuple(dataclasses.replace(lay, key=lay.key + "ü") for lay in m.layers)
    )
    assert bigger.encoded_size() == len(bigger.to_bytes())


def _sample_manifest_for_size():  # type: ignore[no-untyped-def]
    from hurray_store.format import Manifest, ManifestLayer, ManifestSeq

    seqs = (
        ManifestSeq(tuple(range(10)), 0, 10, (b"a" * 16, b"b" * 16), (0, 1, 2)),
        ManifestSeq(tuple(range(8)), 1, 8, (b"c" * 16,), (1,)),
    )
    layers = tuple(
        ManifestLayer(i, f"ns/s/{{x}}/{i}", 10_000, 7, 100, 5000, 0, 0, (1, 2, 3), (4, 5, 6))
        for i in range(2)
    )
    return Manifest(b"f" * 32, b"s" * 16, None, 4, 3, 64, 0, seqs, layers)
