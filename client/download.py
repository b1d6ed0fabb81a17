"""A message's tensors filled in place as their chunks arrive.

A site receives the coordinator's model as a stream of 1 MiB chunks. Each chunk is checked against its XXH3
checksum from the manifest (`ChunkCheck`) and copied straight into its tensor's final bytes (Flower's serialised
Array: the npy header, then the values) the moment it arrives, while it is still in the CPU's cache; gRPC's
buffer is then let go, and the next chunk reuses that memory. Holding a tensor's chunks until the last one came
and joining them afterwards read every byte back from main memory and kept gRPC's buffers fresh: 0.68 s per GiB
against 0.50 s filled in place, with the raw gRPC stream at 0.56 s (same run, `benchmarks/wire.py`).

A download holds one model: the tensors' bytes are allocated once, when the manifest is known to fit
(`SiteAgent._receive`), and never written twice. A chunk that fails its check is not copied, and refuses the
message at once, which ends the stream. What a dropped connection interrupts resumes from `Received`: the
tensors being filled, each with the chunks it still lacks.

A message larger than the site's exchange memory (`--exchange-memory-mb`) is not held at all: `FileAssembly`
pwrites each checked chunk at its place in a safetensors file of the site's exchange folder (its layout from the
manifest), and the ClientApp gets MappedArrays over that file, whose values it reads a tensor (or a block) at a
time. The file outlives a dropped connection like the tensors in memory do, and goes when the message is done.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from flwr.app import Array, Message

from hydrafl.client.upload import reply_arrays
from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.chunk_wire import ChunkView
from hydrafl.proto.coordinator_pb2 import TensorManifest
from hydrafl.proto.envelope import (
    CHUNK_BYTES,
    ChunkCheck,
    EnvelopeError,
    npy_header,
    serialised_array,
)
from hydrafl.tensor_files import MappedArray, TensorFileWriter

Content = tuple[str, tuple[int, ...], tuple[str, ...]]
"""A tensor's content: dtype, shape and chunk names."""

_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.argtypes, _new_bytes.restype = (ctypes.c_char_p, ctypes.c_ssize_t), ctypes.py_object
_bytes_buffer = ctypes.pythonapi.PyBytes_AsString
_bytes_buffer.argtypes, _bytes_buffer.restype = (ctypes.py_object,), ctypes.c_void_p


def unfilled_bytes(size: int) -> tuple[bytes, memoryview]:
    """A new `bytes` of `size` bytes, not yet written, and a writable view of them. Flower's Array takes only
    `bytes`, which Python cannot fill after creation; its C API can: "PyBytes_FromStringAndSize(NULL, size)" makes
    one uninitialised, and PyBytes_AsString's buffer "must not be modified in any way, unless the object was just
    created using PyBytes_FromStringAndSize(NULL, size)". So fill the view before anyone else sees the bytes, and
    drop it then."""
    data = _new_bytes(None, size)
    buffer = (ctypes.c_char * size).from_address(_bytes_buffer(data))
    buffer.owner = data  # type: ignore[attr-defined]  # the view keeps the bytes it writes into alive, however long it is kept
    return data, memoryview(buffer).cast("B")


@dataclass
class Filling:
    """One tensor's serialised bytes, and where each chunk it still lacks goes in them."""

    tensor: TensorManifest
    data: bytes
    view: memoryview
    offsets: dict[str, list[int]]
    """Chunk -> the offsets it is still to be copied to (a chunk repeated in a tensor, e.g. zeros, has several)."""

    @classmethod
    def of(cls, tensor: TensorManifest) -> Filling:
        header = npy_header(tensor)
        data, view = unfilled_bytes(len(header) + tensor.nbytes)
        view[: len(header)] = header
        offsets: dict[str, list[int]] = {}
        for index, digest in enumerate(tensor.chunk_digests):
            offsets.setdefault(digest, []).append(len(header) + index * CHUNK_BYTES)
        return cls(tensor, data, view, offsets)

    def fill(self, digest: str, data: bytes | memoryview) -> None:
        for offset in self.offsets.pop(digest, ()):
            self.view[offset : offset + len(data)] = data
        if not self.offsets:
            self.view.release()  # filled: from here on the bytes are only read

    def array(self) -> Array:
        if self.offsets:
            raise EnvelopeError(
                f"array {self.tensor.name}: chunk {next(iter(self.offsets))[:12]} is missing"
            )
        return serialised_array(self.tensor, self.data)


