"""Builders for real Flower messages used across tests."""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity


def make_reply(arrays: dict[str, np.ndarray], num_examples: float, node_id: int = 1) -> Message:
    """A site's training reply as the strategy sees it (one ArrayRecord, one MetricRecord)."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1
    request = Message(RecordDict(), dst_node_id=node_id, message_type="train")
    request.metadata.__dict__["_message_id"] = f"request-{node_id}"
    content = RecordDict(
        {
            "arrays": ArrayRecord({k: Array(np.asarray(v, dtype=np.float32)) for k, v in arrays.items()}),
            "metrics": MetricRecord({"num-examples": num_examples}),
        }
    )
    return Message(content, reply_to=request)
