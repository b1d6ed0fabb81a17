"""Neighbouring federations for the auditor's privacy-loss tests (central DP in `privacy/test_privacy_loss.py`,
distributed DP in `privacy/test_distributed_hydra.py`): one site's update replaced, and the sites' real replies
to a strategy's round over an unequal split."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord

from hydrafl.config import RunConfig
from hydrafl.strategies.hooks import QueriesSites
from hydrafl.updates import records

EXAMPLES = (1000, 10, 10)
"""An unequal split: one site holds 98% of the examples, which must not raise its weight under DP."""
NEIGHBOURS: dict[
    str, Callable[[dict[str, np.ndarray], dict[str, np.ndarray]], dict[str, np.ndarray]]
] = {
    "negated": lambda own, other: {name: -value for name, value in own.items()},
    "zero": lambda own, other: {name: np.zeros_like(value) for name, value in own.items()},
    "another site's": lambda own, other: {  # where its slice has the same shape
        name: other[name] if other.get(name, value).shape == value.shape else value
        for name, value in own.items()
    },
    "scaled x100": lambda own, other: {name: 100 * value for name, value in own.items()},
}


def deltas(reply: Message) -> dict[str, np.ndarray]:
    return {
        name: array.numpy().copy() for name, array in records(reply.content, ArrayRecord)[0].items()
    }


def round_replies(
    strategy, grid, cfg: RunConfig, server_round: int, arrays: ArrayRecord
) -> list[Message]:
    """The sites' real training replies to the strategy's round, with the unequal example counts."""
    if isinstance(strategy, QueriesSites):
        queries = list(
            strategy.configure_query(server_round, arrays, ConfigRecord(cfg.to_flower()), grid)
        )
        if queries:
            strategy.aggregate_query(server_round, list(grid.send_and_receive(queries)))
    messages = list(
        strategy.configure_train(server_round, arrays, ConfigRecord(cfg.to_flower()), grid)
    )
    replies = sorted(grid.send_and_receive(messages), key=lambda reply: reply.metadata.src_node_id)
    assert len(replies) == len(EXAMPLES) and not any(reply.has_error() for reply in replies)
    for reply, examples in zip(replies, EXAMPLES, strict=True):
        records(reply.content, MetricRecord)[0]["num-examples"] = examples
    return replies
