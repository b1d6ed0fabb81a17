#!/opt/hydrafl/bin/python
"""The coordinator image's HEALTHCHECK: asks the coordinator's gRPC health service (grpc.health.v1) whether
hydrafl.proto.Coordinator is SERVING; exit 0 if so, 1 otherwise (Docker's contract).

Environment: HYDRAFL_HEALTH_ADDR (default 127.0.0.1:9091); HYDRAFL_HEALTH_CA, the CA of the coordinator's
certificate, when it serves TLS (the probe then checks the name in HYDRAFL_HEALTH_NAME, default localhost).
"""

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICE = "hydrafl.proto.Coordinator"


def main() -> int:
    address = os.environ.get("HYDRAFL_HEALTH_ADDR", "127.0.0.1:9091")
    ca = os.environ.get("HYDRAFL_HEALTH_CA")
    if ca:
        with open(ca, "rb") as pem:
            credentials = grpc.ssl_channel_credentials(root_certificates=pem.read())
        name = os.environ.get("HYDRAFL_HEALTH_NAME", "localhost")
        channel = grpc.secure_channel(
            address, credentials, options=[("grpc.ssl_target_name_override", name)]
        )
    else:
        channel = grpc.insecure_channel(address)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE), timeout=4
        )
    except grpc.RpcError as error:
        print(f"unhealthy: {error.code().name} from {address}", file=sys.stderr)
        return 1
    finally:
        channel.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{SERVICE} at {address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
