"""Flower builds new messages from a process-global task identity; a server-side runtime must own it."""

from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity


def claim_server_identity(run_id: int) -> None:
    TaskIdentity.run_id = run_id
    TaskIdentity.node_id = SUPERLINK_NODE_ID
    TaskIdentity.task_id = run_id
