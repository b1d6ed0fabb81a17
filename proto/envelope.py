"""A Flower Message <-> an Envelope plus content-addressed chunks, and the checks on what arrives.

Array bytes are raw (C order, little-endian as numpy stores them) and cut into CHUNK_BYTES pieces named by
their digest, so identical tensors are stored and sent once and a transfer resumes chunk by chunk.

Which digest depends on who sends (`naming`): the coordinator's messages are shared content that every site
downloads and caches, so their chunks carry a cryptographic name (BLAKE3, computed once per round); a site's
reply lands in that site's own upload namespace, where a site can only ever corrupt its own update, so a fast
checksum (XXH3-128, several times the speed of the wire) catches corruption and TLS authenticates the sender.
"""

from __future__ import annotations

import io
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import blake3
import numpy as np
import xxhash
from flwr.app import Array, ArrayRecord, Error, Message, Metadata, RecordDict
from flwr.app.message.message import make_message
from flwr.common.constant import SType
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.common.serde_utils import metadata_from_proto, metadata_to_proto
from flwr.proto.message_pb2 import Metadata as ProtoMetadata  # pylint: disable=no-name-in-module
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # pylint: disable=no-name-in-module

from hydrafl.arrays import array_view
from hydrafl.bounded import MAX_NAME_CHARS, quoted
from hydrafl.proto.coordinator_pb2 import Envelope, RecordManifest, TensorManifest
from hydrafl.tensor_files import MappedArray, as_record

CHUNK_BYTES = 1 << 20
INLINE_BYTES = CHUNK_BYTES
"""A message or reply whose chunks total at most this (one chunk's worth) carries them inline, in PullMessage's
answer or in PushReply: one call instead of two or three, which is most of a small model's round trip. Anything
larger streams, so an interrupted transfer resumes with the chunks still missing."""
MAX_DIMENSION = 1 << 40
"""No real tensor axis is longer; a larger one is a hostile manifest (even on a zero-size tensor)."""
MAX_RANK = 8
MAX_REASON_CHARS = 300
"""An error reply's reason is cut to this length (by the site that sends it and the coordinator that stores it)."""
ALLOWED_DTYPES = frozenset(
    {"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint32", "bool"}
)


class EnvelopeError(ValueError):
    """An envelope or its chunks are malformed; the message says which tensor or chunk."""


_HEX = re.compile("[0-9a-f]*")


@dataclass(frozen=True, slots=True)
class ChunkNaming:
    """How one sender names its chunks: the digest function and the length of its hex names."""

    algorithm: str
    digest: Callable[[bytes | memoryview], str]
    chars: int
    threads: int
    """Threads that name many chunks at once (the function releases the GIL); 1 where one is fast enough."""

    def is_name(self, text: str) -> bool:
        return len(text) == self.chars and _HEX.fullmatch(text) is not None

    def check(self, text: str) -> None:
        if not self.is_name(text):
            raise EnvelopeError(f"{text[:80]!r} is not a {self.algorithm} hex digest")

    def verify(self, digest: str, data: bytes | memoryview) -> None:
        """EnvelopeError unless `data` is what the name `digest` says (a chunk received, before it is stored)."""
        if self.digest(data) != digest:
            raise EnvelopeError(
                f"chunk {digest[:12]} fails its {self.algorithm} check ({len(data)} bytes received)"
            )

    def digests(self, pieces: Sequence[bytes | memoryview]) -> list[str]:
        threads = min(len(pieces), os.cpu_count() or 1, self.threads)
        if threads < 2:
            return [self.digest(piece) for piece in pieces]
        with ThreadPoolExecutor(threads, thread_name_prefix=self.algorithm) as pool:
            return list(pool.map(self.digest, pieces))


def _blake3(data: bytes | memoryview) -> str:
    return blake3.blake3(data).hexdigest()


