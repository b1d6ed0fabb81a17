"""A Chunk's wire form, written and read without the copies protobuf makes of its data.

Every byte of an update crosses the wire inside a `Chunk` (a name and ~1 MiB of data). Through protobuf a
sender copies the data into a `Chunk` and again into its serialised form, and a receiver copies it out of the
message gRPC hands over; on a 2-core machine those copies cost as much CPU as gRPC itself. Here a chunk is
written in one join and read as a view into the received bytes. The wire form is protobuf's own, so either
end may still use the generated classes: field 1 (the name, a string) and field 2 (the data, bytes); unknown
fields are skipped and a repeated field's last value wins, as protobuf parses them (groups, a proto2 form no
hydrafl peer sends, are refused).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.coordinator_pb2_grpc import CoordinatorStub

_DIGEST_TAG = b"\x0a"  # field 1, length-delimited
_DATA_TAG = b"\x12"  # field 2, length-delimited
_MAX_FIELD = (1 << 29) - 1
_SERVICE = "/" + pb.DESCRIPTOR.services_by_name["Coordinator"].full_name


@dataclass(frozen=True, slots=True)
class ChunkView:
    """A received chunk: its name, and its data as a view into the message gRPC received (no copy)."""

    digest: str
    data: memoryview


def encode_chunk(chunk: tuple[str, bytes | memoryview]) -> bytes:
    """(name, data) in a Chunk's wire form, the data copied once (an empty field left out, as protobuf does)."""
    digest, data = chunk
    name = digest.encode()
    parts = (_DIGEST_TAG, _varint(len(name)), name) if name else ()
    return b"".join((*parts, _DATA_TAG, _varint(len(data)), data) if len(data) else parts)


def decode_chunk(wire: bytes) -> ChunkView:
    """A Chunk's wire form read in place; DecodeError for anything protobuf would refuse, and for groups."""
    view = memoryview(wire)
    digest, data, at = "", view[:0], 0
    while at < len(view):
        key, at = _read_varint(view, at)
        field, wire_type = key >> 3, key & 7
        if not 0 < field <= _MAX_FIELD:
            raise DecodeError(f"malformed Chunk: field number {field}")
        if wire_type == 2:
            length, at = _read_varint(view, at)
            if at + length > len(view):
                raise DecodeError("truncated Chunk: a field runs past the end")
            value, at = view[at : at + length], at + length
            if field == 1:
                digest = _utf8(value)
            elif field == 2:
                data = value
        elif wire_type == 0:
            _, at = _read_varint(view, at)
        elif wire_type in (1, 5):
            at += 8 if wire_type == 1 else 4
        else:
            raise DecodeError(f"Chunk: wire type {wire_type} is not valid here")
        if at > len(view):
            raise DecodeError("truncated Chunk: a field runs past the end")
    return ChunkView(digest, data)


class CoordinatorClient(CoordinatorStub):
    """The generated stub, with the two chunk streams on the wire form above: `PutChunks` takes an iterator of
    (name, data) pairs and `GetChunks` yields `ChunkView`s."""

    def __init__(self, channel: grpc.Channel) -> None:
        super().__init__(channel)
        self.PutChunks = channel.stream_unary(
            f"{_SERVICE}/PutChunks",
            request_serializer=encode_chunk,
            response_deserializer=pb.PutChunksReply.FromString,
        )
        self.GetChunks = channel.unary_stream(
            f"{_SERVICE}/GetChunks",
            request_serializer=pb.GetChunksRequest.SerializeToString,
            response_deserializer=decode_chunk,
        )


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _utf8(value: memoryview) -> str:
    try:
        return str(value, "utf-8")
    except UnicodeDecodeError as error:
        raise DecodeError("malformed Chunk: the name is not valid UTF-8") from error


def _read_varint(view: memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    for index in range(at, min(at + 10, len(view))):
        byte = view[index]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, index + 1
        shift += 7
    raise DecodeError("malformed Chunk: a truncated or overlong varint")
