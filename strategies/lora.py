"""What the LoRA-family baselines (FedIT, FLoRA, HetLoRA, FlexLoRA) share: finding the LoRA factor pairs among the
global arrays, one rank per site sized to Hydra's budget for the site's tier, and per-site factors.

A site of rank r_k trains the run's rank-R adapter (R = `lora_rank`) as if its components r_k..R-1 were zero
(with both A's row and B's column zero a component gets exactly zero gradient): it downloads only the first r_k
rows of each A and columns of each B, trains them as a rank-r_k adapter (alpha scaled by r_k / R, the same
function; `site_app.lora_spec`), so its compute and memory are rank r_k's, and uploads the same slices.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import MessageType
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from hydrafl import protocol
from hydrafl.arrays import from_record, sliced_record, to_record
from hydrafl.lora_pairs import LoraPair, lora_pairs
from hydrafl.strategies.accumulator import AggregationError, WeightedDeltaAccumulator
from hydrafl.strategies.budgets import BudgetConfig
from hydrafl.strategies.lora_factors import reply_delta
from hydrafl.strategies.planner import BudgetError, SitePlanner
from hydrafl.strategies.robust import MaskedRobustAggregator, RobustRule
from hydrafl.subnet.slices import Slice

if TYPE_CHECKING:
    from hydrafl.privacy.central import CentralDp

log = logging.getLogger(__name__)


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


class LoraFold(Protocol):
    """One round of a LoRA baseline's rule: each full-shape reply folded in as it comes, then the factors set."""

    def add(self, reply: Message, rank: int) -> None: ...

    def finish(self, weights: dict[str, torch.Tensor], total_weight: float) -> None: ...


