"""A Flower Message <-> an Envelope plus content-addressed chunks, and the checks on what arrives.

Array bytes are raw (C order, little-endian as numpy stores them) and cut into CHUNK_BYTES pieces named by
their SHA-256, so identical tensors are stored and sent once and a transfer resumes chunk by chunk.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from flwr.app import Array, ArrayRecord, Error, Message, RecordDict
from flwr.common.constant import SType
from flwr.app.message.message import make_message
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.common.serde_utils import metadata_from_proto, metadata_to_proto
from flwr.proto.message_pb2 import Metadata as ProtoMetadata  # pylint: disable=no-name-in-module
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # pylint: disable=no-name-in-module

from hydrafl.arrays import array_view
from hydrafl.proto.coordinator_pb2 import Envelope, RecordManifest, TensorManifest

CHUNK_BYTES = 1 << 20
ALLOWED_DTYPES = frozenset({"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"})


class EnvelopeError(ValueError):
    """An envelope or its chunks are malformed; the message says which tensor or chunk."""


def sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_all(pieces: Sequence[bytes | memoryview]) -> list[str]:
    """Digests of many chunks, on several threads (hashlib releases the GIL for large inputs)."""
    if len(pieces) < 2:
        return [sha256(piece) for piece in pieces]
    with ThreadPoolExecutor(min(len(pieces), os.cpu_count() or 1, 8), thread_name_prefix="sha256") as pool:
        return list(pool.map(sha256, pieces))


def _raw_bytes(array: Array) -> memoryview:
    """An Array's values as raw C-order bytes; a view into its serialised data when it is already C-ordered."""
    values = array_view(array) if array.stype == SType.NUMPY else array.numpy()
    return memoryview(np.ascontiguousarray(values).reshape(-1).view(np.uint8))


def split_message(message: Message, server_round: int = 0) -> tuple[Envelope, dict[str, memoryview]]:
    """The envelope (manifests, configs, metrics) and the array chunks by hash (views, not copies)."""
    metadata = message.metadata
    envelope = Envelope(
        message_id=metadata.message_id,
        reply_to_message_id=metadata.reply_to_message_id,
        message_type=metadata.message_type,
        run_id=metadata.run_id,
        round=server_round,
        metadata=metadata_to_proto(metadata).SerializeToString(),
    )
    chunks: dict[str, memoryview] = {}
    if message.has_error():
        envelope.error_code = message.error.code
        envelope.error_reason = message.error.reason
        return envelope, chunks
    rest = RecordDict({key: record for key, record in message.content.items() if not isinstance(record, ArrayRecord)})
    envelope.content = recorddict_to_proto(rest).SerializeToString()
    for key, record in message.content.array_records.items():
        manifest = RecordManifest(key=key)
        for name, array in record.items():
            raw = _raw_bytes(array)
            pieces = [raw[start : start + CHUNK_BYTES] for start in range(0, len(raw), CHUNK_BYTES)]
            hashes = sha256_all(pieces)
            chunks.update(zip(hashes, pieces))
            manifest.tensors.append(
                TensorManifest(name=name, dtype=array.dtype, shape=list(array.shape), chunk_sha256=hashes, nbytes=len(raw))
            )
        envelope.arrays.append(manifest)
    return envelope, chunks


def chunk_hashes(envelope: Envelope) -> list[str]:
    """Every chunk the envelope refers to, in order, without repeats."""
    return list(dict.fromkeys(h for record in envelope.arrays for t in record.tensors for h in t.chunk_sha256))


def check_manifest(envelope: Envelope) -> None:
    """Reject manifests that cannot describe a real tensor, before any chunk is read."""
    for record in envelope.arrays:
        for tensor in record.tensors:
            where = f"array {record.key}/{tensor.name}"
            if tensor.dtype not in ALLOWED_DTYPES:
                raise EnvelopeError(f"{where}: dtype {tensor.dtype!r} is not allowed ({', '.join(sorted(ALLOWED_DTYPES))})")
            if any(dim < 0 for dim in tensor.shape):
                raise EnvelopeError(f"{where}: negative dimension in shape {list(tensor.shape)}")
            expected = math.prod(tensor.shape) * np.dtype(tensor.dtype).itemsize
            if tensor.nbytes != expected:
                raise EnvelopeError(f"{where}: nbytes {tensor.nbytes} does not match shape {list(tensor.shape)} {tensor.dtype}")
            if len(tensor.chunk_sha256) != math.ceil(expected / CHUNK_BYTES):
                raise EnvelopeError(f"{where}: {len(tensor.chunk_sha256)} chunks listed for {expected} bytes")


def parse_content(envelope: Envelope) -> RecordDict:
    """The envelope's non-array records (configs, metrics); garbage bytes are an EnvelopeError."""
    try:
        return recorddict_from_proto(ProtoRecordDict.FromString(envelope.content))
    except Exception as error:  # protobuf raises several types for garbage bytes
        raise EnvelopeError(f"message content is not a valid Flower RecordDict: {error}") from error


def join_message(envelope: Envelope, chunks: Mapping[str, bytes | memoryview]) -> Message:
    """Rebuild the Flower Message; every chunk must be present and match its hash."""
    check_manifest(envelope)
    metadata = metadata_from_proto(ProtoMetadata.FromString(envelope.metadata))
    if envelope.error_reason or envelope.error_code:
        return make_message(metadata=metadata, error=Error(int(envelope.error_code), envelope.error_reason))
    content = parse_content(envelope)
    for record in envelope.arrays:
        arrays = {}
        for tensor in record.tensors:
            missing = [digest for digest in tensor.chunk_sha256 if digest not in chunks]
            if missing:
                raise EnvelopeError(f"array {record.key}/{tensor.name}: chunk {missing[0][:12]} is missing")
            pieces = [chunks[digest] for digest in tensor.chunk_sha256]
            for digest, actual in zip(tensor.chunk_sha256, sha256_all(pieces), strict=True):
                if actual != digest:
                    raise EnvelopeError(f"array {record.key}/{tensor.name}: chunk {digest[:12]} fails its SHA-256 check")
            raw = b"".join(pieces)
            if len(raw) != tensor.nbytes:
                raise EnvelopeError(f"array {record.key}/{tensor.name}: {len(raw)} bytes, manifest says {tensor.nbytes}")
            values = np.frombuffer(raw, dtype=tensor.dtype).reshape(tuple(tensor.shape))
            arrays[tensor.name] = Array(values)
        content[record.key] = ArrayRecord(arrays)
    return make_message(metadata=metadata, content=content)
