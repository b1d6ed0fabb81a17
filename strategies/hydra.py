"""Hydra: each site trains its own subnetwork (Hydra-net) of the global transformer, sized to its resources.

Sites score layers and heads on their own data (`query.scores`, at round 1 and every `rescore_every` rounds).
The coordinator ranks layers globally (sample-weighted site scores, so subnetworks nest), gives each site
the top layers its tier affords and, in them, the heads its own scores rank highest. Aggregation is the masked
per-coordinate weighted mean of the deltas; coordinates no site trained keep their value (and momentum). The
outer step is DiLoCo's on the trained coordinates: outer_lr 1 without momentum is the plain masked mean. Over
LoRA the masked mean and the outer step are taken on each module's product B A, masked to the rows or columns of
the heads a site ran, and factored back to the run's rank (`lora_factors`): the best rank-R approximation, so
heads no site ran move by that cut when their module was trained; modules no site trained keep A and B.

Design: ../shared/research/hydra-nets.md (Fisher layer scores as in Fed-HeLLo; Michel et al. head importance).
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import MessageType
from flwr.serverapp import Grid

from hydrafl.arrays import from_record, sliced_record, to_record
from hydrafl.hydranet import (
    COST_FIELDS,
    LayerCost,
    Slice,
    SubnetSpec,
    build_spec,
    combine_layer_scores,
    plan_budget,
    read_slices,
)
from hydrafl.strategies.accumulator import AggregationError, MaskedDeltaAccumulator
from hydrafl.strategies.diloco import DiLoCo
from hydrafl.strategies.lora_factors import (
    MaskedProductAccumulator,
    lora_pairs,
    reply_weight,
    svd_factors,
)

log = logging.getLogger(__name__)

TIER_BUDGETS: Mapping[str, tuple[float, float]] = {"small": (1 / 3, 0.5), "medium": (2 / 3, 0.75), "large": (1.0, 1.0)}
"""Per tier: the fraction of the layers, and of the heads (KV groups) in each of them, a site trains."""

Layout = Mapping[str, tuple[int, int, int]]
"""Per federated tensor: (layer or -1, head axis or -1, indices one head group owns along it); `apps.slice_layout`."""


class ScoringError(RuntimeError):
    """The scoring round gave nothing to build subnetworks from."""


class BudgetError(ValueError):
    """Not even the smallest Hydra-net (one layer, one head) fits a site's memory or the round deadline."""


def layout_slices(layout: Layout, spec: SubnetSpec) -> dict[str, Slice]:
    """`hydranet.trainable_slices` of `spec`, from the layout a site reported instead of a live model."""
    slices = {}
    for name, (layer, axis, unit) in layout.items():
        if layer < 0:
            if spec.train_outside:
                slices[name] = Slice(None)
        elif layer in spec.layers:
            kept = spec.heads_for(layer)
            whole = axis < 0 or kept is None
            slices[name] = Slice(None) if whole else Slice(axis, [i for g in kept for i in range(g * unit, (g + 1) * unit)])
    return slices


@dataclass(frozen=True, kw_only=True, slots=True)
class SiteScores:
    layers: list[float]
    heads: list[list[float]]  # per layer, per head group
    weight: float
    tier: str
    cost: LayerCost | None = None
    """The site's measured step cost (`hydranet.measure_layer_cost`), when it reported one."""
    memory_bytes: float = 0.0
    """Training memory the site declares; 0 = no limit."""


def _read_scores(reply: Message, weighted_by_key: str, arrays: ArrayRecord) -> tuple[SiteScores, dict]:
    """A `query.scores` reply as (scores, layout); KeyError/ValueError when it is malformed."""
    metrics, site = reply.content["metrics"], reply.content["site"]
    num_layers, num_groups = sum(k.startswith("layer-") for k in metrics), sum(k.startswith("head-0-") for k in metrics)
    layout = dict(zip(site["layout.names"], zip(site["layout.layers"], site["layout.axes"], site["layout.units"])))
    if set(layout) != set(arrays) or not num_layers or not num_groups:
        raise ValueError("its layout does not name the global arrays, or it has no layer/head scores")
    heads = [[float(metrics[f"head-{l}-{g}"]) for g in range(num_groups)] for l in range(num_layers)]
    layers = [float(metrics[f"layer-{l}"]) for l in range(num_layers)]
    cost = None
    if "cost.fixed-s" in metrics:
        cost = LayerCost(**{field: float(metrics[f"cost.{field.replace('_', '-')}"]) for field in COST_FIELDS})
    scores = SiteScores(
        layers=layers, heads=heads, weight=float(metrics[weighted_by_key]), tier=str(site["tier"]), cost=cost,
        memory_bytes=float(metrics.get("memory-bytes", 0.0)),
    )
    return scores, layout



