"""KVSpec, its fingerprint, and prefix hashing."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from hurray_store import KVSpec, SpecError
from hurray_store.errors import ConfigError
from hurray_store.keys import check_salt, page_hashes, request_salt, root_hash

SPEC = KVSpec("tiny-llama", 4, 2, 64, 4, torch.float16)


def test_fingerprint_golden_vector() -> None:
    assert (
        SPEC.fingerprint().hex()
        == "5b225c873627acf4cb0c736f00ab7a6a50286e0ceaa6abd18e4aa40263b44af3"
    )


def test_fingerprint_is_sha256_of_the_documented_encoding() -> None:
    def text(s: str) -> bytes:
        return struct.pack("<I", len(s.encode())) + s.encode()

    enc = (
        text("hurray_store/kvspec/v2")
        + text("tiny-llama")
        + text("")
        + struct.pack("<QQQQ", 4, 2, 64, 4)
        + text("float16")
        + struct.pack("<QQQ", 0, 2, 2)  # head_start, total_kv_heads, roles
    )
    assert SPEC.canonical() == enc
    assert SPEC.fingerprint() == hashlib.sha256(enc).digest()
    # A KV cache group of a hybrid model: its name appended, nothing else changed.
    grouped = replace(SPEC, group="sliding_window 64: layers 0 1 2")
    assert grouped.canonical() == enc + text("sliding_window 64: layers 0 1 2")


@pytest.mark.parametrize(
    "change",
    [
        dict(model="other"),
        dict(num_layers=5),
        dict(num_kv_heads=4),
        dict(head_dim=128),
        dict(page_size=16),
        dict(dtype=torch.bfloat16),
        dict(revision="r2"),
        dict(head_start=2, total_kv_heads=4),
        dict(total_kv_heads=4),
        dict(num_kv_heads=1, total_kv_heads=1, fused=True),
        dict(group="full: layers 3"),
    ],
)
def test_every_field_changes_the_fingerprint(change) -> None:
    fields = dict(
        model="tiny-llama",
        num_layers=4,
        num_kv_heads=2,
        head_dim=64,
        page_size=4,
        dtype=torch.float16,
    )
    assert KVSpec(**{**fields, **change}).fingerprint() != SPEC.fingerprint()


@pytest.mark.parametrize(
    "bad, msg",
    [
        (dict(num_layers=0), "num_layers"),
        (dict(head_dim=-1), "head_dim"),
        (dict(page_size=0), "page_size"),
        (dict(dtype=torch.int8), "dtype"),
        (dict(model=""), "model"),
        (dict(head_start=1), "head_start"),
        (dict(total_kv_heads=2, head_start=2), "within the model"),
        (dict(num_kv_heads=2.0), "num_kv_heads"),
        (dict(group=None), "group"),
    ],
)
def test_invalid_specs_are_refused(bad, msg) -> None:
    fields = dict(
        model="m", num_layers=1, num_kv_heads=1, head_dim=1, page_size=1, dtype=torch.float32
    )
    with pytest.raises(SpecError, match=msg):
        KVSpec(**{**fields, **bad})


def test_spec_is_frozen() -> None:
    with pytest.raises(AttributeError):
        SPEC.page_size = 8  # type: ignore[misc]


def test_page_hash_golden_vectors() -> None:
    assert [h.hex() for h in page_hashes(SPEC, list(range(10)))] == [
        "a049b89b4e26755e99563165ddf6a4b6",
        "39e42da7002d32796334f4f8acc4553e",
    ]
    assert [h.hex() for h in page_hashes(SPEC, list(range(10)), salt=b"tenant-a")] == [
        "d6cf61b9a3a229f6eac9d53b35d5e415",
        "0f5c451c5cf535fa273f1f1f981f466c",
    ]


def test_hash_chain_definition() -> None:
    toks = [5, 6, 7, 8, 9, 10, 11, 12]
    h0 = hashlib.sha256(root_hash(SPEC) + struct.pack("<4I", *toks[:4])).digest()[:16]
    h1 = hashlib.sha256(h0 + struct.pack("<4I", *toks[4:])).digest()[:16]
    assert page_hashes(SPEC, toks) == [h0, h1]


def test_partial_last_page_is_not_hashed() -> None:
    toks = list(range(100, 111))  # 11 tokens, page 4: two full pages
    hs = page_hashes(SPEC, toks)
    assert len(hs) == 2
    assert hs == page_hashes(SPEC, toks + [0])[:2] == page_hashes(SPEC, toks[:8])
    assert page_hashes(SPEC, [1, 2, 3]) == []


def test_prefix_property() -> None:
    a = page_hashes(SPEC, [1] * 8 + [2] * 4)
    b = page_hashes(SPEC, [1] * 8 + [3] * 4)
    assert a[:2] == b[:2] and a[2] != b[2]


def test_salt_separates_tenants() -> None:
    toks = list(range(32))
    a, b = page_hashes(SPEC, toks, salt=b"a"), page_hashes(SPEC, toks, salt=b"b")
    assert not set(a) & set(b)


def test_token_ids_out_of_range() -> None:
    with pytest.raises(ValueError, match="2\\*\\*32"):
        page_hashes(SPEC, [1, 2, 3, 2**32])
    with pytest.raises(ValueError):
        page_hashes(SPEC, [-1, 0, 0, 0])


def test_same_hashes_in_processes_with_different_hash_seeds() -> None:
    code = (
        "import torch; from hurray_store import KVSpec; from hurray_store.keys import page_hashes;"
        "s = KVSpec('m', 2, 2, 8, 16, torch.bfloat16, revision='x');"
        "print(s.fingerprint().hex(), *[h.hex() for h in page_hashes(s, list(range(1000)), "
        "salt=b'z')])"
    )
    outs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(
            subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
            ).stdout
        )
    assert len(outs) == 1
    assert len(next(iter(outs)).split()) == 1 + 1000 // 16


def test_a_request_salt_without_parts_is_the_configured_salt() -> None:
    """A request with nothing of its own hashes as plain pages always have, so pages
    warmed without a request context serve it."""
    assert request_salt(b"tenant", [("cache_salt", None), ("lora", None)]) == b"tenant"
    assert request_salt(b"", []) == b""


def test_request_salts_of_different_parts_never_collide() -> None:
    """Each part is length-prefixed under its name: moving bytes between the configured
    salt and a part, between two parts, or naming another part gives another salt."""
    salts = {
        request_salt(b"", [("cache_salt", "alice")]),
        request_salt(b"", [("cache_salt", "bob")]),
        request_salt(b"", [("lora", "alice")]),
        request_salt(b"a", [("cache_salt", "lice")]),
        request_salt(b"", [("cache_salt", "alice"), ("lora", b"x")]),
        request_salt(b"", [("cache_salt", "alicex")]),
        b"alice",
        b"",
    }
    assert len(salts) == 8
    # The order parts are given in does not matter: they are sorted by name.
    assert request_salt(b"", [("lora", b"x"), ("cache_salt", "a")]) == request_salt(
        b"", [("cache_salt", "a"), ("lora", b"x")]
    )
    spec = KVSpec("m", 1, 1, 8, 4, torch.float16)
    toks = list(range(8))
    a = page_hashes(spec, toks, salt=request_salt(b"", [("cache_salt", "alice")]))
    assert a != page_hashes(spec, toks) and a != page_hashes(spec, toks, salt=b"alice")


def test_a_configured_salt_may_not_start_with_nul() -> None:
    """Composed salts start with NUL: a configured one that did could equal one."""
    from hurray_store.config import load_config

    with pytest.raises(ConfigError, match="NUL"):
        load_config({"salt": "\0x", "tiers": [{"type": "cpu", "capacity_bytes": 1024}]}, env={})
    with pytest.raises(ValueError, match="NUL"):
        check_salt(b"\0x")
    check_salt("fine")
