"""State objects (``format/records.py``, ``HSST``): a host pool's page that is not paged
KV (an SGLang Mamba state slot) as one Hurray stream of its bytes and a record. Each way
an object can differ from what its reader expects is refused by name."""

from __future__ import annotations

import hurray
import numpy as np
import pytest

from hurray_store.cli.format_cmds import inspect_bytes
from hurray_store.format.records import (
    check_state_object,
    describe_state_object,
    state_layout,
    state_object,
)

FP = bytes(range(32))
DATA = np.random.default_rng(3).integers(0, 256, 1000, dtype=np.uint8).tobytes()


def _obj(data: bytes = DATA, fp: bytes = FP) -> bytearray:
    return bytearray(b"".join(bytes(p) for p in state_object(memoryview(data), fp)))


def test_a_state_object_is_a_stream_pyhurray_reads_and_checks_itself() -> None:
    obj = _obj()
    d, at, size = state_layout(len(DATA))
    assert len(obj) == size and bytes(obj[d : d + len(DATA)]) == DATA
    tensors = list(hurray.StreamReader(bytes(obj)))
    assert [str(t.descriptor.dtype) for t in tensors] == ["uint8", "uint8"]
    assert check_state_object(memoryview(obj), FP, len(DATA)) == ""
    assert "state object" in inspect_bytes(bytes(obj)) and "check ok" in inspect_bytes(bytes(obj))


def _flip(at: int) -> bytearray:
    obj = _obj()
    obj[at] ^= 0x01
    return obj


@pytest.mark.parametrize(
    "case, obj, want",
    [
        ("short", _obj()[:-1], "state object of"),
        ("page_bytes_flipped", _flip(state_layout(len(DATA))[0] + 7), "page: checksum differs"),
        ("record_flipped", _flip(-20), "record: checksum differs"),
        ("descriptor_flipped", _flip(8), "descriptors"),
        ("another_page", _obj(fp=bytes(32)), "another page's object"),
        ("another_size", _obj(DATA[:-8]), "state object of"),
    ],
)
def test_each_way_a_state_object_is_wrong_is_named(case: str, obj: bytearray, want: str) -> None:
    why = check_state_object(memoryview(obj), FP, len(DATA))
    assert want in why, (case, why)


def test_inspect_says_what_a_bad_state_object_is() -> None:
    assert "checksum differs" in describe_state_object(_flip(state_layout(len(DATA))[0]))["check"]
