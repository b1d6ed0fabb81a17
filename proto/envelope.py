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
from flwr.app import Array, ArrayRecord, Error, Message, Metadata, RecordDict
from flwr.common.constant import SType
from flwr.app.message.message import make_message
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.common.serde_utils import metadata_from_proto, metadata_to_proto
from flwr.proto.message_pb2 import Metadata as ProtoMetadata  # pylint: disable=no-name-in-module
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # pylint: disable=no-name-in-module

from hydrafl.arrays import array_view
from hydrafl.proto.coordinator_pb2 import Envelope, RecordManifest, TensorManifest

CHUNK_BYTES = 1 << 20
MAX_DIMENSION = 1 << 40
"""No real tensor axis is longer; a larger one is a hostile manifest (even on a zero-size tensor)."""
MAX_RANK = 8
MAX_REASON_CHARS = 300
"""An error reply's reason is cut to this length (by the site that sends it and the coordinator that stores it)."""
ALLOWED_DTYPES = frozenset({"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint32", "bool"})


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
    """Reject manifests that cannot describe a real tensor, before any chunk is read or any memory reserved."""
    keys = set()
    for record in envelope.arrays:
        if not record.key or record.key in keys:
            raise EnvelopeError(f"array record key {record.key!r} is empty or repeated")
        keys.add(record.key)
        names = set()
        for tensor in record.tensors:
            where = f"array {record.key}/{tensor.name}"
            if not tensor.name or tensor.name in names:
                raise EnvelopeError(f"{where}: tensor name is empty or repeated in its record")
            names.add(tensor.name)
            if tensor.dtype not in ALLOWED_DTYPES:
                raise EnvelopeError(f"{where}: dtype {tensor.dtype!r} is not allowed ({', '.join(sorted(ALLOWED_DTYPES))})")
            if len(tensor.shape) > MAX_RANK or any(not 0 <= dim <= MAX_DIMENSION for dim in tensor.shape):
                raise EnvelopeError(f"{where}: shape {list(tensor.shape)} is not a tensor shape (rank <= {MAX_RANK}, "
                                    f"0 <= dimension <= 2^40)")
            expected = math.prod(tensor.shape) * np.dtype(tensor.dtype).itemsize
            if tensor.nbytes != expected:
                raise EnvelopeError(f"{where}: nbytes {tensor.nbytes} does not match shape {list(tensor.shape)} {tensor.dtype}")
            if len(tensor.chunk_sha256) != math.ceil(expected / CHUNK_BYTES):
                raise EnvelopeError(f"{where}: {len(tensor.chunk_sha256)} chunks listed for {expected} bytes")
            bad = next((d for d in tensor.chunk_sha256 if not is_digest(d)), None)
            if bad is not None:
                raise EnvelopeError(f"{where}: {bad[:80]!r} is not a SHA-256 hex digest")


def is_digest(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def declared_nbytes(envelope: Envelope) -> int:
    """Bytes of every array the manifest declares (repeated chunks counted each time they are listed)."""
    return sum(tensor.nbytes for record in envelope.arrays for tensor in record.tensors)


def chunk_sizes(envelope: Envelope) -> dict[str, int]:
    """Each listed chunk (in order, once) and the size it must have: CHUNK_BYTES, or the rest of its tensor for
    a tensor's last chunk. Whoever receives chunks holds each to this size, so what moves never exceeds what the
    manifest declares."""
    sizes: dict[str, int] = {}
    for record in envelope.arrays:
        for tensor in record.tensors:
            for index, digest in enumerate(tensor.chunk_sha256):
                size = min(CHUNK_BYTES, tensor.nbytes - index * CHUNK_BYTES)
                if sizes.setdefault(digest, size) != size:
                    raise EnvelopeError(f"chunk {digest[:12]} is listed with two different sizes")
    return sizes


def parse_content(envelope: Envelope) -> RecordDict:
    """The envelope's non-array records (configs, metrics); garbage bytes are an EnvelopeError."""
    try:
        content = recorddict_from_proto(ProtoRecordDict.FromString(envelope.content))
    except Exception as error:  # protobuf raises several types for garbage bytes
        raise EnvelopeError(f"message content is not a valid Flower RecordDict: {error}") from error
    # an Array's declared shape is not checked against its bytes: only manifests count. Read from values(), not
    # the `array_records` view, whose reference cycle would keep the arrays joined in later alive after use.
    if any(isinstance(record, ArrayRecord) for record in content.values()):
        raise EnvelopeError("arrays must travel through the manifest, not inside the message content")
    clash = set(content) & {record.key for record in envelope.arrays}
    if clash:
        raise EnvelopeError(f"record key {sorted(clash)[0]!r} is both in the content and the manifest")
    return content


def join_message(
    envelope: Envelope, chunks: Mapping[str, bytes | memoryview], *, metadata: Metadata | None = None
) -> Message:
    """Rebuild the Flower Message; every chunk must be present and match its hash. A receiver that knows who
    sent the message and what it answers passes `metadata`, so the envelope's own metadata is never read."""
    check_manifest(envelope)
    if metadata is None:
        try:
            metadata = metadata_from_proto(ProtoMetadata.FromString(envelope.metadata))
        except Exception as error:  # protobuf raises several types for garbage bytes
            raise EnvelopeError(f"message metadata is not a valid Flower Metadata: {error}") from error
    if envelope.error_reason or envelope.error_code:
        return make_message(metadata=metadata, error=Error(int(envelope.error_code), envelope.error_reason))
    content = parse_content(envelope)
    verified: set[str] = set()
    for record in envelope.arrays:
        arrays = {}
        for tensor in record.tensors:
            missing = [digest for digest in tensor.chunk_sha256 if digest not in chunks]
            if missing:
                raise EnvelopeError(f"array {record.key}/{tensor.name}: chunk {missing[0][:12]} is missing")
            unverified = list(dict.fromkeys(d for d in tensor.chunk_sha256 if d not in verified))
            for digest, actual in zip(unverified, sha256_all([chunks[d] for d in unverified]), strict=True):
                if actual != digest:
                    raise EnvelopeError(f"array {record.key}/{tensor.name}: chunk {digest[:12]} fails its SHA-256 check")
            verified.update(unverified)
            if sum(len(chunks[digest]) for digest in tensor.chunk_sha256) != tensor.nbytes:
                raise EnvelopeError(f"array {record.key}/{tensor.name}: chunk sizes do not add up to {tensor.nbytes} bytes")
            raw = b"".join(chunks[digest] for digest in tensor.chunk_sha256)
            values = np.frombuffer(raw, dtype=tensor.dtype).reshape(tuple(tensor.shape))
            arrays[tensor.name] = Array(values)
        content[record.key] = ArrayRecord(arrays)
    return make_message(metadata=metadata, content=content)