class LoraBaseline(FedAvg):
    """The planning round (on one sample: only the tiers and the layout are used), then one LoRA rank per
    site: the rank whose trainable parameters come closest to what a Hydra-net of the site's tier trains.
    Subclasses give their aggregation rule as a `LoraFold`; the loop over the replies is this one."""

    consumes_deltas = True

    def __init__(
        self,
        *,
        planner: SitePlanner | None = None,
        robust: RobustRule = RobustRule(),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.robust = robust
        """A robust rule (median, trimmed mean) replaces the fold's and the head's sums; it holds the replies."""
        self.planner = planner or SitePlanner()
        self.planner.scoring[protocol.SCORE_SAMPLES] = 1
        # a site with a memory limit or a round deadline measures what each rank costs it
        self.planner.scoring[protocol.SCORE_RANK_COST] = True
        self.current_arrays: ArrayRecord | None = None
        self.ranks: dict[int, int] = {}
        self.server_round = 0
        self.trainable_params: dict[int, dict[str, int]] = {}
        """Per round, per site (node id as a string): the coordinates of its rank."""

    def head_dp(self) -> CentralDp | None:
        """Central DP of the head's mean; only a fold linear in each site's update (FedIT's) takes central DP."""
        return None

    def fold(self, weights: dict[str, torch.Tensor], pairs: list[LoraPair]) -> LoraFold:
        """This round's rule, starting from the global `weights`; under a robust rule (`self.robust`), the
        rule's per-coordinate sum becomes that rule over the sites that trained each coordinate."""
        raise NotImplementedError

    def configure_query(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if self.planner.ranking:
            return []
        trainable = ArrayRecord(
            {name: arrays[name] for name in trainable_names(arrays, lora_pairs(arrays))}
        )
        return self.planner.queries(trainable, config, grid.get_node_ids())

    def aggregate_query(self, server_round: int, replies: Iterable[Message]) -> None:
        self.planner.take_replies(replies, self.weighted_by_key)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        pairs = lora_pairs(arrays)
        trainable = ArrayRecord({name: arrays[name] for name in trainable_names(arrays, pairs)})
        self.current_arrays, self.server_round, messages, counts = arrays, server_round, [], {}
        name = type(self).__name__
        for sampled in self.planner.planned(
            super().configure_train(server_round, arrays, config, grid), name
        ):
            node = sampled.metadata.dst_node_id
            if node not in self.ranks:
                try:
                    self.ranks[node] = self._rank(node, trainable, pairs)
                except BudgetError as error:
                    log.warning("%s: site %d cannot train this round: %s", name, node, error)
                    continue
            rank = self.ranks[node]
            counts[str(node)] = _count(trainable, pairs, rank)
            config = ConfigRecord(
                {**sampled.content["config"], **self.site_config(), protocol.SITE_RANK: rank}
            )
            site_arrays = self._site_arrays(node, rank, arrays, pairs)
            download = sliced_record(
                site_arrays, rank_slices(site_arrays, rank)
            )  # a rank-r adapter's factors
            content = RecordDict({"arrays": download, "config": config})
            messages.append(Message(content, dst_node_id=node, message_type=MessageType.TRAIN))
        self.trainable_params[server_round] = counts
        return messages

    def site_config(self) -> dict[str, float]:
        """What the method tells its sites beyond their rank (HetLoRA: their local regulariser)."""
        return {}

    def _rank(self, node: int, trainable: ArrayRecord, pairs: list[LoraPair]) -> int:
        """Closest rank to the Hydra-net budget of the node's tier (ties go to the smaller rank), and at most
        the largest rank that fits the node's declared memory and the round deadline, as measured there."""
        shapes = {name: tuple(trainable[name].shape) for name in trainable}
        budget = self.planner.budget(node, shapes, fitted=False)  # its own cost fits its rank below
        max_rank = int(trainable[pairs[0].a].shape[0])
        matched = min(
            range(1, max_rank + 1), key=lambda r: (abs(_count(trainable, pairs, r) - budget), r)
        )
        return min(matched, self.planner.rank_limit(node, max_rank))

    def _site_arrays(
        self, node: int, rank: int, arrays: ArrayRecord, pairs: list[LoraPair]
    ) -> ArrayRecord:
        """What site `node` starts from: the global factors truncated to its rank (FLoRA overrides). Arrays
        other than the factors are shared with the global record, not copied."""
        factors = {}
        for pair in pairs:
            a, b = (
                torch.from_numpy(arrays[pair.a].numpy()),
                torch.from_numpy(arrays[pair.b].numpy()),
            )
            factors[pair.a], factors[pair.b] = truncate(a, b, rank)
        return ArrayRecord({**{name: arrays[name] for name in arrays}, **to_record(factors)})

    def reply_shapes(self, node: int, arrays: ArrayRecord) -> dict[str, tuple[int, ...]] | None:
        """A site uploads its rank's components only; None for a node that was assigned no rank."""
        if node not in self.ranks:
            return None
        slices = rank_slices(trainable_names(arrays, lora_pairs(arrays)), self.ranks[node])
        return {name: sl.taken_shape(arrays[name].shape) for name, sl in slices.items()}

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Each reply back at the global shapes (zeros beyond its site's rank), folded in one at a time; the
        arrays that are not LoRA factors (the classifier head, ...) take FedAvg's step (or the robust rule's)."""
        if self.current_arrays is None:
            return None, None
        weights = from_record(self.current_arrays)
        pairs = lora_pairs(weights)
        factors = {name for pair in pairs for name in (pair.a, pair.b)}
        head = WeightedDeltaAccumulator(
            self.weighted_by_key, dp=self.head_dp()
        )  # sums every array; only non-factors are used
        robust_head = MaskedRobustAggregator(self.robust)
        fold = self.fold(weights, pairs)
        for reply in self._full_shape(replies):
            if not reply.has_error():
                head.add(reply)
                if self.robust.robust:  # every site trains the head whole
                    for name, delta in reply_delta(reply).items():
                        if name not in factors:
                            robust_head.add(name, Slice(None), delta, tuple(weights[name].shape))
                fold.add(reply, self._rank_of(reply))
        if not head.metric_records:
            return None, None
        head_names = [name for name in weights if name not in factors]
        means = (
            {n: d for n, (d, _) in robust_head.aggregate().items()}
            if self.robust.robust
            else head.mean(head_names)
        )
        for name, delta in means.items():
            if name not in factors:
                weights[name] = weights[name] - delta
        fold.finish(weights, head.total_weight)
        return to_record(weights), self.train_metrics_aggr_fn(
            head.metric_records, self.weighted_by_key
        )

    def _full_shape(self, replies: Iterable[Message]) -> Iterator[Message]:
        """Each reply with its arrays at the global shapes while the rule reads it, then back to the compact
        arrays it arrived with: the caller keeps every reply of the round, and full-shape copies of all of them
        would grow with the number of sites."""
        for reply in replies:
            if reply.has_error():
                yield reply
                continue
            key, record = next(
                (k, r) for k, r in reply.content.items() if isinstance(r, ArrayRecord)
            )
            slices = rank_slices(record, self._rank_of(reply))
            full = {}
            for name, compact in from_record(record).items():
                full[name] = torch.zeros(
                    tuple(self.current_arrays[name].shape), dtype=compact.dtype
                )
                slices[name].add_to(full[name], compact)
            reply.content[key] = to_record(full)
            yield reply
            reply.content[key] = record

    def _rank_of(self, reply: Message) -> int:
        if (node := reply.metadata.src_node_id) not in self.ranks:
            raise AggregationError(f"reply from node {node}, which was assigned no LoRA rank")
        return self.ranks[node]

    def state_dict(self) -> dict[str, Any]:
        return {
            **self.planner.state_dict(),
            "current_arrays": self.current_arrays,
            "ranks": dict(self.ranks),
            "trainable_params": copy.deepcopy(self.trainable_params),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.planner.load_state_dict(state)
        self.current_arrays = state["current_arrays"]
        self.ranks = dict(state["ranks"])
        self.trainable_params = copy.deepcopy(state["trainable_params"])


def _count(trainable: ArrayRecord, pairs: list[LoraPair], rank: int) -> int:
    """Trainable coordinates of a rank-`rank` site: rank * (in + out) per pair, plus every non-LoRA array."""
    lora = {name for pair in pairs for name in (pair.a, pair.b)}
    fixed = sum(math.prod(trainable[name].shape) for name in trainable if name not in lora)
    return fixed + sum(rank * (trainable[p.a].shape[1] + trainable[p.b].shape[0]) for p in pairs)


@dataclass(frozen=True, kw_only=True)
class LoraBaselineConfig(BudgetConfig):
    """A LoRA baseline: each site trains the LoRA rank closest to Hydra's budget for its tier."""

    federates_lora: ClassVar[bool] = True
