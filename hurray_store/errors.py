"""The one exception tree of hurray_store.

Every class also inherits the builtin that callers already catch, so
``except ValueError`` still works around a malformed object. Messages say what was
expected, what came, and, where it helps, what to do.
"""

from __future__ import annotations


class HurrayStoreError(Exception):
    """Root of every error hurray_store raises on purpose."""


# --- format (layer objects and manifests) --------------------------------------------


class FormatError(HurrayStoreError, ValueError):
    """Bytes that are not a valid hurray_store object. A reader raises only this."""


class TruncatedError(FormatError):
    """The input ends before what its headers declare."""


class DescriptorError(FormatError):
    """A Hurray descriptor that the reference decoder rejects (magic, version, fields)."""


class VersionError(FormatError):
    """A format version newer than this reader understands."""


class TensorCountError(FormatError):
    """An object is exactly two tensors (key, value); this one has fewer or more."""


class LayoutError(FormatError):
    """A descriptor whose layout is not block-paged."""


class RankError(FormatError):
    """Block-paged tensors are rank 3 ([total_tokens, heads, head_dim])."""


class DtypeError(FormatError):
    """An element type this store does not hold (fp16, bf16, fp32, or int8 quantized)."""


class RoleError(FormatError):
    """Roles must be key (first) then value (second)."""


class LayerMismatchError(FormatError):
    """Key and value descriptors name different layers."""


class PagingMismatchError(FormatError):
    """Key and value disagree on paging fields, shapes or index buffers."""


class ShardError(FormatError):
    """Block-paged descriptors must not carry a shard (spec, Sharding)."""


class PagedAxisError(FormatError):
    """paged_axis must be 0 in this version of the layout."""


class BufferSizeError(FormatError):
    """A declared buffer size disagrees with the descriptor's fields."""


class SeqPtrError(FormatError):
    """seq_ptr breaks an invariant: starts at 0, non-decreasing, ends at len(block_table)."""


class PageIdError(FormatError):
    """A block-table entry outside [0, num_pages)."""


class QuantizationError(FormatError):
    """A quantization that breaks the block-paged rules."""


class UnsupportedQuantizationError(FormatError):
    """A quantization the spec allows but this reader cannot dequantize."""


class ManifestError(FormatError):
    """A segment manifest that is malformed."""


class ChecksumError(FormatError):
    """Bytes whose checksum does not match the one recorded for them."""


# --- engine-side contracts ------------------------------------------------------------


class SpecError(HurrayStoreError, ValueError):
    """An invalid KVSpec (non-positive size, unsupported dtype)."""


class PagingError(HurrayStoreError, ValueError):
    """A block table or sequence length that the pool cannot honour."""


class PoolExhaustedError(HurrayStoreError, MemoryError):
    """The paged pool has fewer free pages than asked for; nothing was allocated."""


# --- configuration and store -----------------------------------------------------------


class ConfigError(HurrayStoreError, ValueError):
    """A config file or dict that does not match the schema; the message names the
    dotted key (``tiers.disk.capacity_bytes``) and what was expected."""


# --- network transport ------------------------------------------------------------------


class ProtocolError(HurrayStoreError, ValueError):
    """A message that breaks the Hurray network transport (or our extensions to it).
    ``code`` is the ERROR code to answer with; ``fatal`` says the connection must close
    (the byte stream can no longer be trusted), not just the stream."""

    def __init__(self, code: int, message: str, *, fatal: bool = True) -> None:
        super().__init__(message)
        self.code = code
        self.fatal = fatal


class RemoteError(HurrayStoreError, RuntimeError):
    """The peer answered ERROR. ``code`` is its error code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{message} (error 0x{code:02x})")
        self.code = code
