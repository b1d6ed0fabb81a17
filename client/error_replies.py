"""A reply to a message the site could not answer: what it says about a local failure (its type and a fixed
sentence, "disk full" for lack of space; never the local data or paths that caused it, which go to the site's
own log), and what it needs of the message even when the message's metadata are garbage."""

from __future__ import annotations

import errno
import tempfile
import time
from typing import Any

from flwr.app import Error, Message, MessageType, Metadata, RecordDict
from flwr.app.message.message import make_message
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.common.serde_utils import metadata_from_proto
from flwr.proto.message_pb2 import Metadata as ProtoMetadata  # pylint: disable=no-name-in-module

from hydrafl.data import DataError
from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.envelope import MAX_REASON_CHARS, EnvelopeError, declared_nbytes

DEFAULT_TTL_S = 3600.0
FIXED_REASONS: tuple[tuple[type[BaseException], str], ...] = (
    (DataError, "this site's data does not fit this run; see the site's log"),
    (MemoryError, "this site ran out of memory handling the message; see the site's log"),
    (
        PermissionError,
        "the run names a local checkpoint this site does not allow (--model-dir); see the site's log",
    ),
)
"""What an error reply says about a local failure: the message of a local exception may name files, columns
or values of the site's data, so only its type and a fixed sentence leave the site."""
GENERIC_REASON = "this site failed to handle the message; see the site's log"
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})
"""A write refused for lack of space: no space left, the process's file-size limit, a disk quota."""
DISK_FULL_REASON = "this site could not write its temporary files; see the site's log"
MAX_DISK_PROBE_BYTES = 64 << 20


def local_reason(error: BaseException) -> str:
    """The reason a local failure gives the coordinator: the exception's type and a fixed sentence."""
    sentence = next(
        (text for kind, text in FIXED_REASONS if isinstance(error, kind)), GENERIC_REASON
    )
    return f"{type(error).__name__}: {sentence}"


def disk_full(error: BaseException, probe_bytes: int) -> tuple[str, str] | None:
    """(errno name, what could not be written) when a failure looks like a full disk, else None. The one
    thing a site writes is its training processes' temporary files (nproc > 1), whose own errors reach here
    only as a failed child process: so an OSError of a full disk in the exception chain, else a probe write
    of `probe_bytes` (the message's size, about what training saves) to the temporary directory, refused
    the same way. The path goes to the site's log only."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in DISK_FULL_ERRNOS:
            return errno.errorcode[
                seen.errno
            ], f"{seen.strerror} writing {seen.filename or 'a file'}"
        seen = seen.__cause__ or seen.__context__
    directory = tempfile.gettempdir()
    try:
        with tempfile.TemporaryFile(dir=directory) as probe:
            probe.write(b"\0" * probe_bytes)
            probe.flush()
    except OSError as probe_error:
        if probe_error.errno in DISK_FULL_ERRNOS:
            return errno.errorcode[
                probe_error.errno
            ], f"{probe_error.strerror}: cannot write {size_text(probe_bytes)} to {directory}"
    return None


def probe_bytes(envelope: pb.Envelope) -> int:
    """What a disk probe writes after a failure: the message's arrays (what training saves), within bounds."""
    try:
        return min(max(declared_nbytes(envelope), 1), MAX_DISK_PROBE_BYTES)
    except EnvelopeError:
        return 1


def request_of(envelope: pb.Envelope, node_id: int) -> Message:
    """What a reply needs of the message (ids, run, type): its metadata or, when those bytes are garbage, the
    envelope's own fields, so even a malformed message gets its error reply. A type Flower refuses becomes a
    query: the coordinator takes a reply's type from the message it stored, never from the reply."""
    try:
        return make_message(
            metadata=metadata_from_proto(ProtoMetadata.FromString(envelope.metadata)),
            content=RecordDict(),
        )
    except (
        Exception
    ):  # protobuf and Flower raise several types for garbage bytes and invalid fields
        pass
    fields: dict[str, Any] = {
        "run_id": envelope.run_id,
        "message_id": envelope.message_id,
        "src_node_id": SUPERLINK_NODE_ID,
        "dst_node_id": node_id,
        "reply_to_message_id": "",
        "group_id": str(envelope.round),
        "created_at": time.time(),
        "ttl": DEFAULT_TTL_S,
    }
    try:
        metadata = Metadata(**fields, message_type=envelope.message_type)
    except ValueError:
        metadata = Metadata(**fields, message_type=MessageType.QUERY)
    return make_message(metadata=metadata, content=RecordDict())


def error_reply(request: Message, code: int, reason: str) -> Message:
    return Message(Error(code, reason[:MAX_REASON_CHARS]), reply_to=request)


def size_text(nbytes: int) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"
