"""The check step: the one place the round driver holds a site's reply to `hydrafl.updates`' rules, with what
the strategy says that site may send (a subnetwork's slices, a site half's extra arrays)."""

from __future__ import annotations

from flwr.app import ArrayRecord, Message
from flwr.serverapp.strategy import Strategy

from hydrafl.strategies import hooks
from hydrafl.updates import InvalidUpdate, check_evaluate_reply, check_train_reply


class ReplyCheck:
    """Why a reply is invalid ("" when it is not), for `strategy`'s replies weighted by `weighted_by_key`."""

    def __init__(self, strategy: Strategy, weighted_by_key: str) -> None:
        self.strategy = strategy
        self.weighted_by_key = weighted_by_key

    def train(self, reply: Message, arrays: ArrayRecord) -> str:
        """A train reply's delta against the round's global `arrays`."""
        strategy = self.strategy
        # a subnetwork strategy (Hydra and the width baselines) accepts each site's slices, not whole tensors
        shapes = (
            strategy.reply_shapes(reply.metadata.src_node_id, arrays)
            if isinstance(strategy, hooks.ChecksReplyShapes)
            else None
        )
        extra = strategy.reply_arrays if isinstance(strategy, hooks.ExtraArrays) else ()
        try:
            check_train_reply(
                reply, arrays, self.weighted_by_key, shapes=shapes, extra_arrays=extra
            )
        except InvalidUpdate as error:
            return f"invalid update: {error}"
        return ""

    def evaluate(self, reply: Message) -> str:
        try:
            check_evaluate_reply(reply, self.weighted_by_key)
        except InvalidUpdate as error:
            return f"invalid evaluation: {error}"
        return ""