class Hydra(DiLoCo):
    """DiLoCo's sampling, evaluation and outer step, over per-site subnetworks and a masked mean."""

    consumes_deltas = True

    def __init__(  # outer_lr 1 without momentum: no outer optimizer
        self, *, tiers: Mapping[str, tuple[float, float]] = TIER_BUDGETS, untiered: tuple[float, float] = (1.0, 1.0),
        rescore_every: int = 0, timeout_s: float | None = None, local_steps: int = 1, bypass: bool = False,
        lora_products: bool = True, freeze_heads: bool = True, outer_lr: float = 1.0, momentum: float = 0.0, **kwargs: Any,
    ) -> None:
        super().__init__(outer_lr=outer_lr, momentum=momentum, **kwargs)
        if rescore_every < 0 or not all(0 < f <= 1 for budget in (*tiers.values(), untiered) for f in budget):
            raise ValueError(f"Hydra needs rescore_every >= 0 and budget fractions in (0, 1], got {tiers=}, {untiered=}")
        self.tiers, self.untiered = dict(tiers), untiered
        self.rescore_every, self.timeout_s, self.local_steps = rescore_every, timeout_s, local_steps
        self.bypass, self.lora_products, self.freeze_heads = bypass, lora_products, freeze_heads
        self.layout: dict[str, tuple[int, int, int]] = {}
        self.ranking: list[int] = []
        self.site_scores: dict[int, SiteScores] = {}
        self.specs: dict[int, SubnetSpec] = {}
        self.trainable_params: dict[int, dict[str, int]] = {}  # per round, per site: coordinates it trained

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        if not self.ranking or (self.rescore_every and (server_round - 1) % self.rescore_every == 0):
            self._score(arrays, config, grid)
        messages, self.specs, counts = [], {}, {}
        for sampled in super().configure_train(server_round, arrays, config, grid):
            node = sampled.metadata.dst_node_id
            if node not in self.site_scores:
                log.warning("hydra: site %d has no scores (it missed the scoring round); not training it", node)
                continue
            try:
                self.specs[node] = spec = self._spec(self.site_scores[node])
            except BudgetError as error:
                log.warning("hydra: site %d cannot train this round: %s", node, error)
                continue
            counts[str(node)] = sum(sl.numel(arrays[name].shape) for name, sl in self.site_slices(node).items())
            site_arrays = self.download(node, arrays)
            content = RecordDict({"arrays": site_arrays, "config": ConfigRecord({**config, **spec.to_config()})})
            messages.append(Message(content, dst_node_id=node, message_type=MessageType.TRAIN))
        self.trainable_params[server_round] = counts
        return messages

    def _score(self, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> None:
        """The scoring round: every site scores the current model on its own data."""
        # the site measures its step cost as this method's nets run: skipping layers only if they bypass
        content = RecordDict({"arrays": arrays, "config": ConfigRecord({**config, "hydra-bypass": self.bypass})})
        queries = [Message(content, dst_node_id=node, message_type="query.scores") for node in sorted(grid.get_node_ids())]
        self.site_scores = {}
        for reply in grid.send_and_receive(queries, timeout=self.timeout_s):
            node = reply.metadata.src_node_id
            try:
                if reply.has_error():
                    raise ValueError(reply.error.reason)
                scores, self.layout = _read_scores(reply, self.weighted_by_key, arrays)
            except (KeyError, ValueError, TypeError) as error:
                log.warning("hydra: site %d gave no usable scores: %s", node, error)
                continue
            if scores.tier and scores.tier not in self.tiers:
                raise ScoringError(f"site {node} declares tier {scores.tier!r}; known tiers: {', '.join(self.tiers)}")
            self.site_scores[node] = scores
        if not self.site_scores:
            raise ScoringError("no site answered the scoring query usably; cannot build Hydra-nets")
        self.ranking = combine_layer_scores([(s.layers, s.weight) for s in self.site_scores.values()])

    def _spec(self, scores: SiteScores) -> SubnetSpec:
        """Top layers of the global ranking and, in each, the site's top heads, as many as its tier affords and,
        when it declared memory or the round has a deadline, as many as fit them (`hydranet.plan_budget` on the
        step cost the site measured). Raises BudgetError when not even one layer with one head fits."""
        layer_fraction, head_fraction = self.tiers[scores.tier] if scores.tier else self.untiered
        num_layers = max(1, math.ceil(layer_fraction * len(self.ranking) - 1e-9))
        num_heads = max(1, math.ceil(head_fraction * len(scores.heads[0]) - 1e-9))
        if scores.cost is not None and (scores.memory_bytes > 0 or self.timeout_s):
            try:
                budget = plan_budget(
                    scores.cost,
                    num_layers=len(self.ranking),
                    num_groups=len(scores.heads[0]),
                    memory_bytes=scores.memory_bytes or math.inf,
                    speed=1.0,  # the site's measured step time already includes its declared speed
                    deadline_s=self.timeout_s or math.inf,
                    local_steps=self.local_steps,
                )
            except ValueError as error:
                raise BudgetError(str(error)) from error
            num_layers, num_heads = min(num_layers, budget.layers), min(num_heads, budget.heads)
        return build_spec(
            self.ranking, num_layers, scores.heads, num_heads, bypass=self.bypass, freeze_heads=self.freeze_heads
        )

    count_once = False
    """True: a coordinate's update is the plain mean over the sites that trained it (each site weighs 1)."""

    def site_slices(self, node: int) -> dict[str, Slice]:
        """The coordinates `node` trains this round: what its reply carries, as compact slices."""
        return layout_slices(self.layout, self.specs[node])

    def download(self, node: int, arrays: ArrayRecord) -> ArrayRecord:
        """What `node` is sent to train: only the coordinates its subnetwork's forward pass reads
        (`hydranet.read_slices`; the site computes the same slices from its model and fills them in)."""
        layers = {name: layer for name, (layer, _, _) in self.layout.items()}
        return sliced_record(arrays, read_slices(self.site_slices(node), layers, self.specs[node]))

    def reply_shapes(self, node: int, arrays: ArrayRecord) -> dict[str, tuple[int, ...]] | None:
        """The shape of each array `node`'s reply may carry (its slices of `arrays`); the round driver checks
        replies against these instead of the global shapes. None: the node was sent no subnetwork spec."""
        if node not in self.specs:
            return None
        return {name: sl.taken_shape(arrays[name].shape) for name, sl in self.site_slices(node).items()}

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self.current_arrays is None:
            return None, None
        weights = from_record(self.current_arrays)
        shapes = {name: tuple(tensor.shape) for name, tensor in weights.items()}
        accumulator = MaskedDeltaAccumulator(self.weighted_by_key)
        pairs = lora_pairs(weights, required=False) if self.lora_products else []
        products = MaskedProductAccumulator(pairs, weights)
        for reply in replies:
            if not reply.has_error():
                if (node := reply.metadata.src_node_id) not in self.specs:
                    raise AggregationError(f"reply from node {node}, which was assigned no subnetwork this round")
                slices = self.site_slices(node)
                accumulator.add_slices(reply, slices, shapes, count_once=self.count_once)
                if pairs:
                    products.add(reply, slices, 1.0 if self.count_once else reply_weight(reply, self.weighted_by_key))
        if not accumulator.metric_records:
            return None, None
        for name, (delta, trained) in accumulator.mean().items():
            if name not in products.factors:
                weights[name] = self._masked_step(name, weights[name], delta, trained)
        product_means = products.mean()
        for pair in pairs:
            if pair.module in product_means:  # B A takes the step, then back to the run's rank; else A, B unchanged
                delta, trained = product_means[pair.module]
                start = products.start_products[pair.module]
                product = self._masked_step(f"{pair.module}.lora-product", start, delta, trained)
                if not torch.isfinite(product).all():
                    raise AggregationError(f"the product B A of {pair.module!r} is not finite after the step")
                weights[pair.b], weights[pair.a] = svd_factors(product, weights[pair.a].shape[0])
        return to_record(weights), self.train_metrics_aggr_fn(accumulator.metric_records, self.weighted_by_key)

    def _masked_step(self, name: str, weights: torch.Tensor, delta: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
        """DiLoCo's outer step where some site trained; elsewhere value and momentum stay as they were."""
        before = self.momentum_buffer[name].clone() if name in self.momentum_buffer else None
        direction = self._direction(name, delta)
        if before is not None:
            self.momentum_buffer[name] = torch.where(trained, self.momentum_buffer[name], before)
        return torch.where(trained, weights - self.outer_lr * direction, weights)

    _STATE = ("layout", "ranking", "site_scores", "specs", "trainable_params")

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **{key: copy.deepcopy(getattr(self, key)) for key in self._STATE}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        for key in self._STATE:
            setattr(self, key, copy.deepcopy(state[key]))
