"""The coordinator's gRPC methods registered with request bytes parsed here, so garbage bytes get
INVALID_ARGUMENT and one log line (gRPC's own deserializer answers INTERNAL with a traceback), for the
coordinator's service and for gRPC's standard health service alike."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.message import Message as ProtoMessage
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import HealthServicer

from hydrafl.bounded import bounded
from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.chunk_wire import decode_chunk

if TYPE_CHECKING:
    from hydrafl.server.transport.service import CoordinatorService

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
Request = TypeVar("Request")


def _parse(
    parse: Callable[[bytes], Request], name: str, data: bytes, context: grpc.ServicerContext
) -> Request:
    try:
        return parse(data)
    except (DecodeError, ValueError, RuntimeError) as error:
        log.warning("malformed %s from %s: %s", name, context.peer(), bounded(error))
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"malformed {name}: not a valid protobuf message"
        )


def add_coordinator_service(
    service: CoordinatorService, health: HealthServicer, server: grpc.Server
) -> None:
    """Register the service and gRPC's standard health service on `server`."""

    def unary(method: Callable, kind: type[ProtoMessage]) -> Callable:
        return lambda data, context: method(
            _parse(kind.FromString, kind.__name__, data, context), context
        )

    def client_stream(
        method: Callable,
    ) -> Callable:  # chunks read in place (`chunk_wire`), not copied out
        return lambda items, context: method(
            (_parse(decode_chunk, "Chunk", data, context) for data in items), context
        )

    def serialize(message: ProtoMessage) -> bytes:
        return message.SerializeToString()

    handlers: dict[str, grpc.RpcMethodHandler] = {
        "Join": grpc.unary_unary_rpc_method_handler(
            unary(service.Join, pb.JoinRequest), response_serializer=serialize
        ),
        "PullMessage": grpc.unary_unary_rpc_method_handler(
            unary(service.PullMessage, pb.PullMessageRequest), response_serializer=serialize
        ),
        "GetChunks": grpc.unary_stream_rpc_method_handler(
            unary(service.GetChunks, pb.GetChunksRequest), response_serializer=bytes
        ),
        "HasChunks": grpc.unary_unary_rpc_method_handler(
            unary(service.HasChunks, pb.HasChunksRequest), response_serializer=serialize
        ),
        "PutChunks": grpc.stream_unary_rpc_method_handler(
            client_stream(service.PutChunks), response_serializer=serialize
        ),
        "PushReply": grpc.unary_unary_rpc_method_handler(
            unary(service.PushReply, pb.PushReplyRequest), response_serializer=serialize
        ),
    }
    check = health_pb2.HealthCheckRequest
    health_handlers: dict[str, grpc.RpcMethodHandler] = {
        "Check": grpc.unary_unary_rpc_method_handler(
            unary(health.Check, check), response_serializer=serialize
        ),
        "Watch": grpc.unary_stream_rpc_method_handler(
            unary(health.Watch, check), response_serializer=serialize
        ),
    }
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),
            grpc.method_handlers_generic_handler(
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, health_handlers
            ),
        )
    )
