"""A real site agent that trains honestly, then multiplies every training update it uploads by `SCALE`: a
well-formed reply that only screening can tell from an honest one. Run as a process:
python tests/scaling_site.py ADDRESS TOKEN."""

from __future__ import annotations

import logging
import sys

from flwr.app import Array, ArrayRecord, Message
from flwr.common import MessageType

from hydrafl.client.agent import SiteAgent
from hydrafl.client.site_app import client_app
from hydrafl.proto.coordinator_pb2_grpc import CoordinatorStub

SCALE = 1000.0


class ScalingAgent(SiteAgent):
    def _push(self, stub: CoordinatorStub, reply: Message, server_round: int) -> None:
        if reply.metadata.message_type == MessageType.TRAIN and not reply.has_error():
            record = reply.content["arrays"]
            reply.content["arrays"] = ArrayRecord(
                {name: Array(SCALE * array.numpy()) for name, array in record.items()}
            )
        super()._push(stub, reply, server_round)


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, format="%(message)s"
    )  # "joined as ..." tells the test it is connected
    address, token = sys.argv[1:3]
    ScalingAgent(address, token, client_app, {}, demo=True).run()
