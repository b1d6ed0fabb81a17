"""A large reply left where its upload put it: its tensors are `StoredArray`s, read from the site's upload packs
one tensor at a time when aggregation asks for them, so the coordinator never holds a model-sized reply.

What decoding checks is checked here too, before the reply is handed on: the manifest, every chunk present
and of its declared size. The values were checked finite at the edge when the site pushed them
(`replies.check_reply`), and each chunk is checked against its name again when it is read (a disk that
corrupted a chunk fails that read loudly, never the sums silently).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
from flwr.app import ArrayRecord, Message, Metadata
from flwr.app.message.message import make_message

from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.envelope import UPLOADED, EnvelopeError, check_manifest, parse_content
from hydrafl.server.transport.packs import UploadPacks
from hydrafl.tensor_files import OnDiskArray

READ_THREADS = 4
"""Chunks of a stored tensor read at once."""


class StoredArray(OnDiskArray):
    """One tensor of a stored reply: its chunks, in order, in a site's upload packs."""

    checked_finite = True

    def __init__(
        self, uploads: UploadPacks, digests: list[str], dtype: str, shape: tuple[int, ...]
    ) -> None:
        super().__init__(dtype, shape)
        self.__dict__.update(uploads=uploads, digests=digests)

    def read_into(self, out: np.ndarray) -> np.ndarray:
        """Its chunks read straight into `out` and checked there, by a few threads at once (reads and hashes
        release the GIL: the disk sees several requests in flight, as it does on upload)."""
        uploads: UploadPacks = self.__dict__["uploads"]
        digests: list[str] = self.__dict__["digests"]
        raw = out.reshape(-1).view(np.uint8)
        ends = self._ends()
        if self._nbytes() != raw.size:
            raise EnvelopeError(f"stored chunks hold {self._nbytes()} bytes, the tensor {raw.size}")
        starts = [0, *ends[:-1].tolist()]
        sizes = np.diff(ends, prepend=0).tolist()

        def fill(digest: str, start: int, size: int) -> None:
            chunk = raw[start : start + size]
            uploads.read_into(digest, chunk)
            UPLOADED.verify(digest, chunk.data)

        list(_READERS.map(fill, digests, starts, sizes))
        return out

    def read_bytes(self, start: int, count: int) -> bytes:
        """The bytes [start, start + count) of its values, read from the chunks that hold them alone (each
        checked against its name), so a window of a reply larger than memory costs a chunk or two of it."""
        uploads: UploadPacks = self.__dict__["uploads"]
        digests: list[str] = self.__dict__["digests"]
        ends = self._ends()
        if start < 0 or count < 0 or start + count > self._nbytes():
            raise EnvelopeError(f"bytes {start}..{start + count} are outside the stored tensor")
        pieces: list[bytes] = []
        first = int(np.searchsorted(ends, start, side="right"))
        for index in range(first, len(digests)):
            if pieces and int(ends[index - 1]) >= start + count:
                break
            chunk = uploads.get(digests[index])
            UPLOADED.verify(digests[index], chunk)
            begin = int(ends[index - 1]) if index else 0
            pieces.append(chunk[max(start - begin, 0) : start + count - begin])
        return b"".join(pieces)

    def _ends(self) -> np.ndarray:
        """Where each chunk ends in the values, looked up once."""
        if "ends" not in self.__dict__:
            uploads: UploadPacks = self.__dict__["uploads"]
            sizes = [uploads.size(digest) for digest in self.__dict__["digests"]]
            self.__dict__["ends"] = np.cumsum(sizes, dtype=np.int64)
        return self.__dict__["ends"]

    def _nbytes(self) -> int:
        ends = self._ends()
        return int(ends[-1]) if len(ends) else 0


_READERS = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="stored-reply-reader")


def stored_message(envelope: pb.Envelope, uploads: UploadPacks, metadata: Metadata) -> Message:
    """The reply `envelope` describes, its arrays left in `uploads`. Raises EnvelopeError (or KeyError for a
    chunk gone from disk) when a decode would."""
    check_manifest(envelope)
    content = parse_content(envelope)
    for record in envelope.arrays:
        arrays = (
            ArrayRecord()
        )  # filled item by item: ArrayRecord(dict) would copy each into a plain Array
        for tensor in record.tensors:
            digests = list(tensor.chunk_digests)
            if sum(uploads.size(digest) for digest in digests) != tensor.nbytes:
                raise EnvelopeError(
                    f"array {record.key}/{tensor.name}: stored chunks do not add up to {tensor.nbytes} bytes"
                )
            arrays[tensor.name] = StoredArray(
                uploads, digests, tensor.dtype, tuple(int(n) for n in tensor.shape)
            )
        content[record.key] = arrays
    return make_message(metadata=metadata, content=content)
