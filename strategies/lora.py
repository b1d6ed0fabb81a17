"""What the LoRA-family baselines (FedIT, FLoRA, HetLoRA, FlexLoRA) share: finding the LoRA factor pairs among the
global arrays, one rank per site sized to Hydra's budget for the site's tier, and per-site factors.

A site of rank r_k trains the run's rank-R adapter (R = `lora_rank`) as if its components r_k..R-1 were zero
(with both A's row and B's column zero a component gets exactly zero gradient): it downloads only the first r_k
rows of each A and columns of each B, trains them as a rank-r_k adapter (alpha scaled by r_k / R, the same
function; `site_app.lora_spec`), so its compute and memory are rank r_k's, and uploads the same slices.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import MessageType
from flwr.serverapp import Grid

from hydrafl.arrays import from_record, sliced_record, to_record
from hydrafl.strategies.accumulator import AggregationError, WeightedDeltaAccumulator
from hydrafl.strategies.diloco import DiLoCo
from hydrafl.hydranet import Slice
from hydrafl.strategies.hydra import BudgetError, Hydra, layout_slices
from hydrafl.strategies.lora_factors import LoraPair, lora_pairs

log = logging.getLogger(__name__)

SITE_RANK_KEY = "lora.site-rank"
"""Train config key: the LoRA rank a site trains and uploads (`rank_slices`)."""

def truncate(a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of A and B keeping their first `rank` components (rows of A, columns of B), zeros elsewhere."""
    a, b = a.clone(), b.clone()
    a[rank:] = 0
    b[:, rank:] = 0
    return a, b


def trainable_names(names: Iterable[str], pairs: Iterable[LoraPair]) -> list[str]:
    """The arrays sites train: all but the frozen base weights FLoRA keeps among the global arrays."""
    bases = {pair.base for pair in pairs}
    return [name for name in names if name not in bases]


def rank_slices(names: Iterable[str], rank: int) -> dict[str, Slice]:
    """What a site of rank `rank` trains and uploads of each trainable array: the first `rank` rows of every A,
    the first `rank` columns of every B, every other array whole."""
    names = list(names)
    axis = {}
    for pair in lora_pairs(names):
        axis[pair.a], axis[pair.b] = 0, 1
    return {name: Slice(axis[name], range(rank)) if name in axis else Slice(None) for name in names}


