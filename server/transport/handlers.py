"""The coordinator's gRPC methods registered with request bytes parsed here, so garbage bytes get
INVALID_ARGUMENT and one log line (gRPC's own deserializer answers INTERNAL with a traceback), for the
coordinator's service, its admin service (whose requests are also refused unparsed past a size) and gRPC's
standard health service alike."""

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
from hydrafl.proto import admin_pb2 as admin_pb
from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.chunk_wire import decode_chunk

if TYPE_CHECKING:
    from hydrafl.server.transport.admin_service import AdminService
    from hydrafl.server.transport.service import CoordinatorService

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
ADMIN_SERVICE_NAME = admin_pb.DESCRIPTOR.services_by_name["Admin"].full_name
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


def _serialize(message: ProtoMessage) -> bytes:
    return message.SerializeToString()


def _unary(method: Callable, kind: type[ProtoMessage], max_bytes: int | None = None) -> Callable:
    def handle(data: bytes, context: grpc.ServicerContext) -> object:
        if max_bytes is not None and len(data) > max_bytes:
            log.warning("oversize %s from %s: %d bytes", kind.__name__, context.peer(), len(data))
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{kind.__name__} of {len(data)} bytes; at most {max_bytes}",
            )
        return method(_parse(kind.FromString, kind.__name__, data, context), context)

    return handle


def add_admin_service(service: AdminService, server: grpc.Server, max_bytes: int) -> None:
    """Register the admin service on `server`; a request over `max_bytes` is refused before it is parsed."""
    handlers: dict[str, grpc.RpcMethodHandler] = {
        "Call": grpc.unary_unary_rpc_method_handler(
            _unary(service.Call, admin_pb.AdminCall, max_bytes), response_serializer=_serialize
        ),
        "ExportModel": grpc.unary_stream_rpc_method_handler(
            _unary(service.ExportModel, admin_pb.ExportRequest, max_bytes),
            response_serializer=_serialize,
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(ADMIN_SERVICE_NAME, handlers),)
    )


def add_coordinator_service(
    service: CoordinatorService, health: HealthServicer, server: grpc.Server
) -> None:
    """Register the service and gRPC's standard health service on `server`."""

    def client_stream(
        method: Callable,
    ) -> Callable:  # chunks read in place (`chunk_wire`), not copied out
        return lambda items, context: method(
            (_parse(decode_chunk, "Chunk", data, context) for data in items), context
        )

    handlers: dict[str, grpc.RpcMethodHandler] = {
        "Join": grpc.unary_unary_rpc_method_handler(
            _unary(service.Join, pb.JoinRequest), response_serializer=_serialize
        ),
        "PullMessage": grpc.unary_unary_rpc_method_handler(
            _unary(service.PullMessage, pb.PullMessageRequest), response_serializer=_serialize
        ),
        "GetChunks": grpc.unary_stream_rpc_method_handler(
            _unary(service.GetChunks, pb.GetChunksRequest), response_serializer=bytes
        ),
        "HasChunks": grpc.unary_unary_rpc_method_handler(
            _unary(service.HasChunks, pb.HasChunksRequest), response_serializer=_serialize
        ),
        "PutChunks": grpc.stream_unary_rpc_method_handler(
            client_stream(service.PutChunks), response_serializer=_serialize
        ),
        "PushReply": grpc.unary_unary_rpc_method_handler(
            _unary(service.PushReply, pb.PushReplyRequest), response_serializer=_serialize
        ),
    }
    check = health_pb2.HealthCheckRequest
    health_handlers: dict[str, grpc.RpcMethodHandler] = {
        "Check": grpc.unary_unary_rpc_method_handler(
            _unary(health.Check, check), response_serializer=_serialize
        ),
        "Watch": grpc.unary_stream_rpc_method_handler(
            _unary(health.Watch, check), response_serializer=_serialize
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