SENT = ChunkNaming("BLAKE3", _blake3, 64, threads=8)
"""The coordinator's messages: shared content, named cryptographically, once per round."""
XXH3 = ChunkNaming("XXH3-128", xxhash.xxh3_128_hexdigest, 32, threads=1)
"""A fast checksum (about 20 GB/s here, BLAKE3 4 GB/s): it catches corruption, not forgery."""
UPLOADED = XXH3
"""A site's replies: its own namespace, named by the fast checksum."""


def naming(envelope: Envelope) -> ChunkNaming:
    """Replies are uploads (a site's namespace); every other message is the coordinator's."""
    return UPLOADED if envelope.reply_to_message_id else SENT


def chunk_views(array: Array) -> list[memoryview]:
    """An Array's values as raw C-order bytes in chunks; views into its serialised data when it is C-ordered."""
    values = array_view(array) if array.stype == SType.NUMPY else array.numpy()
    return byte_chunks(np.ascontiguousarray(values).reshape(-1).view(np.uint8).data)


def array_chunks(array: Array) -> Sequence[bytes | memoryview]:
    """An Array's chunks, by index: views of an Array in memory (`chunk_views`), or of a MappedArray each read
    from its file when asked for and held by nobody after, so sending a tensor larger than memory holds a chunk
    of it at a time (a map of the whole tensor would leave every page it touched resident)."""
    return FileChunks(array) if isinstance(array, MappedArray) else chunk_views(array)


class FileChunks(Sequence[bytes]):
    """A MappedArray's chunks, read from its file one at a time."""

    def __init__(self, array: MappedArray) -> None:
        self.array = array
        self.chunks = math.ceil(array.nbytes / CHUNK_BYTES)

    def __len__(self) -> int:
        return self.chunks

    def __getitem__(self, index: int) -> bytes:  # type: ignore[override]
        if not 0 <= index < self.chunks:
            raise IndexError(index)
        start = index * CHUNK_BYTES
        return self.array.read_bytes(start, min(CHUNK_BYTES, self.array.nbytes - start))


def byte_chunks(raw: memoryview) -> list[memoryview]:
    """`raw` cut into views of CHUNK_BYTES, in order (the last one may be shorter)."""
    return [raw[start : start + CHUNK_BYTES] for start in range(0, len(raw), CHUNK_BYTES)]


Named = dict[int, tuple[Array, list[memoryview], list[str], list[str]]]
"""id(Array) -> (the Array, kept so its id stays its own; its chunks; their names; their checksums)."""
Stored = dict[int, tuple[list[str], list[str]]]
"""id(Array) -> the names and checksums of its chunks, which the caller stored already (a model kept on disk,
stored a tensor at a time, never all mapped at once)."""


def split_message(
    message: Message,
    server_round: int = 0,
    *,
    named: Named | None = None,
    stored: Stored | None = None,
) -> tuple[Envelope, dict[str, memoryview]]:
    """The envelope (manifests, configs, metrics) and the array chunks by name (views, not copies). Arrays in
    `named` are not hashed again: a round's messages share the global model's Arrays, hashed once per round. The
    coordinator's manifests also list each chunk's XXH3 checksum, which every site checks as the chunk arrives
    (`ChunkCheck`): the cryptographic names are computed once, by the coordinator, not again by each site."""
    envelope = _envelope_without_arrays(message, server_round)
    chunks: dict[str, memoryview] = {}
    names = naming(envelope)
    if message.has_error():
        return envelope, chunks
    for key, record in message.content.array_records.items():
        manifest = RecordManifest(key=key)
        for name, array in record.items():
            if stored is not None and id(array) in stored:
                hashes, checksums = stored[id(array)]
                pieces: list[memoryview] = []
            elif named is not None and id(array) in named:
                _, pieces, hashes, checksums = named[id(array)]
            else:
                pieces = chunk_views(array)
                hashes = names.digests(pieces)
                checksums = XXH3.digests(pieces) if names is SENT else []
                if named is not None:
                    named[id(array)] = array, pieces, hashes, checksums
            if stored is None or id(array) not in stored:
                chunks.update(zip(hashes, pieces, strict=True))
            manifest.tensors.append(_tensor_manifest(name, array, hashes, checksums))
        envelope.arrays.append(manifest)
    return envelope, chunks