class DownloadFile:
    """A message's tensors in a safetensors file (named `record index:tensor name`), and where each chunk it
    still lacks goes in it. Every tensor has its own place (a chunk repeated in the message is written to each)."""

    def __init__(self, path: Path, envelope: pb.Envelope) -> None:
        self.layout = _file_layout(envelope)
        self.writer = TensorFileWriter(
            path, {name: (dtype, shape) for name, (dtype, shape, _) in self.layout.items()}
        )
        self.places: dict[str, list[tuple[str, int]]] = {}
        """Chunk -> the (tensor, byte offset in its values) it is still to be written to."""
        for name, (_, _, digests) in self.layout.items():
            for index, digest in enumerate(digests):
                self.places.setdefault(digest, []).append((name, index * CHUNK_BYTES))
        self._mapped: dict[str, MappedArray] | None = None

    def fill(self, digest: str, data: bytes | memoryview) -> None:
        for name, start in self.places.pop(digest, ()):
            self.writer.write_at(name, start, data)

    def mapped(self) -> dict[str, MappedArray]:
        """Every chunk written: the tensors, mapped (the file is read back by this process, then removed, so it
        is not made durable)."""
        if self.places:
            raise EnvelopeError(f"chunk {next(iter(self.places))[:12]} is missing")
        if self._mapped is None:
            self._mapped = self.writer.close(durable=False)
        return self._mapped

    def remove(self) -> None:
        self.writer.discard()


@dataclass
class Received:
    """The tensors of the message in hand, as far as they are filled, kept across a dropped connection: in
    memory, or in the message's download file."""

    tensors: dict[Content, Filling] = field(default_factory=dict)
    file: DownloadFile | None = None

    def keep_for(self, envelope: pb.Envelope) -> None:
        """Keep only what this message (the same one again, after a reconnect) can use."""
        contents = {_content(tensor) for record in envelope.arrays for tensor in record.tensors}
        self.tensors = {
            content: filling for content, filling in self.tensors.items() if content in contents
        }
        if self.file is not None and self.file.layout != _file_layout(envelope):
            self.remove_file()

    def handed_over(self) -> None:
        """The message is built: its Arrays own the bytes filled in memory; a download file stays until the
        message is done (`clear`), since its MappedArrays read it."""
        self.tensors.clear()

    def clear(self) -> None:
        self.tensors.clear()
        self.remove_file()

    def release_unless_used(self, reply: Message) -> None:
        """Remove the download file once the app has answered, before the upload, unless `reply` reads from it (an
        array passed through): a site of a model larger than memory then holds its reply's file alone, not both."""
        if self.file is None:
            return
        path = str(self.file.writer.path)
        if not any(
            isinstance(array, MappedArray) and array.path == path for array in reply_arrays(reply)
        ):
            self.remove_file()

    def remove_file(self) -> None:
        # forgotten first: once the file is gone, nothing refers to it
        file, self.file = self.file, None
        if file is not None:
            file.remove()


class Assembly:
    """The message in hand, filled into `received`: `add` takes each new chunk. Every tensor's bytes are
    allocated here, so build one only once the manifest's size is accepted."""

    def __init__(self, envelope: pb.Envelope, received: Received) -> None:
        self._check = ChunkCheck.of(envelope)
        self._tensors = [
            (record.key, tensor) for record in envelope.arrays for tensor in record.tensors
        ]
        for _, tensor in self._tensors:
            if _content(tensor) not in received.tensors:
                received.tensors[_content(tensor)] = Filling.of(tensor)
        self._fillings = [received.tensors[_content(tensor)] for _, tensor in self._tensors]
        self._waiting: dict[str, list[Filling]] = {}
        """Chunk -> the tensors still waiting for it (each tensor once, whatever its repeats)."""
        for filling in _unique(self._fillings):
            for digest in filling.offsets:
                self._waiting.setdefault(digest, []).append(filling)

    def missing(self) -> list[str]:
        """The chunks still to come, in the manifest's order."""
        return list(self._waiting)

    def add(self, digest: str, data: bytes | memoryview) -> None:
        """One chunk received (its name and size already checked against the manifest): checked, then copied
        into every tensor waiting for it; EnvelopeError, and nothing copied, when it fails its check."""
        self._check.verify(digest, data)
        for filling in self._waiting.pop(digest, ()):
            filling.fill(digest, data)

    def arrays(self) -> dict[tuple[str, str], Array]:
        """Every tensor's Array by (record key, tensor name); EnvelopeError names a chunk still missing."""
        return {
            (key, tensor.name): filling.array()
            for (key, tensor), filling in zip(self._tensors, self._fillings, strict=True)
        }


