"""A model's identity for the layout fingerprint: its weights, in one canonical form that
every engine derives alike.

The form: every tensor of the checkpoint, in name order, each as its name, dtype, shape
and bytes, hashed with xxh3-128, prefixed by the model type: ``llama@xxh3-128:<hex>``.

- ``checkpoint_id(folder)`` reads the tensors from the folder's ``*.safetensors`` files
  (memory-mapped, through ``safetensors``). vLLM's scheduler, which holds no weights,
  and its workers use it.
- ``model_weights_id(model)`` takes a transformers model in memory. Loaded from a folder
  of safetensors, it hashes its ``state_dict`` entries that the checkpoint names, cast
  to the checkpoint's dtypes: the same identity as ``checkpoint_id`` as long as the
  weights in memory are the checkpoint's, and another as soon as one value differs (a
  fine-tune in memory). A model built in memory hashes its whole ``state_dict``.

Two checkpoints whose weights differ in any bit never share an identity, whatever their
folders or names are; the same checkpoint copied elsewhere shares it. The cost is one
pass over the weights at xxh3's speed (several times a disk's, plus reading the files:
the page cache serves the second process). The KV layout (layers, heads, head size,
dtype, page size) is in the fingerprint besides the identity.

The weights alone do not fix the KV: the same weights run with another rope theta or
scaling, another sliding window or another norm epsilon compute other KV. So the
identity an engine keys by is ``model_identity(weights, config)``: the weights' id, then
``+config@xxh3-128:<hex>``, a hash of the config fields that shape the KV
(``KV_CONFIG_FIELDS`` and the rope parameters, ``config_id``), read from the config as
the engine runs it (vLLM's ``hf_config`` after ``--hf-overrides``, a transformers
model's ``config``), so the same folder and overrides give the same value in every
engine and transformers version.

A folder without safetensors files is hashed file by file (names and bytes); a model
name that is no folder (vLLM resolving a hub id) is taken as given, with a warning.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from contextlib import ExitStack
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import xxhash
from safetensors import safe_open

log = logging.getLogger(__name__)
_CHUNK = 64 << 20  # bytes hashed per step (a device tensor is copied this much at a time)
_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


# Config fields that change the KV a model computes from the same weights (docs/format.md
# says why each is here). Fields off this list (token ids, labels, dtype, generation
# defaults, transformers' own bookkeeping) do not enter the identity; transformers
# versions name the rope fields differently, so those are normalized (``_rope``).
KV_CONFIG_FIELDS = (
    "model_type",
    # geometry (the weights' shapes say most of it; the attention's split of them not all)
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    # the layers' arithmetic
    "hidden_act",
    "hidden_activation",
    "rms_norm_eps",
    "layer_norm_eps",
    "layer_norm_epsilon",
    "norm_epsilon",
    "attention_bias",
    "mlp_bias",
    "use_qk_norm",
    "qk_layernorm",
    "clip_qkv",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "attention_multiplier",
    "embedding_multiplier",
    "residual_multiplier",
    "scale_emb",
    "scale_depth",
    # positions and the attention window
    "max_position_embeddings",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "sliding_window_pattern",
    "layer_types",
)
# Rope parameters: transformers 4 keeps ``rope_theta`` (and ``partial_rotary_factor``) at
# the top and the scaling in ``rope_scaling``; transformers 5 keeps them all in
# ``rope_parameters``. Both forms hash alike.
_ROPE_DICTS = ("rope_scaling", "rope_parameters")
_ROPE_TOP = ("rope_theta", "partial_rotary_factor")


def _canon(v: Any) -> Any:
    """A JSON-ready value whose encoding is the same for equal settings: numbers as
    floats (10000 and 10000.0 are one theta), mappings sorted by key."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, int | float):
        return float(v)
    if isinstance(v, dict):
        return {str(k): _canon(x) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))}
    if isinstance(v, list | tuple):
        return [_canon(x) for x in v]
    if hasattr(v, "to_dict"):
        return _canon(v.to_dict())
    return str(v)


