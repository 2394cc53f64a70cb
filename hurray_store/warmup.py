"""Offline cache warmup and the replay demo.

``warmup`` runs a model's prefill over a prompt corpus and puts the KV into the store:

- Prompts are sorted by their token ids, so prompts that share a prefix sit next to
  each other, and cut into batches.
- For each batch, the longest common prefix of its prompts is prefilled once, on top
  of whatever of it the store already holds (``prefill_with_cache``). The batch's
  tails are then prefilled together, right padded, on that shared cache.
- The batch is paged with its shared pages stored once, and put. A prompt whose full
  pages are all stored already is skipped without running the model.

The put is idempotent and resumable. A second run over the same corpus writes nothing.
A run stopped half way has committed whole segments only: the manifest is the commit
point, so the next run carries on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from hurray_store import tokenizer
from hurray_store.adapters.transformers import from_paged, prefill_with_cache, run_model, to_paged
from hurray_store.paging import PagedKVPool


@dataclass(frozen=True, slots=True)
class PromptError:
    line: int
    reason: str


def read_prompts(path: str | Path, *, vocab_size: int) -> tuple[list[list[int]], list[PromptError]]:
    """Token ids of every good line of a JSONL corpus (``{"text": ...}`` through the
    byte tokenizer, or ``{"token_ids": [...]}``), and what was wrong with the others:
    whatever a line can raise is a reason for that line, never an exception here."""
    prompts: list[list[int]] = []
    bad: list[PromptError] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                prompts.append(_prompt_of(line, vocab_size))
            except json.JSONDecodeError as e:
                bad.append(PromptError(n, f"not JSON ({e.msg} at column {e.colno})"))
            except RecursionError:
                bad.append(PromptError(n, "JSON nested too deeply"))
            except (ValueError, TypeError) as e:  # UnicodeError is a ValueError
                bad.append(PromptError(n, str(e) or type(e).__name__))
    return prompts, bad


def _prompt_of(line: str, vocab_size: int) -> list[int]:
    """One corpus line's token ids; ValueError says what is wrong with it."""
    obj = json.loads(line)
    if not isinstance(obj, dict) or ("text" in obj) == ("token_ids" in obj):
        raise ValueError('expected an object with exactly one of "text" or "token_ids"')
    if "text" in obj:
        if not isinstance(obj["text"], str) or not obj["text"]:
            raise ValueError('"text" must be a non-empty string')
        try:
            return tokenizer.encode(obj["text"])
        except UnicodeEncodeError as e:
            raise ValueError(f'"text" is not encodable text ({e.reason})') from e
    ids = obj["token_ids"]
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
    ):
        raise ValueError('"token_ids" must be a non-empty list of integers')
    out_of_range = [t for t in ids if not 0 <= t < vocab_size]
    if out_of_range:
        raise ValueError(
            f"token id {out_of_range[0]} outside the model's vocabulary [0, {vocab_size})"
        )
    return ids


@dataclass
class WarmupResult:
    prompts: int = 0
    tokens: int = 0
    tokens_computed: int = 0
    pages_referenced: int = 0
    pages_written: int = 0
    pages_already_stored: int = 0
    prompts_skipped: int = 0  # every full page already stored: the model did not run
    bytes_per_tier: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


def _common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    n = min(len(s) for s in seqs)
    first = seqs[0]
    for i in range(n):
        t = first[i]
        if any(s[i] != t for s in seqs[1:]):
            return i
    return n