def reply_envelope(
    message: Message, server_round: int, names: Mapping[int, Sequence[str]]
) -> Envelope:
    """The envelope of a reply whose chunks were named as they were sent (`names`: id(Array) -> its chunks'
    names), without holding a chunk: a reply streamed from files (`array_chunks`)."""
    envelope = _envelope_without_arrays(message, server_round)
    if message.has_error():
        return envelope
    for key, record in message.content.array_records.items():
        manifest = RecordManifest(key=key)
        for name, array in record.items():
            manifest.tensors.append(_tensor_manifest(name, array, list(names[id(array)]), []))
        envelope.arrays.append(manifest)
    return envelope


def _envelope_without_arrays(message: Message, server_round: int) -> Envelope:
    """The envelope's metadata and its error or its records other than arrays."""
    metadata = message.metadata
    envelope = Envelope(
        message_id=metadata.message_id,
        reply_to_message_id=metadata.reply_to_message_id,
        message_type=metadata.message_type,
        run_id=metadata.run_id,
        round=server_round,
        metadata=metadata_to_proto(metadata).SerializeToString(),
    )
    if message.has_error():
        envelope.error_code = message.error.code
        envelope.error_reason = message.error.reason or ""
        return envelope
    rest = RecordDict(
        {
            key: record
            for key, record in message.content.items()
            if not isinstance(record, ArrayRecord)
        }
    )
    envelope.content = recorddict_to_proto(rest).SerializeToString()
    return envelope


def _tensor_manifest(
    name: str, array: Array, hashes: list[str], checksums: list[str]
) -> TensorManifest:
    return TensorManifest(
        name=name,
        dtype=array.dtype,
        shape=list(array.shape),
        chunk_digests=hashes,
        nbytes=array_nbytes(array),
        chunk_checksums=checksums,
    )


def array_nbytes(array: Array) -> int:
    """Bytes of an Array's values, read from its dtype and shape (nothing is mapped or parsed)."""
    return math.prod(array.shape) * np.dtype(array.dtype).itemsize


def chunk_hashes(envelope: Envelope) -> list[str]:
    """Every chunk the envelope refers to, in order, without repeats."""
    return list(
        dict.fromkeys(
            h for record in envelope.arrays for t in record.tensors for h in t.chunk_digests
        )
    )


def check_manifest(envelope: Envelope) -> None:
    """Reject manifests that cannot describe a real tensor, before any chunk is read or any memory reserved."""
    chunk_names = naming(envelope)
    keys = set()
    for record in envelope.arrays:
        check_name(record.key, "array record key")
        if not record.key or record.key in keys:
            raise EnvelopeError(f"array record key {record.key!r} is empty or repeated")
        keys.add(record.key)
        names = set()
        for tensor in record.tensors:
            check_name(tensor.name, f"array {record.key}: tensor name")
            where = f"array {record.key}/{tensor.name}"
            if not tensor.name or tensor.name in names:
                raise EnvelopeError(f"{where}: tensor name is empty or repeated in its record")
            names.add(tensor.name)
            if tensor.dtype not in ALLOWED_DTYPES:
                raise EnvelopeError(
                    f"{where}: dtype {quoted(tensor.dtype)} is not allowed ({', '.join(sorted(ALLOWED_DTYPES))})"
                )
            if len(tensor.shape) > MAX_RANK or any(
                not 0 <= dim <= MAX_DIMENSION for dim in tensor.shape
            ):
                raise EnvelopeError(
                    f"{where}: shape {list(tensor.shape)} is not a tensor shape (rank <= {MAX_RANK}, "
                    f"0 <= dimension <= 2^40)"
                )
            expected = math.prod(tensor.shape) * np.dtype(tensor.dtype).itemsize
            if tensor.nbytes != expected:
                raise EnvelopeError(
                    f"{where}: nbytes {tensor.nbytes} does not match shape {list(tensor.shape)} {tensor.dtype}"
                )
            if len(tensor.chunk_digests) != math.ceil(expected / CHUNK_BYTES):
                raise EnvelopeError(
                    f"{where}: {len(tensor.chunk_digests)} chunks listed for {expected} bytes"
                )
            bad = next((d for d in tensor.chunk_digests if not chunk_names.is_name(d)), None)
            if bad is not None:
                raise EnvelopeError(
                    f"{where}: {bad[:80]!r} is not a {chunk_names.algorithm} hex digest"
                )
            _check_checksums(tensor, where, chunk_names)
        ChunkCheck.of(envelope)  # a chunk listed with two checksums


