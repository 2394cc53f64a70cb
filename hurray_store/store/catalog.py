"""SegmentCatalog: which segments are committed, and what their manifests say.

It owns the prefix index and a cache of parsed manifests. Its primitives:

- ``add(manifest)``: the commit hook (the cascade runs it once the manifest is stored).
- ``longest_prefix`` / ``contains_many``: what the index holds.
- ``manifest(segment_id, spec)``: cache, else the fastest tier's copy, parsed and checked
  against its key and against ``spec``; a bad one is quarantined and the segment leaves
  the index (a miss, never wrong data).
- ``reject(segment_id, why)`` / ``drop(segment_id)``: the segment leaves the index.
- ``discover(spec, hashes, claim)``: segments shared tiers hold that the index lacks.
- ``rebuild(tier, found)``: the restart scan of one tier's segment keys.

It calls the cascade for bytes, and is told by it when a segment's group leaves the last
tier holding it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from hurray_store.errors import FormatError
from hurray_store.format import Manifest
from hurray_store.keys import SegmentKey
from hurray_store.spec import KVSpec
from hurray_store.store.cascade import TierCascade
from hurray_store.store.index import PrefixIndex, PrefixMatch
from hurray_store.store.ledger import Group
from hurray_store.tiers import Blob, host_view
from hurray_store.tiers.base import SharedTier

log = logging.getLogger(__name__)
_MANIFEST_CACHE = 1024
_MANIFEST_BATCH = 1024  # manifests read per trip at restart


def depth(m: Manifest) -> int:
    """How far into its sequences a segment reaches, in pages (evicted deepest first)."""
    return max((s.first_page + len(s.block_table) for s in m.sequences), default=0)


def mismatch(m: Manifest, spec: KVSpec) -> str:
    """Why a manifest cannot serve a pool of ``spec`` ("" when it can)."""
    if m.fingerprint != spec.fingerprint():
        return "fingerprint differs from the pool's spec"
    if m.page_size != spec.page_size:
        return f"page_size {m.page_size}, the pool has {spec.page_size}"
    elem = 1 if m.quantization else spec.element_size
    if m.page_bytes != spec.page_size * spec.num_kv_heads * spec.head_dim * elem:
        return f"page_bytes {m.page_bytes} do not match the spec"
    if sorted(lay.layer_index for lay in m.layers) != list(range(spec.num_layers)):
        return "the manifest does not hold every layer of the spec"
    return ""


class SegmentCatalog:
    def __init__(self, namespace: str, cascade: TierCascade) -> None:
        self.namespace = namespace
        self.cascade = cascade
        self.index = PrefixIndex()
        self._manifests: OrderedDict[bytes, Manifest] = OrderedDict()
        cascade.subscribe(self._on_group_left)

    def key(self, segment_id: bytes) -> SegmentKey:
        return SegmentKey(self.namespace, segment_id)

    # ------------------------------------------------------------------ the index

    def add(self, m: Manifest) -> None:
        """A segment was committed: index its pages, keep its manifest."""
        self.index.insert_many(_index_entries(m))
        self._cache(m)

    def drop(self, segment_id: bytes) -> None:
        self.index.remove_segment(segment_id)
        self._manifests.pop(segment_id, None)

    def longest_prefix(self, hashes: Sequence[bytes]) -> PrefixMatch:
        return self.index.longest_prefix(list(hashes))

    def contains_many(self, hashes: Sequence[bytes]) -> np.ndarray:
        return self.index.contains_many(list(hashes))

    def segments(self) -> list[bytes]:
        return self.index.segments()

    def cached_manifest(self, segment_id: bytes) -> Manifest | None:
        """The parsed manifest of an indexed segment, when cached (no I/O)."""
        return self._manifests.get(segment_id)

    def _on_group_left(self, group: Group) -> None:
        if isinstance(group, SegmentKey) and group.namespace == self.namespace:
            self.drop(group.segment_id)

    def _cache(self, m: Manifest) -> None:
        self._manifests[m.segment_id] = m
        self._manifests.move_to_end(m.segment_id)
        while len(self._manifests) > _MANIFEST_CACHE:
            self._manifests.popitem(last=False)

    # ------------------------------------------------------------------ manifests

    async def manifest(self, segment_id: bytes, spec: KVSpec) -> Manifest | None:
        """The segment's manifest, checked against ``spec``; None (and the segment out
        of the index) when no tier has a good one that fits."""
        m = self._manifests.get(segment_id)
        if m is None:
            got = await self._read(segment_id)
            m = None if got is None else got[0]
        if m is None:
            self.drop(segment_id)
            return None
        why = mismatch(m, spec)
        if why:
            self.reject(segment_id, why)
            return None
        self._cache(m)
        return m

    async def manifest_bytes(self, segment_id: bytes) -> bytes | None:
        m = self._manifests.get(segment_id)
        if m is not None:
            return m.to_bytes()
        got = await self._read(segment_id)
        if got is None:
            return None
        self._cache(got[0])
        return bytes(host_view(got[1]))

    async def _read(self, segment_id: bytes) -> tuple[Manifest, Blob] | None:
        """A segment's manifest (parsed, checked against its key) and its bytes, from
        the fastest tier holding a good one."""
        seg = self.key(segment_id)
        for i in self.cascade.ledger.holders(seg.manifest):
            blob = await self.cascade.tiers[i].get(seg.manifest)
            if blob is None:
                self.cascade.reads.missing(i, seg.manifest)
                continue
            self.cascade.reads.hit(i, len(host_view(blob)))
            m = self.parse(i, seg, blob)
            if m is not None:
                return m, blob
        return None

    def parse(self, tier: int, seg: SegmentKey, blob: Blob) -> Manifest | None:
        """The manifest ``tier`` holds for ``seg``, or None (quarantined) when it is not
        a valid one for that key."""
        try:
            m = Manifest.from_bytes(host_view(blob))
            if m.segment_id != seg.segment_id:
                raise FormatError(
                    f"manifest names segment {m.segment_id.hex()}, stored as {seg.hex}"
                )
            if any(lay.key != seg.layer(lay.layer_index) for lay in m.layers):
                raise FormatError("manifest names layer objects outside its segment")
            return m
        except FormatError as e:
            self.cascade.reads.report_bad(tier, seg, seg.manifest, f"manifest: {e}")
            return None

    def reject(self, segment_id: bytes, why: str) -> None:
        """The segment cannot be served (its manifest does not fit the request): out of
        every tier holding it, and out of the index."""
        seg = self.key(segment_id)
        for i in self.cascade.ledger.group_holders(seg):
            self.cascade.reads.report_bad(i, seg, seg.manifest, why)
        self.drop(segment_id)

    # ------------------------------------------------------------------ shared tiers

    async def discover(
        self, spec: KVSpec, hashes: Sequence[Sequence[bytes]], *, claim: bool
    ) -> None:
        """Ask each shared tier (a cache server other engines write to) for the segments
        holding pages past what the index knows, and index them as held there. With
        ``claim``, the server also reserves the pages nobody holds for this put
        (another engine's put of them waits for it, so a page is stored once)."""
        for i in self.cascade.reads.shared_tiers():
            tier = self.cascade.tiers[i]
            assert isinstance(tier, SharedTier)
            ask = [(self.longest_prefix(hs).num_pages, list(hs)) for hs in hashes]
            if all(h == len(hs) for h, hs in ask):
                return  # the index knows every page already
            got = await tier.lookup_prefix(ask, claim=claim)
            for blob in got or ():
                try:
                    m = Manifest.from_bytes(blob)
                except FormatError as e:
                    self.cascade.metrics.tiers[tier.name].verification_failures += 1
                    log.warning(
                        "tier %s: a manifest it sent is invalid (%s); ignored", tier.name, e
                    )
                    continue
                seg = self.key(m.segment_id)
                if mismatch(m, spec) or any(
                    lay.key != seg.layer(lay.layer_index) for lay in m.layers
                ):
                    continue  # another model's, or foreign keys: not ours to read
                if i in self.cascade.ledger.group_holders(seg):
                    continue
                sizes = {lay.key: lay.object_size for lay in m.layers}
                sizes[seg.manifest] = len(blob)
                self.cascade.ledger.add_ready(i, seg, sizes, depth=depth(m))
                self.add(m)

    # ------------------------------------------------------------------ other processes

    async def adopt(self, tier: int, seg: SegmentKey) -> None:
        """Another process committed ``seg`` to ``tier`` (a disk folder both use): read
        and check its manifest, record the segment as held there, and index it."""
        if self.cascade.ledger.has_entry(tier, seg):
            return
        blob = await self.cascade.tiers[tier].get(seg.manifest)
        if blob is None:
            return  # removed again already
        m = self.parse(tier, seg, blob)
        if m is None or self.cascade.ledger.has_entry(tier, seg):
            return
        sizes = {lay.key: lay.object_size for lay in m.layers}
        sizes[seg.manifest] = len(host_view(blob))
        self.cascade.ledger.add_ready(tier, seg, sizes, depth=depth(m))
        self.add(m)

    # ------------------------------------------------------------------ restart

    async def rebuild(self, tier: int, found: dict[SegmentKey, dict[str, int]]) -> list[str]:
        """The ledger and the index from the segment keys a restart scan ``found`` in ``tier``:
        committed segments are recorded; bad manifests are quarantined. Returns the
        keys of uncommitted segments (no manifest, or missing a layer object): the
        caller deletes them."""
        t = self.cascade.tiers[tier]
        orphans = [k for seg, ks in found.items() if seg.manifest not in ks for k in ks]
        todo = [seg for seg, ks in found.items() if seg.manifest in ks]
        parts = [todo[b : b + _MANIFEST_BATCH] for b in range(0, len(todo), _MANIFEST_BATCH)]
        entries: list[tuple[bytes, int, int, Sequence[bytes]]] = []
        # Read the next batch of manifests (in a thread, on disk) while parsing this one.
        nxt = asyncio.ensure_future(t.get_many([s.manifest for s in parts[0]])) if parts else None
        n_found = 0
        for b, part in enumerate(parts):
            assert nxt is not None
            blobs = await nxt
            nxt = (
                asyncio.ensure_future(t.get_many([s.manifest for s in parts[b + 1]]))
                if b + 1 < len(parts)
                else None
            )
            for seg, blob in zip(part, blobs, strict=True):
                have = found[seg]
                m = None if blob is None else self.parse(tier, seg, blob)
                if m is None or any(have.get(lay.key) != lay.object_size for lay in m.layers):
                    if m is not None:
                        log.warning(
                            "tier %s: segment %s lacks layer objects; dropped", t.name, seg.hex
                        )
                    orphans += [k for k in have if k != seg.manifest]
                    continue
                self.cascade.ledger.add_ready(tier, seg, have, depth=depth(m))
                entries += _index_entries(m)
                n_found += 1
        self.index.insert_many(entries)
        log.info("tier %s: found %d segments", t.name, n_found)
        return orphans


def _index_entries(m: Manifest) -> list[tuple[bytes, int, int, Sequence[bytes]]]:
    return [
        (m.segment_id, s, seq.first_page, seq.page_hashes)
        for s, seq in enumerate(m.sequences)
        if seq.page_hashes
    ]