def _rope(d: dict[str, Any]) -> dict[str, Any]:
    rope: dict[str, Any] = {}
    for k in _ROPE_DICTS:
        if isinstance(d.get(k), dict):
            rope.update(d[k])
    if "type" in rope:  # the older spelling of rope_type
        rope.setdefault("rope_type", rope.pop("type"))
    if rope.get("rope_type") == "default":
        del rope["rope_type"]
    out = {k: v for k, v in rope.items() if v is not None}
    for k in _ROPE_TOP:
        v = d.get(k)
        if v is None:
            continue
        if k not in out:
            out[k] = v
        elif _canon(out[k]) != _canon(v):
            # Both forms set, and they disagree (an override of one): both are kept, so
            # whichever the engine reads, the identity changed with it.
            out[f"{k} (top level)"] = v
    return out


def kv_config(config: Any) -> dict[str, Any]:
    """The KV-shaping part of a model config (a transformers config or its dict), in
    canonical form: the listed fields that are set, the rope parameters as ``rope``,
    and the same of a ``text_config`` (multimodal wrappers)."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    out = {k: _canon(d[k]) for k in KV_CONFIG_FIELDS if d.get(k) is not None}
    if rope := _rope(d):
        out["rope"] = _canon(rope)
    sub = d.get("text_config")
    if sub is not None and (isinstance(sub, dict) or hasattr(sub, "to_dict")):
        out["text_config"] = kv_config(sub)
    return out


def config_id(config: Any) -> str:
    """``config@xxh3-128:<hex>``: the hash of ``kv_config(config)`` as sorted compact JSON."""
    blob = json.dumps(kv_config(config), sort_keys=True, separators=(",", ":"))
    return f"config@xxh3-128:{xxhash.xxh3_128_hexdigest(blob.encode())}"


def model_identity(weights_id: str, config: Any) -> str:
    """The identity engines key a model's KV by: its weights and its KV-shaping config."""
    return f"{weights_id}+{config_id(config)}"


