"""Deterministic prefix hashing of token pages.

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
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hurray_store.spec import KVSpec

HASH_LEN = 16
_ROOT_TAG = b"hurray_store/page-hash/v1"


def root_hash(spec: KVSpec, salt: bytes = b"", quantization: str | None = None) -> bytes:
    """The chain's root: the spec's fingerprint, the salt and the quantization, each a
    field of its own (length-prefixed), so no salt can stand for another salt or for a
    quantization. Exact pages (``None``) hash as they always have."""
    if not isinstance(salt, bytes | bytearray):
        raise TypeError(f"salt must be bytes, got {type(salt).__name__}")
    fields = _ROOT_TAG + spec.fingerprint() + struct.pack("<I", len(salt)) + bytes(salt)
    if quantization is not None:
        q = quantization.encode()
        fields += b"quantization" + struct.pack("<I", len(q)) + q
    return hashlib.sha256(fields).digest()


_REQUEST_SALT_TAG = b"\x00hurray_store/request-salt/v1"


def request_salt(base: bytes, parts: Sequence[tuple[str, bytes | str | None]]) -> bytes:
    """The salt of one request: the configured ``base`` salt, and what else of the
    request shapes its KV (``parts``: a tenant's cache salt, a LoRA adapter's identity),
    each field length-prefixed under its name, so no value can stand for another field or
    another split of the same bytes. With no part set it is ``base`` itself (a request
    without any hashes as the engine's plain pages always have, and warmed pages serve
    it). Composed salts start with a NUL byte, which a configured salt may not
    (``check_salt``), so no configured salt equals a composed one."""
    fields = [
        (k, v.encode() if isinstance(v, str) else bytes(v)) for k, v in parts if v is not None
    ]
    if not fields:
        return base
    out = [_REQUEST_SALT_TAG, struct.pack("<I", len(base)), base]
    for name, value in sorted(fields):
        n = name.encode()
        out += [struct.pack("<I", len(n)), n, struct.pack("<I", len(value)), value]
    return b"".join(out)


def check_salt(salt: bytes | str) -> None:
    """A configured salt may not start with NUL: that prefix marks ``request_salt``'s
    composed salts."""
    if salt[:1] in (b"\x00", "\x00"):
        raise ValueError("a configured salt may not start with a NUL byte (composed salts do)")


def token_array(token_ids: Sequence[int]) -> np.ndarray:
    """Token ids as little-endian uint32, refusing ids outside [0, 2**32)."""
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be a flat sequence of ints, got shape {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise ValueError("token ids must be in [0, 2**32)")
    return arr.astype("<u4")


def page_hashes(
    spec: KVSpec, token_ids: Sequence[int], *, salt: bytes = b"", quantization: str | None = None
) -> list[bytes]:
    """One 16-byte chained hash per FULL page of ``token_ids`` (a partial last page is
    not hashed)."""
    toks = token_array(token_ids)
    p = spec.page_size
    n = toks.size // p
    raw = toks[: n * p].tobytes()
    step = 4 * p
    prev = root_hash(spec, salt, quantization)
    out = []
    sha = hashlib.sha256
    for i in range(n):
        prev = sha(prev + raw[i * step : (i + 1) * step]).digest()[:HASH_LEN]
        out.append(prev)
    return out


# --------------------------------------------------------------------------- stored keys
#
# The store's key scheme. Typed values travel inside the package; strings exist only at
# the edges (tiers store them, clients send them) and are parsed once, by ``parse_key``.
#
#     <ns>/s/{<segment id hex>}/<layer>     layer object of a segment
#     <ns>/s/{<segment id hex>}/m           its manifest (the commit point)
#     <ns>/o/<name>                         an object-level key
#     <ns>/g/<name>                         the member list of an object-level group
#                                           whose last object is <ns>/o/<name>
#
# ``{...}`` is a Redis Cluster hash tag: a segment's objects share one slot.

MANIFEST_PART = "m"


@dataclass(frozen=True, slots=True)
class SegmentKey:
    """A segment: its layer objects and its manifest enter and leave a tier together."""

    namespace: str
    segment_id: bytes

    @property
    def hex(self) -> str:
        return self.segment_id.hex()

    @property
    def prefix(self) -> str:
        return f"{self.namespace}/s/{{{self.hex}}}/"

    def layer(self, index: int) -> str:
        return f"{self.prefix}{index}"

    @property
    def manifest(self) -> str:
        return f"{self.prefix}{MANIFEST_PART}"


@dataclass(frozen=True, slots=True)
class SegmentPart:
    """A stored key that belongs to a segment: layer ``layer``, or the manifest (None)."""

    segment: SegmentKey
    layer: int | None

    @property
    def is_manifest(self) -> bool:
        return self.layer is None


def object_stored(namespace: str, name: str) -> str:
    """The stored key of object ``name`` in ``namespace`` (``ObjectKey.stored``), made
    without the key's dataclass, for the ledger's lookups from engines' threads."""
    return f"{namespace}/o/{name}"


