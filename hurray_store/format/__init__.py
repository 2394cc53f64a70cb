"""The Hurray codec: per-layer block-paged objects and segment manifests.

``layout`` (the data types), ``descriptor`` (pyhurray), ``encode``, ``decode``,
``manifest`` and ``manifest_codec``, ``checksums``, ``cursor`` (one bounds-checked
reader), ``wire`` (objects on the wire).

The only package of hurray_store that imports ``hurray`` (pyhurray). Pure: bytes and
memoryviews in and out, no files, sockets or event loops.
"""

from hurray_store.format.checksums import (
    checksum,
    object_checksum,
    page_checksum,
    running_checksum,
)
from hurray_store.format.decode import decode_layer, parse_chunk, parse_layer, view_tensor
from hurray_store.format.encode import encode_layer, encode_layer_buffers, plan_layer, quantize_int8
from hurray_store.format.layout import (
    EncodedLayer,
    LayerKV,
    LayerPlan,
    Placeholder,
    supported_dtypes,
    validate_index,
)
from hurray_store.format.manifest import Manifest, ManifestLayer, ManifestSeq
from hurray_store.format.wire import blob_descriptor, parse_blob_descriptor

__all__ = [
    "EncodedLayer",
    "LayerKV",
    "LayerPlan",
    "Manifest",
    "ManifestLayer",
    "ManifestSeq",
    "blob_descriptor",
    "checksum",
    "decode_layer",
    "encode_layer",
    "encode_layer_buffers",
    "object_checksum",
    "page_checksum",
    "parse_blob_descriptor",
    "parse_chunk",
    "parse_layer",
    "plan_layer",
    "quantize_int8",
    "running_checksum",
    "Placeholder",
    "supported_dtypes",
    "validate_index",
    "view_tensor",
]
