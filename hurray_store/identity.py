"""A model's identity for the layout fingerprint, from a checkpoint folder's weights.

``checkpoint_id(folder)`` is ``<model_type>@xxh3-128:<hash>``, the hash taken over every
tensor of the folder's ``*.safetensors`` files in name order, each as its name, dtype,
shape and bytes (read through ``safetensors``, memory-mapped). Two checkpoints whose
weights differ in any bit get different identities whatever their folders are called;
the same checkpoint copied elsewhere gets the same one. Every process that serves the
folder (vLLM's scheduler, which has no weights in memory, and its workers) derives it
alike, at xxh3's speed over the files (the page cache makes a second pass cheap).

A folder without safetensors files is hashed file by file (names and bytes); a model
name that is no folder (vLLM resolving a hub id) is taken as given, with a warning.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open

log = logging.getLogger(__name__)
_CHUNK = 64 << 20


def _model_type(folder: Path) -> str:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return "model"
    t = cfg.get("model_type") if isinstance(cfg, dict) else None
    return str(t) if t else "model"


@lru_cache(maxsize=8)
def checkpoint_id(model: str) -> str:
    folder = Path(model)
    if not folder.is_dir():
        log.warning(
            "model %r is not a folder: its identity is its name (a new revision behind the "
            "same name would share the cache)",
            model,
        )
        return f"name:{model}"
    h = xxhash.xxh3_128()
    files = sorted(folder.glob("*.safetensors"))
    if files:
        entries: list[tuple[str, Path]] = []
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                entries += [(name, f) for name in st.keys()]  # noqa: SIM118 - not a dict
        for name, f in sorted(entries):
            with safe_open(str(f), framework="pt") as st:
                t = st.get_tensor(name)
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            raw = t.reshape(-1).contiguous().view(torch.uint8) if t.numel() else None
            for a in range(0, 0 if raw is None else raw.numel(), _CHUNK):
                h.update(raw[a : a + _CHUNK].numpy())  # type: ignore[index]
    else:
        for f in sorted(p for p in folder.iterdir() if p.is_file()):
            h.update(f"{f.name}|".encode())
            with open(f, "rb") as fh:
                while chunk := fh.read(_CHUNK):
                    h.update(chunk)
    return f"{_model_type(folder)}@xxh3-128:{h.hexdigest()}"
