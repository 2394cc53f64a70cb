"""Deterministic prefix hashing of token pages (layer L1).

``h_0 = H(root, page_0)``, ``h_i = H(h_{i-1}, page_i)`` with ``H`` = SHA-256 truncated to
16 bytes, ``root = SHA-256(tag, spec fingerprint, salt)``, and a page's tokens encoded as
little-endian uint32. Never Python's ``hash``, never a random seed: the same tokens give
the same hashes in every process and on every machine; another salt (tenant) gives
unrelated ones. Only full pages are hashed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

from hurray_store.spec import KVSpec

HASH_LEN = 16
_ROOT_TAG = b"hurray_store/page-hash/v1"


def root_hash(spec: KVSpec, salt: bytes = b"") -> bytes:
    if not isinstance(salt, bytes | bytearray):
        raise TypeError(f"salt must be bytes, got {type(salt).__name__}")
    return hashlib.sha256(_ROOT_TAG + spec.fingerprint() + struct.pack("<I", len(salt)) + bytes(salt)).digest()


def token_array(token_ids: Sequence[int]) -> np.ndarray:
    """Token ids as little-endian uint32, refusing ids outside [0, 2**32)."""
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be a flat sequence of ints, got shape {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise ValueError("token ids must be in [0, 2**32)")
    return arr.astype("<u4")


def page_hashes(spec: KVSpec, token_ids: Sequence[int], *, salt: bytes = b"") -> list[bytes]:
    """One 16-byte chained hash per FULL page of ``token_ids`` (a partial last page is
    not hashed)."""
    toks = token_array(token_ids)
    p = spec.page_size
    n = toks.size // p
    raw = toks[: n * p].tobytes()
    step = 4 * p
    prev = root_hash(spec, salt)
    out = []
    sha = hashlib.sha256
    for i in range(n):
        prev = sha(prev + raw[i * step : (i + 1) * step]).digest()[:HASH_LEN]
        out.append(prev)
    return out


# --------------------------------------------------------------------------- object keys
#
# The store's key scheme, here because three layers read it: the store writes these
# keys, the remote tier and the cache server recognise a segment's objects by them.
#
#     <ns>/s/{<segment id hex>}/<layer>     layer object of a segment
#     <ns>/s/{<segment id hex>}/m           its manifest (the commit point)
#     <ns>/o/<key>                          an object-level key
#
# ``{...}`` is a Redis Cluster hash tag: a segment's objects share one slot.

MANIFEST_PART = "m"


def segment_prefix(ns: str, seg_hex: str) -> str:
    return f"{ns}/s/{{{seg_hex}}}/"


def layer_key(ns: str, seg_hex: str, layer: int) -> str:
    return f"{segment_prefix(ns, seg_hex)}{layer}"


def manifest_key(ns: str, seg_hex: str) -> str:
    return f"{segment_prefix(ns, seg_hex)}{MANIFEST_PART}"


def object_key(ns: str, key: str) -> str:
    return f"{ns}/o/{key}"


def parse_segment_key(key: str) -> tuple[str, str, str] | None:
    """``(namespace, segment id hex, part)`` of a segment object's key (``part`` is the
    layer index as text, or ``m`` for the manifest); None for any other key."""
    ns, sep, rest = key.partition("/s/{")
    if not sep or not ns:
        return None
    seg_hex, sep, part = rest.partition("}/")
    if not sep or not seg_hex or not part:
        return None
    if any(c not in "0123456789abcdef" for c in seg_hex):
        return None
    if part != MANIFEST_PART and not part.isdigit():
        return None
    return ns, seg_hex, part