class FileAssembly:
    """The message in hand, written into its download file (`folder`/download-ID.safetensors): what `Assembly`
    does, with the site's memory holding a chunk at a time whatever the message's size."""

    def __init__(self, envelope: pb.Envelope, received: Received, folder: Path) -> None:
        self._check = ChunkCheck.of(envelope)
        if received.file is None:
            received.file = DownloadFile(
                folder / f"download-{_file_safe(envelope.message_id)}.safetensors", envelope
            )
        self._file = received.file
        self._names = _file_names(envelope)

    def missing(self) -> list[str]:
        return list(self._file.places)

    def add(self, digest: str, data: bytes | memoryview) -> None:
        self._check.verify(digest, data)
        self._file.fill(digest, data)

    def arrays(self) -> dict[tuple[str, str], Array]:
        """Every tensor as a MappedArray over the file; EnvelopeError names a chunk still missing."""
        mapped = self._file.mapped()
        return {key: mapped[name] for key, name in self._names.items()}


class Assembling(Protocol):
    """An `Assembly` or a `FileAssembly`: what a download fills."""

    def missing(self) -> list[str]: ...

    def add(self, digest: str, data: bytes | memoryview) -> None: ...

    def arrays(self) -> dict[tuple[str, str], Array]: ...


def _file_names(envelope: pb.Envelope) -> dict[tuple[str, str], str]:
    """(record key, tensor name) -> the tensor's name in the download file: `record index:tensor name`, unique
    whatever characters the keys hold."""
    return {
        (record.key, tensor.name): f"{index}:{tensor.name}"
        for index, record in enumerate(envelope.arrays)
        for tensor in record.tensors
    }


def _file_layout(envelope: pb.Envelope) -> dict[str, Content]:
    """A message's tensors in its download file, by their name there, with their content."""
    names = _file_names(envelope)
    return {
        names[(record.key, tensor.name)]: _content(tensor)
        for record in envelope.arrays
        for tensor in record.tensors
    }


def _file_safe(message_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in message_id)[:80]


def _unique(fillings: list[Filling]) -> list[Filling]:
    return list({id(filling): filling for filling in fillings}.values())


def _content(tensor: TensorManifest) -> Content:
    return tensor.dtype, tuple(tensor.shape), tuple(tensor.chunk_digests)


class MessageRefused(Exception):
    """The site will not handle this message (too large, chunks it did not ask for, a garbage run config). The
    text describes only the coordinator's message and this site's own limits, so it is sent back as the reason."""


def take_chunks(
    chunks: Iterable[ChunkView | pb.Chunk], pending: dict[str, int], assembly: Assembling
) -> None:
    """Each chunk into the assembly once checked against `pending` (digest -> size), which it leaves."""
    for chunk in chunks:
        check_chunk(chunk, pending)
        del pending[chunk.digest]
        assembly.add(chunk.digest, chunk.data)


def check_chunk(chunk: ChunkView | pb.Chunk, pending: dict[str, int]) -> None:
    if chunk.digest not in pending:
        raise MessageRefused(
            f"the coordinator sent chunk {chunk.digest[:12]!r}, which this site did not ask for "
            "or already received"
        )
    if len(chunk.data) != pending[chunk.digest]:
        raise MessageRefused(
            f"chunk {chunk.digest[:12]} has {len(chunk.data)} bytes; its manifest makes it {pending[chunk.digest]}"
        )
