"""The vLLM connector's KV events: the blocks it saved, as vLLM's own ``BlockStored`` /
``BlockRemoved`` keyed by vLLM's block hashes, which vLLM's publisher
(``--kv-events-config``) sends with the events of its own KV cache (docs/events.md).

- The scheduler knows each block's vLLM hash, tokens, LoRA and extra keys
  (``block_infos``, as vLLM's block pool fills them for its own blocks) and sends them
  with each save and load (``Transfer.blocks``).
- The worker maps the store's page hash of each block it saved or read to them
  (``WorkerEvents``, bounded) and turns the engine port's events (each segment stored
  in, or removed from, a tier) into vLLM's events in that tier's medium;
  ``get_kv_connector_kv_cache_events`` hands them to vLLM, which keeps those every
  worker reported (each TP rank stores its own heads of the same blocks) and gives them
  to the scheduler's ``take_events``.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hurray_store.engine import EnginePort
from hurray_store.engine.events import EVENTS_KEPT
from hurray_store.events.wire import LOCAL, medium_of
from hurray_store.keys import SegmentKey, page_hashes
from hurray_store.spec import KVSpec

log = logging.getLogger(__name__)

KEPT_BLOCKS = 1 << 20  # blocks whose vLLM keys a worker remembers (LRU)
KEPT_SEGMENTS = 1 << 16  # segments whose pages a worker remembers, for their removal
# Calls an event waits for its segment's manifest: a segment's top tier is READY just
# before the store indexes its manifest, so its first event may come a moment early.
RETRIES = 64


@dataclass(frozen=True, slots=True)
class VllmBlock:
    """One block as vLLM's own events name it."""

    hash: bytes | int  # vLLM's ExternalBlockHash
    parent: bytes | int | None
    token_ids: tuple[int, ...]
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None


def block_infos(request: Any, first: int, end: int, block_size: int) -> list[VllmBlock] | None:
    """Blocks ``first..end`` of ``request`` as vLLM names them (its ``block_hashes``,
    which vLLM computes with prefix caching on); None where it has not hashed them."""
    hashes = list(getattr(request, "block_hashes", None) or [])
    if len(hashes) < end:
        return None
    from vllm.v1.core.kv_cache_utils import (
        generate_block_hash_extra_keys,
        maybe_convert_block_hash,
    )

    lora = getattr(request, "lora_request", None)
    tokens = list(request.all_token_ids)
    out: list[VllmBlock] = []
    mm = 0
    for i in range(first, end):
        a, b = i * block_size, (i + 1) * block_size
        try:
            extra, mm = generate_block_hash_extra_keys(request, a, b, mm)
        except Exception:  # another vLLM's signature: the keys are left out
            extra = None
        out.append(
            VllmBlock(
                maybe_convert_block_hash(hashes[i]),
                maybe_convert_block_hash(hashes[i - 1]) if i else None,
                tuple(tokens[a:b]),
                lora.adapter_id if lora else None,
                lora.name if lora else None,
                tuple(extra) if extra else None,
            )
        )
    return out


class WorkerEvents:
    """A worker's map from the store's pages to vLLM's blocks, and its events. It
    watches the store's ledger itself: a segment's pages are resolved when the change
    happens (a removed segment's manifest leaves the catalog right after)."""

    def __init__(self, port: EnginePort, spec: KVSpec) -> None:
        self.port, self.spec = port, spec
        self._ns = port.store.namespace
        self._blocks: OrderedDict[bytes, VllmBlock] = OrderedDict()
        self._segments: OrderedDict[SegmentKey, list[list[bytes]]] = OrderedDict()
        self._lock = threading.Lock()  # _segments: the store's thread and the engine's
        self._media = {t.name: medium_of(t.kind) for t in port.store.config.tiers}
        # (kind, tier, segment, its pages' runs or None: its manifest not indexed yet)
        self._noted: deque[tuple[str, str, SegmentKey, list[list[bytes]] | None]] = deque(
            maxlen=EVENTS_KEPT
        )
        self._early: list[tuple[str, str, SegmentKey, int]] = []  # manifest awaited
        q = port.store.config.quantization
        self._quantization = None if q == "none" else q
        self._unwatch = port.store.watch(self._note)

    def _note(self, kind: str, tier: str, group: Any, reason: str) -> None:
        if isinstance(group, SegmentKey) and group.namespace == self._ns:
            self._noted.append((kind, tier, group, self._runs(group)))

    def _runs(self, seg: SegmentKey) -> list[list[bytes]] | None:
        """The page hashes of each sequence the segment stores pages of."""
        with self._lock:
            runs = self._segments.get(seg)
            if runs is None:
                m = self.port.store.groups.cached_manifest(seg)
                if m is None:
                    return None
                runs = [list(s.page_hashes) for s in m.sequences if s.page_hashes]
                self._segments[seg] = runs
                while len(self._segments) > KEPT_SEGMENTS:
                    self._segments.popitem(last=False)
            return runs

    def note_blocks(
        self, token_ids: Sequence[int], salt: bytes, first: int, blocks: Sequence[VllmBlock]
    ) -> None:
        """Pages ``first..`` of ``token_ids`` (saved, or read by a load) are the vLLM
        blocks ``blocks`` (any thread)."""
        mine = page_hashes(
            self.spec,
            list(token_ids),
            salt=salt,
            quantization=self._quantization,
        )
        for h, b in zip(mine[first:], blocks, strict=False):
            self._blocks[h] = b
            self._blocks.move_to_end(h)
        while len(self._blocks) > KEPT_BLOCKS:
            self._blocks.popitem(last=False)

    def take(self) -> list[Any]:
        """vLLM's events of every segment stored or removed since the last call (blocks
        this worker neither saved nor read, or too long ago, are left out)."""
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        out: list[Any] = []
        # Where this vLLM's events have them (0.32 on): the tier, as a secondary tier's id.
        where = set(getattr(BlockStored, "__struct_fields__", ())) >= {"locality", "ownership"}
        noted = [self._noted.popleft() for _ in range(len(self._noted))]
        early, self._early = self._early, []
        todo: list[tuple[str, str, SegmentKey, int, list[list[bytes]] | None]]
        todo = [(k, t, g, n, None) for k, t, g, n in early]
        todo += [(k, t, g, 0, runs) for k, t, g, runs in noted]
        for kind, tier, seg, tries, runs in todo:
            runs = runs if runs is not None else self._runs(seg)
            if runs is None:
                if kind == "stored" and tries < RETRIES:
                    self._early.append((kind, tier, seg, tries + 1))
                continue
            medium = self._media.get(tier)
            extra_fields = {"locality": LOCAL, "ownership": tier} if where else {}
            for run in runs:
                blocks = [b for h in run if (b := self._blocks.get(h)) is not None]
                if not blocks:
                    continue
                if kind == "removed":
                    out.append(BlockRemoved([b.hash for b in blocks], medium, **extra_fields))
                    continue
                extra = [b.extra_keys for b in blocks]
                out.append(
                    BlockStored(
                        block_hashes=[b.hash for b in blocks],
                        parent_block_hash=blocks[0].parent,
                        token_ids=[t for b in blocks for t in b.token_ids],
                        block_size=self.spec.page_size,
                        lora_id=blocks[0].lora_id,
                        medium=medium,
                        lora_name=blocks[0].lora_name,
                        extra_keys=extra if any(e is not None for e in extra) else None,
                        **extra_fields,
                    )
                )
        return out
