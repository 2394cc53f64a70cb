"""The model identity an engine adapter keys by, built alike for every engine: the
weights and KV-shaping config of the model folder (``identity.model_identity``), or,
where the engine names no folder, its model name alone, with one warning naming the
risk (two checkpoints served under one name would then share KV)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import xxhash

from hurray_store.identity import checkpoint_id, model_identity

log = logging.getLogger(__name__)


def folder_identity(model_path: str | None, model_name: str | None, who: str) -> str:
    """The identity of the model in ``model_path`` (or in ``model_name``, when that is a
    folder); else ``name:<model_name>``, warned about once. ``who`` names the caller in
    errors and the warning. Raises ValueError when neither names anything, or the
    folder's config.json cannot be read."""
    folder = model_path or model_name or ""
    if not folder:
        raise ValueError(f"{who}: no model to key by: set model_path")
    p = Path(folder)
    if p.is_dir():
        cfg: dict[str, Any] = {}
        if (p / "config.json").is_file():
            try:
                cfg = json.loads((p / "config.json").read_text())
            except (OSError, ValueError) as e:
                raise ValueError(f"{who}: {p / 'config.json'}: {e}") from e
        return model_identity(checkpoint_id(folder), cfg)
    if model_path:
        raise ValueError(f"{who}: model_path {model_path!r} is not a folder")
    log.warning(
        "%s: model name %r is not a model folder and no model_path is set: keyed by the "
        "name alone, so two checkpoints served under that name would share KV; set "
        "model_path to key by the weights",
        who,
        folder,
    )
    return f"name:{folder}"


def identity_tag(identity: str) -> str:
    """A short, fixed-length tag of ``identity`` for object names (xxh3-64, hex)."""
    return xxhash.xxh3_64_hexdigest(identity.encode())