class ObjectKey(NamedTuple):
    """An object-level key; as a group id it names the group whose last object it is.
    A named tuple, not a dataclass: as a group id it is hashed a few times on every pin
    and unpin of an engine's lookup, and a tuple's hash is C (a third of the cost of a
    frozen dataclass's generated ``__hash__``)."""

    namespace: str
    name: str

    @property
    def stored(self) -> str:
        return object_stored(self.namespace, self.name)

    @property
    def member_list(self) -> str:
        """Where the member list of a group of several objects is kept."""
        return f"{self.namespace}/g/{self.name}"


@dataclass(frozen=True, slots=True)
class MemberListKey:
    """The member list of the object-level group ``group``."""

    group: ObjectKey


# A policy group: what enters and leaves a tier as one.
GroupId = SegmentKey | ObjectKey
StoredKey = SegmentPart | ObjectKey | MemberListKey

_HEX = frozenset("0123456789abcdef")


def parse_key(key: str) -> StoredKey | None:
    """The typed value of a stored key, or None for a key outside the scheme (a key with
    a namespace but no known kind, an empty name, a segment id that is not lower-case
    hex of even length, a part that is neither a layer index nor ``m``)."""
    seg_ns, sep, rest = key.partition("/s/{")
    if sep and seg_ns and "/o/" not in seg_ns and "/g/" not in seg_ns:
        seg_hex, sep, part = rest.partition("}/")
        if not sep or not seg_hex or len(seg_hex) % 2 or not _HEX.issuperset(seg_hex):
            return None
        seg = SegmentKey(seg_ns, bytes.fromhex(seg_hex))
        if part == MANIFEST_PART:
            return SegmentPart(seg, None)
        if part.isascii() and part.isdigit() and len(part) < 10:
            return SegmentPart(seg, int(part))
        return None
    for kind in ("/o/", "/g/"):
        ns, sep, name = key.partition(kind)
        if sep and ns and name:
            obj = ObjectKey(ns, name)
            return obj if kind == "/o/" else MemberListKey(obj)
    return None


def encode_member_list(keys: Sequence[tuple[str, int]]) -> bytes:
    """The member list of an object-level group: (stored key, size) per member, as
    ``u32 count`` then per member ``u32 key length, key utf-8, u64 size``."""
    out = [struct.pack("<I", len(keys))]
    for k, n in keys:
        b = k.encode()
        out.append(struct.pack("<I", len(b)) + b + struct.pack("<Q", n))
    return b"".join(out)


def decode_member_list(blob: bytes | bytearray | memoryview) -> list[tuple[str, int]] | None:
    """``encode_member_list``'s members, or None when the bytes are not one (every
    length is checked against what is left before it is used)."""
    mv = memoryview(blob).cast("B")
    if len(mv) < 4:
        return None
    (count,) = struct.unpack_from("<I", mv, 0)
    if count * 12 > len(mv) - 4:  # each member takes at least 12 bytes
        return None
    pos = 4
    out: list[tuple[str, int]] = []
    for _ in range(count):
        if len(mv) - pos < 4:
            return None
        (n,) = struct.unpack_from("<I", mv, pos)
        pos += 4
        if len(mv) - pos < n + 8:
            return None
        try:
            k = bytes(mv[pos : pos + n]).decode()
        except UnicodeDecodeError:
            return None
        (size,) = struct.unpack_from("<Q", mv, pos + n)
        pos += n + 8
        out.append((k, size))
    return out if pos == len(mv) else None