class LoraBaseline(Hydra):
    """Hydra's tier-and-layout query (on one sample, only the tier and layout are used), then one LoRA rank per
    site: the rank whose trainable parameters come closest to what a Hydra-net of the site's tier trains."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ranks: dict[int, int] = {}
        self.server_round = 0

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        pairs = lora_pairs(arrays)
        trainable = ArrayRecord({name: arrays[name] for name in trainable_names(arrays, pairs)})
        if not self.ranking:
            self._score(trainable, ConfigRecord({**config, "score-samples": 1}), grid)
        self.server_round, messages, counts = server_round, [], {}
        # DiLoCo's sampling and bookkeeping; Hydra's own would send subnetwork specs the sites must not apply.
        for sampled in DiLoCo.configure_train(self, server_round, arrays, config, grid):
            node = sampled.metadata.dst_node_id
            if node not in self.site_scores:
                log.warning("%s: site %d missed the tier query; not training it", type(self).__name__, node)
                continue
            if node not in self.ranks:
                try:
                    self.ranks[node] = self._rank(node, trainable, pairs)
                except BudgetError as error:
                    log.warning("%s: site %d cannot train this round: %s", type(self).__name__, node, error)
                    continue
            rank = self.ranks[node]
            counts[str(node)] = _count(trainable, pairs, rank)
            config = ConfigRecord({**sampled.content["config"], **self.site_config(), SITE_RANK_KEY: rank})
            site_arrays = self._site_arrays(node, rank, arrays, pairs)
            download = sliced_record(site_arrays, rank_slices(site_arrays, rank))  # a rank-r adapter's factors
            content = RecordDict({"arrays": download, "config": config})
            messages.append(Message(content, dst_node_id=node, message_type=MessageType.TRAIN))
        self.trainable_params[server_round] = counts
        return messages

    def site_config(self) -> dict[str, float]:
        """What the method tells its sites beyond their rank (HetLoRA: their local regulariser)."""
        return {}

    def _rank(self, node: int, trainable: ArrayRecord, pairs: list[LoraPair]) -> int:
        """Closest rank to the Hydra-net budget of the node's tier; ties go to the smaller rank."""
        hydra = self._spec(self.site_scores[node])
        budget = sum(sl.numel(tuple(trainable[name].shape)) for name, sl in layout_slices(self.layout, hydra).items())
        max_rank = int(trainable[pairs[0].a].shape[0])
        return min(range(1, max_rank + 1), key=lambda r: (abs(_count(trainable, pairs, r) - budget), r))

    def _site_arrays(self, node: int, rank: int, arrays: ArrayRecord, pairs: list[LoraPair]) -> ArrayRecord:
        """What site `node` starts from: the global factors truncated to its rank (FLoRA overrides). Arrays
        other than the factors are shared with the global record, not copied."""
        factors = {}
        for pair in pairs:
            a, b = torch.from_numpy(arrays[pair.a].numpy()), torch.from_numpy(arrays[pair.b].numpy())
            factors[pair.a], factors[pair.b] = truncate(a, b, rank)
        return ArrayRecord({**{name: arrays[name] for name in arrays}, **to_record(factors)})

    def reply_shapes(self, node: int, arrays: ArrayRecord) -> dict[str, tuple[int, ...]] | None:
        """A site uploads its rank's components only; None for a node that was assigned no rank."""
        if node not in self.ranks:
            return None
        slices = rank_slices(trainable_names(arrays, lora_pairs(arrays)), self.ranks[node])
        return {name: sl.taken_shape(arrays[name].shape) for name, sl in slices.items()}

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Each reply back at the global shapes (zeros beyond its site's rank), one at a time, for the rule."""
        if self.current_arrays is None:
            return None, None
        return self.aggregate_lora(server_round, self._full_shape(replies))

    def aggregate_lora(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The method's rule on full-shape replies, each consumed before the next is asked for."""
        raise NotImplementedError

    def _full_shape(self, replies: Iterable[Message]) -> Iterator[Message]:
        """Each reply with its arrays at the global shapes while the rule reads it, then back to the compact
        arrays it arrived with: the caller keeps every reply of the round, and full-shape copies of all of them
        would grow with the number of sites."""
        for reply in replies:
            if reply.has_error():
                yield reply
                continue
            key, record = next((k, r) for k, r in reply.content.items() if isinstance(r, ArrayRecord))
            slices = rank_slices(record, self._rank_of(reply))
            full = {}
            for name, compact in from_record(record).items():
                full[name] = torch.zeros(tuple(self.current_arrays[name].shape), dtype=compact.dtype)
                slices[name].add_to(full[name], compact)
            reply.content[key] = to_record(full)
            yield reply
            reply.content[key] = record

    def _rank_of(self, reply: Message) -> int:
        if (node := reply.metadata.src_node_id) not in self.ranks:
            raise AggregationError(f"reply from node {node}, which was assigned no LoRA rank")
        return self.ranks[node]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "ranks": dict(self.ranks)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.ranks = dict(state["ranks"])


def _count(trainable: ArrayRecord, pairs: list[LoraPair], rank: int) -> int:
    """Trainable coordinates of a rank-`rank` site: rank * (in + out) per pair, plus every non-LoRA array."""
    lora = {name for pair in pairs for name in (pair.a, pair.b)}
    fixed = sum(math.prod(trainable[name].shape) for name in trainable if name not in lora)
    return fixed + sum(rank * (trainable[p.a].shape[1] + trainable[p.b].shape[0]) for p in pairs)


def step_outside_factors(weights: dict[str, torch.Tensor], head: WeightedDeltaAccumulator, pairs: Iterable[LoraPair]) -> None:
    """The arrays that are not LoRA factors (the classifier head, ...) take the FedAvg step of their mean delta."""
    factors = {name for pair in pairs for name in (pair.a, pair.b)}
    for name, delta in head.mean().items():
        if name not in factors:
            weights[name] = weights[name] - delta
