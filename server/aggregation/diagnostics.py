"""The round's pseudo-gradient diagnostics (`--diagnostics`): the sites' noise scale B_pg over the valid deltas,
and, when the grid has a full-data reference site, the cosine between the averaged delta and that site's delta
from the same start (`pseudo_gradients`). Undefined ones (sites that send different tensors, as Hydra's do, or
all-zero deltas) are logged and left out of the round's record."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, MetricRecord

from hydrafl.arrays import array_view
from hydrafl.compression.layout import Scheme
from hydrafl.compression.receive import decode_reply
from hydrafl.rounds import RoundRecord
from hydrafl.server.aggregation.exchange import Exchange
from hydrafl.server.aggregation.pseudo_gradients import (
    DeltaMoments,
    ZeroDeltaError,
    cosine_to_reference,
)
from hydrafl.updates import records

log = logging.getLogger(__name__)


class RoundDiagnostics:
    """B_pg of each round's replies weighted by `weighted_by_key`; with `reference_node`, the cosine to it."""

    def __init__(
        self,
        exchange: Exchange,
        scheme: Scheme,
        weighted_by_key: str,
        reference_node: int | None,
    ) -> None:
        self.exchange = exchange
        self.scheme = scheme
        self.weighted_by_key = weighted_by_key
        self.reference_node = reference_node

    def measure(
        self,
        server_round: int,
        messages: Sequence[Message],
        valid: Sequence[Message],
        record: RoundRecord,
    ) -> None:
        """B_pg over the `valid` deltas, streamed; the reference site is sent the round's first message."""
        moments = DeltaMoments()
        try:
            for reply in valid:
                weight = float(records(reply.content, MetricRecord)[0][self.weighted_by_key])
                moments.add(_delta_views(reply), weight)
            if len(valid) >= 2:
                record.noise_scale = moments.noise_scale()
            if self.reference_node is not None:
                reference = Message(
                    messages[0].content,
                    dst_node_id=self.reference_node,
                    message_type=messages[0].metadata.message_type,
                )
                [reply] = self.exchange([reference], server_round)
                if reply.has_error():
                    raise RuntimeError(f"the full-data reference site failed: {reply.error.reason}")
                decode_reply(reply, self.scheme)
                pooled = {name: _tensor(view) for name, view in _delta_views(reply).items()}
                record.full_data_cosine = cosine_to_reference(moments.mean(), pooled)
        except (
            KeyError,
            ValueError,
            ZeroDeltaError,
        ) as error:  # e.g. Hydra: sites send different tensors
            log.warning("round %d: pseudo-gradient diagnostics undefined: %s", server_round, error)


def _delta_views(reply: Message) -> dict[str, np.ndarray]:
    """The reply's delta (its first ArrayRecord), viewed without copying."""
    return {name: array_view(a) for name, a in records(reply.content, ArrayRecord)[0].items()}


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(
        np.array(array, dtype=np.float64)
    )  # a writable float64 copy of a wire view