def pool_pages(prompts: Sequence[Sequence[int]], page_size: int, batch_size: int) -> int:
    """Pages a warmup of ``prompts`` needs in its pool at most: the ``batch_size``
    largest prompts' pages (a batch is at most that many prompts; a partial last page
    counts), plus the longest prompt's pages for the shared prefix read back from the
    store. What a batch needs, not the longest prompt times the batch size."""
    pages = sorted((-(-len(p) // page_size) for p in prompts), reverse=True)
    return max(1, sum(pages[:batch_size]) + (pages[0] if pages else 0))


async def warmup(
    model: Any,
    store: Any,
    pool: PagedKVPool,
    prompts: Sequence[Sequence[int]],
    *,
    batch_size: int = 8,
    progress: Callable[[int, int, WarmupResult], None] | None = None,
) -> WarmupResult:
    """Prefill ``prompts`` in batches and put their KV into ``store`` (see the module
    docstring). ``progress(prompts_done, tokens_done, result_so_far)`` after each batch."""
    spec = pool.spec
    P = spec.page_size
    res = WarmupResult()
    t0 = time.perf_counter()
    order = sorted(range(len(prompts)), key=lambda i: list(prompts[i]))
    todo: list[list[int]] = []
    for i in order:
        p = list(prompts[i])
        res.prompts += 1
        res.tokens += len(p)
        full = len(p) // P
        res.pages_referenced += full
        if (await store.lookup(spec, [p]))[0] >= full * P:
            res.prompts_skipped += 1
            res.pages_already_stored += full
        else:
            todo.append(p)
    if progress:
        progress(res.prompts_skipped, 0, res)
    done_prompts, done_tokens = res.prompts_skipped, 0
    for b in range(0, len(todo), batch_size):
        batch = todo[b : b + batch_size]
        await _warm_batch(model, store, pool, batch, res)
        done_prompts += len(batch)
        done_tokens += sum(len(p) for p in batch)
        if progress:
            progress(done_prompts, done_tokens, res)
    await store.flush()
    res.seconds = time.perf_counter() - t0
    return res


async def _warm_batch(
    model: Any, store: Any, pool: PagedKVPool, batch: list[list[int]], res: WarmupResult
) -> None:
    # The shared prefix once (on top of what the store has), leaving each prompt at
    # least one token of tail.
    lcp = min(_common_prefix(batch), min(len(p) for p in batch) - 1)
    past: Any = DynamicCache()
    if lcp > 0:
        _, past, reused = await prefill_with_cache(
            model, store, pool, batch[0][:lcp], store_result=False
        )
        res.tokens_computed += lcp - reused
        if len(batch) > 1:
            past = _repeat(past, len(batch), pool)
    tails = [p[lcp:] for p in batch]
    width = max(len(t) for t in tails)
    ids = torch.full((len(batch), width), tokenizer.PAD, dtype=torch.long)
    mask = torch.zeros((len(batch), lcp + width), dtype=torch.long)
    for i, t in enumerate(tails):
        ids[i, : len(t)] = torch.tensor(t)
        mask[i, : lcp + len(t)] = 1  # right padding: pads come after every real token
    _, cache = run_model(model, ids, cache=past, attention_mask=mask)
    res.tokens_computed += sum(len(t) for t in tails)
    lens = [len(p) for p in batch]
    tables = to_paged(cache, pool, lens, token_ids=batch)
    try:
        r = await store.put(pool, batch, tables)
    finally:
        pool.free([p for t in tables for p in t])
    res.pages_written += r.pages_written
    res.pages_already_stored += r.pages_already_stored
    for k, v in r.bytes_per_tier.items():
        res.bytes_per_tier[k] = res.bytes_per_tier.get(k, 0) + v


def _repeat(past: Any, n: int, pool: PagedKVPool) -> Any:
    """The one-sequence cache ``past`` as a batch of ``n`` equal sequences."""
    cache = DynamicCache()
    for li, lay in enumerate(past.layers):
        cache.update(
            lay.keys.expand(n, -1, -1, -1).contiguous(),
            lay.values.expand(n, -1, -1, -1).contiguous(),
            li,
        )
    return cache


@dataclass
class ReplayRow:
    tokens: int
    reused: int
    ttft_cold_s: float
    ttft_warm_s: float
    max_abs_diff: float


async def replay(
    model: Any,
    store: Any,
    pool: PagedKVPool,
    prompts: Sequence[Sequence[int]],
    on_each: Callable[[], None] | None = None,
) -> list[ReplayRow]:
    """For each prompt: time to first token without the cache (a full prefill) and
    with it (``prefill_with_cache``, nothing stored), and the largest difference
    between their next-token logits. ``on_each()`` after each (a progress bar)."""
    rows = []
    for p in prompts:
        ids = torch.tensor([list(p)], dtype=torch.long)
        t0 = time.perf_counter()
        cold = run_model(model, ids)[0][:, -1]
        t_cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        logits, _, reused = await prefill_with_cache(
            model, store, pool, list(p), store_result=False
        )
        t_warm = time.perf_counter() - t0
        diff = (logits[:, -1].float() - cold.float()).abs().max().item()
        rows.append(ReplayRow(len(p), reused, t_cold, t_warm, diff))
        if on_each is not None:
            on_each()
    return rows


__all__ = [
    "PromptError",
    "ReplayRow",
    "WarmupResult",
    "from_paged",
    "read_prompts",
    "replay",
    "warmup",
]