def tensors_id(model_type: str, named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The identity of these tensors, hashed in name order."""
    h = xxhash.xxh3_128()
    for name, t in sorted(named, key=lambda nt: nt[0]):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        flat = t.detach().reshape(-1)
        if flat.numel() == 0:
            continue
        raw = flat.contiguous().view(torch.uint8)
        for a in range(0, raw.numel(), _CHUNK):
            part = raw[a : a + _CHUNK]
            h.update(part.cpu().numpy().data)
    return f"{model_type or 'model'}@xxh3-128:{h.hexdigest()}"


def _model_type(folder: Path) -> str:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return "model"
    t = cfg.get("model_type") if isinstance(cfg, dict) else None
    return str(t) if t else "model"


def _safetensors_entries(folder: Path) -> dict[str, tuple[Path, torch.dtype, tuple[int, ...]]]:
    """name -> (file, dtype, shape) of every tensor of the folder's safetensors files."""
    out: dict[str, tuple[Path, torch.dtype, tuple[int, ...]]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - not a dict
                sl = st.get_slice(name)
                dt = _ST_DTYPES.get(sl.get_dtype())
                if dt is None:
                    raise ValueError(f"{f}: tensor {name} of dtype {sl.get_dtype()}")
                out[name] = (f, dt, tuple(sl.get_shape()))
    return out


def checkpoint_id(model: str) -> str:
    """The identity of the weights in folder ``model`` (see the module doc). Hashed once
    per folder, and again whenever one of its files changed (``folder_signature``):
    weights replaced in place get a new identity."""
    return _checkpoint_id(model, folder_signature(model))


def folder_signature(path: str) -> tuple[tuple[str, int, int, int], ...]:
    """The files of folder ``path`` as (name, size, modification time, inode): what
    changes when a file is written, replaced or renamed into place. One ``stat`` per
    file; empty when ``path`` is no folder."""
    try:
        files = sorted(p for p in Path(path).iterdir() if p.is_file())
        return tuple((p.name, (st := p.stat()).st_size, st.st_mtime_ns, st.st_ino) for p in files)
    except OSError:
        return ()


@lru_cache(maxsize=8)
def _checkpoint_id(model: str, signature: tuple[tuple[str, int, int, int], ...]) -> str:
    folder = Path(model)
    if not folder.is_dir():
        log.warning(
            "model %r is not a folder: its identity is its name (a new revision behind the "
            "same name would share the cache)",
            model,
        )
        return f"name:{model}"
    return _folder_id(folder, _model_type(folder))


def _folder_id(folder: Path, kind: str) -> str:
    """The tensors of the folder's safetensors files (``tensors_id``); without any, every
    file's name and bytes."""
    entries = _safetensors_entries(folder)
    if entries:
        with ExitStack() as stack:
            files = {
                f: stack.enter_context(safe_open(str(f), framework="pt"))
                for f in {f for f, _, _ in entries.values()}
            }
            tensors = ((n, files[f].get_tensor(n)) for n, (f, _, _) in entries.items())
            return tensors_id(kind, tensors)
    h = xxhash.xxh3_128()
    for f in sorted(p for p in folder.iterdir() if p.is_file()):
        h.update(f"{f.name}|".encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    return f"{kind}@xxh3-128:{h.hexdigest()}"


# path -> (the folder's files as (name, size, mtime_ns, inode), the adapter's identity)
_ADAPTERS: dict[str, tuple[tuple[tuple[str, int, int, int], ...], str]] = {}


def adapter_id(path: str) -> str | None:
    """The identity of a LoRA adapter folder (PEFT format): its tensors, as
    ``tensors_id`` hashes a checkpoint's, and its ``adapter_config.json`` (rank, alpha,
    target modules scale what the tensors add). Never its name or the engine's int id,
    which users reuse. Hashed once per path, and again only when a file of the folder
    changed (its name, size, modification time or inode: an adapter rebuilt in place
    gets a new identity); the check costs one ``stat`` per file. None: ``path`` is no
    folder (the adapter cannot be identified by its weights)."""
    folder = Path(path)
    if not folder.is_dir():
        return None
    sig = folder_signature(path)
    known = _ADAPTERS.get(path)
    if known is not None and known[0] == sig:
        return known[1]
    cfg = b""
    if (folder / "adapter_config.json").is_file():
        try:
            raw = json.loads((folder / "adapter_config.json").read_text())
            cfg = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
        except (OSError, ValueError):
            cfg = (folder / "adapter_config.json").read_bytes()
    ident = f"{_folder_id(folder, 'lora')}+adapter_config@xxh3-128:"
    ident += xxhash.xxh3_128_hexdigest(cfg)
    _ADAPTERS[path] = (sig, ident)
    return ident


def model_weights_id(model: Any) -> str:
    """The identity of a transformers model as it is in memory (see the module doc)."""
    arch = getattr(model.config, "model_type", "") or type(model).__name__
    sd = model.state_dict()
    folder = Path(str(getattr(model, "name_or_path", "") or ""))
    entries: dict[str, tuple[Path, torch.dtype, tuple[int, ...]]] = {}
    if str(folder) and folder.is_dir():
        try:
            entries = _safetensors_entries(folder)
        except (OSError, ValueError):
            entries = {}
    if entries and all(
        n in sd and tuple(sd[n].shape) == shape for n, (_, _, shape) in entries.items()
    ):
        # The checkpoint's tensors as the model holds them now, in the checkpoint's dtypes.
        return tensors_id(arch, ((n, sd[n].to(dt)) for n, (_, dt, _) in entries.items()))
    return tensors_id(arch, sd.items())
