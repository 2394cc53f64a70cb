"""The model identity an engine adapter keys by, built alike for every engine: the
weights and KV-shaping config of the model folder (``identity.model_identity``), or,
where the engine names no folder, its model name alone, with one warning naming the
risk (two checkpoints served under one name would then share KV)."""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import xxhash

from hurray_store.identity import checkpoint_id, folder_signature, model_identity

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


class WeightsIdentity:
    """The identity an engine keys by, kept up with its weights (docs/engine.md, "When
    the weights change").

    - The model folder's files are checked (one ``stat`` each, at most every
      ``check_every_s``) by ``current``: when one changed (weights replaced in place, a
      hot reload), the identity becomes a fresh generation at once (a salt of its own:
      no old KV is found from that moment) while the new files are hashed on a thread
      of its own; then it is the new weights' identity.
    - ``reset``, the engine's cache reset (vLLM's ``reset_cache``, SGLang's and
      LMCache's ``clear``), which is how an engine says its weights may have changed in
      memory with nothing on disk (a reinforcement-learning weight sync): a fresh
      generation until the folder's files change, or the new files' identity at once
      when they already have.

    ``value`` is the identity now; ``changes`` counts how often it changed."""

    def __init__(
        self,
        model_path: str | None,
        model_name: str | None,
        who: str,
        check_every_s: float = 1.0,
    ) -> None:
        self.who, self.check_every_s = who, check_every_s
        self._args = (model_path, model_name, who)
        self.folder = next((f for f in (model_path, model_name) if f and Path(f).is_dir()), None)
        self._sig = folder_signature(self.folder) if self.folder else ()
        self.base = folder_identity(model_path, model_name, who)
        self.generation = ""
        self.changes = 0
        self._checked = time.monotonic()
        self._lock = threading.Lock()
        self._hashing: threading.Thread | None = None

    @property
    def value(self) -> str:
        return f"{self.base}+generation:{self.generation}" if self.generation else self.base

    def current(self) -> str:
        """The identity now, the folder checked first when it is due."""
        now = time.monotonic()
        if self.folder and now - self._checked >= self.check_every_s:
            self._checked = now
            self._follow_files(wait=False)
        return self.value

    def reset(self) -> str:
        """The engine reset its caches: see the class doc."""
        if not (self.folder and self._follow_files(wait=True)):
            with self._lock:
                self.generation = secrets.token_hex(8)
                self.changes += 1
            log.info("%s: cache reset: keys of a new generation %s", self.who, self.generation)
        return self.value

    def _follow_files(self, wait: bool) -> bool:
        """Whether the folder's files changed since they were hashed; if so, a fresh
        generation until they are hashed again (here with ``wait``, else on a thread)."""
        assert self.folder is not None
        sig = folder_signature(self.folder)
        with self._lock:
            if sig == self._sig:
                return False
            self._sig = sig
            self.generation = "files-" + secrets.token_hex(8)
            self.changes += 1
        log.warning(
            "%s: the model folder %s changed: its weights are hashed again, and until "
            "then no stored KV is found",
            self.who,
            self.folder,
        )
        if wait:
            self._rehash(sig)
        else:
            self._hashing = threading.Thread(
                target=self._rehash, args=(sig,), name="hurray-identity", daemon=True
            )
            self._hashing.start()
        return True

    def _rehash(self, sig: tuple[Any, ...]) -> None:
        try:
            base = folder_identity(*self._args)
        except ValueError as e:  # a folder caught half-written: stay on the generation
            log.warning("%s: the model folder could not be hashed (%s)", self.who, e)
            return
        with self._lock:
            if sig == self._sig:  # no newer change meanwhile
                self.base, self.generation = base, ""
                self.changes += 1