def check_name(name: str, what: str) -> None:
    """EnvelopeError for a name or key longer than MAX_NAME_CHARS, before any message quotes it whole."""
    if len(name) > MAX_NAME_CHARS:
        raise EnvelopeError(
            f"{what} has {len(name)} characters; at most {MAX_NAME_CHARS}: {quoted(name)}"
        )


def _check_checksums(tensor: TensorManifest, where: str, chunk_names: ChunkNaming) -> None:
    """None (a reply, or a manifest from before checksums), or one XXH3 checksum per chunk of a coordinator's
    message."""
    if not tensor.chunk_checksums:
        return
    if chunk_names is not SENT:
        raise EnvelopeError(
            f"{where}: a reply's chunks are named by their checksum; it lists no other"
        )
    if len(tensor.chunk_checksums) != len(tensor.chunk_digests):
        raise EnvelopeError(
            f"{where}: {len(tensor.chunk_checksums)} checksums for {len(tensor.chunk_digests)} chunks"
        )
    bad = next((c for c in tensor.chunk_checksums if not XXH3.is_name(c)), None)
    if bad is not None:
        raise EnvelopeError(f"{where}: checksum {bad[:80]!r} is not an {XXH3.algorithm} hex digest")


@dataclass(frozen=True)
class ChunkCheck:
    """How a receiver checks a message's chunks: against the XXH3 checksums its manifest lists (the coordinator's
    messages; the manifest comes over the authenticated channel, and a fast checksum catches a chunk corrupted
    on the coordinator's disk or on the way, at 5x BLAKE3's speed), else against their names (a reply, or a
    manifest from before checksums)."""

    names: ChunkNaming
    checksums: Mapping[str, str]

    @classmethod
    def of(cls, envelope: Envelope) -> ChunkCheck:
        checksums: dict[str, str] = {}
        for record in envelope.arrays:
            for tensor in record.tensors:
                for digest, checksum in zip(
                    tensor.chunk_digests, tensor.chunk_checksums, strict=False
                ):  # no checksums at all: the digests name the chunks (BLAKE3)
                    if checksums.setdefault(digest, checksum) != checksum:
                        raise EnvelopeError(
                            f"chunk {digest[:12]} is listed with two different checksums"
                        )
        return cls(naming(envelope), checksums)

    def verify(self, digest: str, data: bytes | memoryview) -> None:
        """EnvelopeError unless `data` is chunk `digest` of this message."""
        checksum = self.checksums.get(digest)
        if checksum is None:
            self.names.verify(digest, data)
        elif XXH3.digest(data) != checksum:
            raise EnvelopeError(
                f"chunk {digest[:12]} fails its {XXH3.algorithm} checksum ({len(data)} bytes)"
            )

    def verify_all(self, digests: Sequence[str], chunks: Mapping[str, bytes | memoryview]) -> None:
        """Every chunk of `digests`; names alone are hashed on the naming's threads."""
        by_name = [digest for digest in digests if digest not in self.checksums]
        for digest, actual in zip(
            by_name, self.names.digests([chunks[d] for d in by_name]), strict=True
        ):
            if actual != digest:
                raise EnvelopeError(f"chunk {digest[:12]} fails its {self.names.algorithm} check")
        for digest in digests:
            if digest in self.checksums:
                self.verify(digest, chunks[digest])


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
            for index, digest in enumerate(tensor.chunk_digests):
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
        raise EnvelopeError(
            "arrays must travel through the manifest, not inside the message content"
        )
    for key, record in content.items():  # the names a reply's metrics and configs are quoted by
        check_name(key, "record key")
        for name in record:
            check_name(name, f"record {quoted(key)}: key")
    clash = set(content) & {record.key for record in envelope.arrays}
    if clash:
        raise EnvelopeError(
            f"record key {sorted(clash)[0]!r} is both in the content and the manifest"
        )
    return content


