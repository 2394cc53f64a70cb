"""The Hurray codec: per-layer block-paged objects and segment manifests.

The only package of hurray_store that imports ``hurray`` (pyhurray). Pure: bytes and
memoryviews in and out, no files, sockets or event loops.
"""

from hurray_store.format.codec import (
    EncodedLayer,
    LayerKV,
    LayerPlan,
    Slot,
    decode_layer,
    encode_layer,
    encode_layer_buffers,
    parse_layer,
    plan_layer,
    quantize_int8,
    supported_dtypes,
)
from hurray_store.format.manifest import (
    Manifest,
    ManifestLayer,
    ManifestSeq,
    checksum,
    object_checksum,
    page_checksum,
)
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
    "parse_layer",
    "plan_layer",
    "quantize_int8",
    "Slot",
    "supported_dtypes",
]