def join_message(
    envelope: Envelope,
    chunks: Mapping[str, bytes | memoryview],
    *,
    metadata: Metadata | None = None,
    verified: bool = False,
    assembled: Mapping[tuple[str, str], Array] | None = None,
) -> Message:
    """Rebuild the Flower Message; every chunk must be present and pass its `ChunkCheck`. A receiver that knows who
    sent the message and what it answers passes `metadata`, so the envelope's own metadata is never read; one
    that checked each chunk as it arrived passes `verified`, so nothing is hashed twice, and
    the tensors it already `assembled` (by record key and name) from those chunks."""
    check_manifest(envelope)
    if metadata is None:
        try:
            metadata = metadata_from_proto(ProtoMetadata.FromString(envelope.metadata))
        except Exception as error:  # protobuf raises several types for garbage bytes
            raise EnvelopeError(
                f"message metadata is not a valid Flower Metadata: {error}"
            ) from error
    if envelope.error_reason or envelope.error_code:
        return make_message(
            metadata=metadata, error=Error(int(envelope.error_code), envelope.error_reason)
        )
    content = parse_content(envelope)
    check = ChunkCheck.of(envelope)
    checked: set[str] = set()
    for record in envelope.arrays:
        arrays = {}
        for tensor in record.tensors:
            if assembled is not None and (record.key, tensor.name) in assembled:
                arrays[tensor.name] = assembled[(record.key, tensor.name)]
                continue
            where = f"array {record.key}/{tensor.name}"
            missing = [digest for digest in tensor.chunk_digests if digest not in chunks]
            if missing:
                raise EnvelopeError(f"{where}: chunk {missing[0][:12]} is missing")
            if not verified:
                unchecked = list(dict.fromkeys(d for d in tensor.chunk_digests if d not in checked))
                try:
                    check.verify_all(unchecked, chunks)
                except EnvelopeError as error:
                    raise EnvelopeError(f"{where}: {error}") from None
                checked.update(unchecked)
            if sum(len(chunks[digest]) for digest in tensor.chunk_digests) != tensor.nbytes:
                raise EnvelopeError(f"{where}: chunk sizes do not add up to {tensor.nbytes} bytes")
            arrays[tensor.name] = tensor_array(
                tensor, [chunks[digest] for digest in tensor.chunk_digests]
            )
        content[record.key] = as_record(arrays)
    return make_message(metadata=metadata, content=content)


def tensor_array(tensor: TensorManifest, pieces: list[bytes | memoryview]) -> Array:
    """The Array in Flower's serialised form (np.save's bytes: header, then the values), built with one copy of
    the chunks, where going through a numpy array would copy them twice."""
    return serialised_array(tensor, b"".join([npy_header(tensor), *pieces]))


def npy_header(tensor: TensorManifest) -> bytes:
    """The header np.save writes before the tensor's values."""
    header = io.BytesIO()
    described = {
        "descr": np.lib.format.dtype_to_descr(np.dtype(tensor.dtype)),
        "fortran_order": False,
        "shape": tuple(tensor.shape),
    }
    np.lib.format.write_array_header_1_0(header, described)
    return header.getvalue()


def serialised_array(tensor: TensorManifest, data: bytes) -> Array:
    """The Array whose serialised bytes (`npy_header`, then the values) are `data`."""
    return Array(dtype=tensor.dtype, shape=tuple(tensor.shape), stype=SType.NUMPY, data=data)
