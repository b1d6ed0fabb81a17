"""The planning round and the budgets, one component that Hydra, the width baselines and the LoRA baselines
each hold: before training (and every `rescore_every` rounds) every site scores the model's layers and heads on
its own data and reports its tier, resources and slice layout; the planner ranks the layers globally
(sample-weighted, so subnetworks nest) and sizes each site's Hydra-net to its tier, memory and the round
deadline. The strategies turn that Hydra-net into what they assign: itself, a width, or a LoRA rank.

Design: ../shared/research/hydra-nets.md (Fisher layer scores as in Fed-HeLLo; Michel et al. head importance).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import random
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from hydrafl import protocol
from hydrafl.subnet.planning import (
    COST_FIELDS,
    RANK_COST_FIELDS,
    LayerCost,
    RankCost,
    build_spec,
    coactivation_groups,
    combine_layer_scores,
    fit_rank,
    plan_budget,
    select_experts,
)
from hydrafl.subnet.slices import layout_slices
from hydrafl.subnet.spec import SubnetSpec

log = logging.getLogger(__name__)

TIER_BUDGETS: Mapping[str, tuple[float, float]] = {
    "small": (1 / 3, 0.5),
    "medium": (2 / 3, 0.75),
    "large": (1.0, 1.0),
}
"""Per tier: the fraction of the layers, and of the heads (KV groups) in each of them, a site trains."""

EXPERT_BUDGETS: Mapping[str, float] = {"small": 0.25, "medium": 0.5, "large": 1.0}
"""Per tier: the fraction of a mixture-of-experts model's experts, in every layer, a site trains."""

EXPERT_SELECTIONS = ("coactivation", "routed", "random")
"""How a site's experts are chosen: groups of experts its tokens route to together, by routed share
(`subnet.planning.coactivation_groups`); the most-routed experts one by one; uniformly at random, per round."""

Layout = Mapping[str, tuple[int, int, int]]
"""Per federated tensor: (layer or -1, head axis or -1, indices one head group owns along it);
`site_app.slice_layout`."""


class ScoringError(RuntimeError):
    """The planning round gave nothing to build subnetworks from."""


class BudgetError(ValueError):
    """Not even the smallest Hydra-net (one layer, one head) fits a site's memory or the round deadline."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SiteScores:
    layers: list[float]
    heads: list[list[float]]  # per layer, per head group
    weight: float
    tier: str
    cost: LayerCost | None = None
    """The site's measured step cost (`subnet.measure.measure_layer_cost`), when it reported one."""
    rank_cost: RankCost | None = None
    """A LoRA site's measured step cost per rank (`subnet.measure.measure_rank_cost`), when it was asked."""
    memory_bytes: float = 0.0
    """Training memory the site declares; 0 = no limit."""
    experts: list[list[float]] = field(default_factory=list)
    """Mixture-of-experts models: per layer, per expert, the share of the site's tokens routed to it."""
    coactivation: list[list[list[float]]] = field(default_factory=list)
    """Per layer, the share of tokens routed to both experts i and j (symmetric; diagonal = `experts`)."""


def read_scores(
    reply: Message, weighted_by_key: str, arrays: ArrayRecord
) -> tuple[SiteScores, dict]:
    """A scoring reply as (scores, layout); KeyError/ValueError when it is malformed."""
    metrics, site = reply.content["metrics"], reply.content[protocol.SITE_RECORD]
    num_layers = sum(k.startswith(protocol.LAYER_PREFIX) for k in metrics)
    num_groups = sum(k.startswith(f"{protocol.HEAD_PREFIX}0-") for k in metrics)
    names, layers, axes, units = (
        site[key]
        for key in (
            protocol.LAYOUT_NAMES,
            protocol.LAYOUT_LAYERS,
            protocol.LAYOUT_AXES,
            protocol.LAYOUT_UNITS,
        )
    )
    layout = dict(zip(names, zip(layers, axes, units, strict=True), strict=True))
    if set(layout) != set(arrays) or not num_layers or not num_groups:
        raise ValueError(
            "its layout does not name the global arrays, or it has no layer/head scores"
        )
    heads = [
        [float(metrics[f"{protocol.HEAD_PREFIX}{layer}-{g}"]) for g in range(num_groups)]
        for layer in range(num_layers)
    ]
    cost = None
    if f"{protocol.COST_PREFIX}fixed-s" in metrics:
        cost = LayerCost(
            **{
                f: float(metrics[f"{protocol.COST_PREFIX}{f.replace('_', '-')}"])
                for f in COST_FIELDS
            }
        )
    rank_cost = None
    if f"{protocol.RANK_COST_PREFIX}fixed-s" in metrics:
        rank_cost = RankCost(
            **{
                f: float(metrics[f"{protocol.RANK_COST_PREFIX}{f.replace('_', '-')}"])
                for f in RANK_COST_FIELDS
            }
        )
    experts, coactivation = _expert_scores(metrics, num_layers)
    scores = SiteScores(
        experts=experts,
        coactivation=coactivation,
        layers=[float(metrics[f"{protocol.LAYER_PREFIX}{layer}"]) for layer in range(num_layers)],
        heads=heads,
        weight=float(metrics[weighted_by_key]),
        tier=str(site[protocol.TIER]),
        cost=cost,
        rank_cost=rank_cost,
        memory_bytes=float(metrics.get(protocol.MEMORY_BYTES, 0.0)),
    )
    return scores, layout


def _expert_scores(
    metrics: Mapping[str, Any], num_layers: int
) -> tuple[list[list[float]], list[list[list[float]]]]:
    """Routed shares and co-activation of a scoring reply (empty for a model without experts)."""
    num_experts = sum(k.startswith(f"{protocol.EXPERT_PREFIX}0-") for k in metrics)
    if not num_experts:
        return [], []
    routed = [
        [float(metrics[f"{protocol.EXPERT_PREFIX}{layer}-{e}"]) for e in range(num_experts)]
        for layer in range(num_layers)
    ]
    co = [[[0.0] * num_experts for _ in range(num_experts)] for _ in range(num_layers)]
    for layer in range(num_layers):
        for i in range(num_experts):
            co[layer][i][i] = routed[layer][i]
            for j in range(i + 1, num_experts):
                value = float(metrics.get(f"{protocol.COACTIVATION_PREFIX}{layer}-{i}-{j}", 0.0))
                co[layer][i][j] = co[layer][j][i] = value
    if not all(math.isfinite(v) and v >= 0 for row in routed for v in row):
        raise ValueError("its expert scores are not finite non-negative numbers")
    return routed, co


class SitePlanner:
    """Scores, ranking and layout from the planning round, and each site's Hydra-net budget."""

    def __init__(
        self,
        *,
        tiers: Mapping[str, tuple[float, float]] = TIER_BUDGETS,
        untiered: tuple[float, float] = (1.0, 1.0),
        rescore_every: int = 0,
        timeout_s: float | None = None,
        local_steps: int = 1,
        scoring: Mapping[str, int | str | bool] | None = None,
    ) -> None:
        if rescore_every < 0 or not all(
            0 < f <= 1 for budget in (*tiers.values(), untiered) for f in budget
        ):
            raise ValueError(
                f"planning needs rescore_every >= 0 and budget fractions in (0, 1], got {tiers=}, {untiered=}"
            )
        self.tiers, self.untiered = dict(tiers), untiered
        self.rescore_every, self.timeout_s, self.local_steps = rescore_every, timeout_s, local_steps
        self.scoring = dict(scoring or {})
        """Config keys of the scoring query (`protocol.SCORE_SAMPLES`, ...): how sites score."""
        self.layout: dict[str, tuple[int, int, int]] = {}
        self.ranking: list[int] = []
        self.site_scores: dict[int, SiteScores] = {}
        self._asked: ArrayRecord | None = None

    def due(self, server_round: int) -> bool:
        """Score before the first round trained, then every `rescore_every` rounds."""
        return not self.ranking or bool(
            self.rescore_every and (server_round - 1) % self.rescore_every == 0
        )

    def queries(
        self, arrays: ArrayRecord, config: ConfigRecord, nodes: Iterable[int]
    ) -> list[Message]:
        """One scoring query per node, on `arrays` (the tensors the sites' layouts must name)."""
        self._asked = arrays
        content = RecordDict({"arrays": arrays, "config": ConfigRecord({**config, **self.scoring})})
        return [
            Message(content, dst_node_id=node, message_type=protocol.QUERY_SCORES)
            for node in sorted(nodes)
        ]

    def take_replies(self, replies: Iterable[Message], weighted_by_key: str) -> None:
        """Keep every usable reply's scores (a malformed one is logged and skipped) and rank the layers."""
        arrays, self.site_scores = self._asked, {}
        for reply in replies:
            node = reply.metadata.src_node_id
            try:
                if reply.has_error():
                    raise ValueError(reply.error.reason)
                scores, self.layout = read_scores(reply, weighted_by_key, arrays)
            except (KeyError, ValueError, TypeError) as error:
                log.warning("planning: site %d gave no usable scores: %s", node, error)
                continue
            if scores.tier and scores.tier not in self.tiers:
                raise ScoringError(
                    f"site {node} declares tier {scores.tier!r}; known tiers: {', '.join(self.tiers)}"
                )
            self.site_scores[node] = scores
        if not self.site_scores:
            raise ScoringError("no site answered the scoring query usably; cannot build Hydra-nets")
        self.ranking = combine_layer_scores(
            [(s.layers, s.weight) for s in self.site_scores.values()]
        )

    def planned(self, sampled: Iterable[Message], strategy: str) -> Iterator[Message]:
        """The sampled train messages of the sites that took part in the planning round; a site that missed it
        is logged and left out of the round."""
        for message in sampled:
            if message.metadata.dst_node_id in self.site_scores:
                yield message
            else:
                log.warning(
                    "%s: site %d missed the planning round; not training it",
                    strategy,
                    message.metadata.dst_node_id,
                )

    def hydra_spec(
        self, node: int, *, bypass: bool = False, freeze_heads: bool = True, fitted: bool = True
    ) -> SubnetSpec:
        """Top layers of the global ranking and, in each, the site's top heads, as many as its tier affords and,
        when it declared memory or the round has a deadline (and `fitted`), as many as fit them (`plan_budget`
        on the step cost the site measured: then, unless bypassed, among the top layers that fit, since a
        frozen layer above a trained one holds its activations too). KeyError: the node missed the planning
        round; BudgetError: nothing fits."""
        scores = self.site_scores[node]
        layer_fraction, head_fraction = self.tiers[scores.tier] if scores.tier else self.untiered
        num_layers = max(1, math.ceil(layer_fraction * len(self.ranking) - 1e-9))
        num_heads = max(1, math.ceil(head_fraction * len(scores.heads[0]) - 1e-9))
        ranking = self.ranking
        if fitted and scores.cost is not None and (scores.memory_bytes > 0 or self.timeout_s):
            # frozen heads still run forward and backward: keeping fewer saves neither time nor memory
            cost = (
                dataclasses.replace(scores.cost, head_fraction=0.0) if freeze_heads else scores.cost
            )
            try:
                budget = plan_budget(
                    cost,
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
            if (
                not bypass
            ):  # the backward pass runs from the top down to the lowest trained layer, so
                # what fits is the top `budget.layers` layers (the cost was measured on them), best-ranked
                ranking = [layer for layer in ranking if layer >= len(ranking) - budget.layers]
        return build_spec(
            ranking,
            num_layers,
            scores.heads,
            num_heads,
            bypass=bypass,
            freeze_heads=freeze_heads,
        )

    def has_experts(self, node: int) -> bool:
        """Whether the node scored experts (the model is a mixture of experts)."""
        return bool(self.site_scores[node].experts)

    def expert_spec(
        self,
        node: int,
        *,
        selection: str,
        untiered: float,
        server_round: int,
        freeze_heads: bool = True,
    ) -> SubnetSpec:
        """Every layer and head and, in each layer, the experts its tier affords (`EXPERT_BUDGETS`, else
        `untiered`), chosen by `selection` (`EXPERT_SELECTIONS`) from the node's own routing. Groups are as
        large as the router's top-k (the routed shares of a layer sum to it); "random" draws anew each round.
        KeyError: the node missed the planning round."""
        scores = self.site_scores[node]
        fraction = EXPERT_BUDGETS[scores.tier] if scores.tier in EXPERT_BUDGETS else untiered
        num_experts = len(scores.experts[0])
        k = max(1, math.ceil(fraction * num_experts - 1e-9))
        draw = random.Random(node * 1_000_003 + server_round)
        experts = []
        for routed, co in zip(scores.experts, scores.coactivation, strict=True):
            if selection == "random":
                experts.append(tuple(draw.sample(range(num_experts), k)))
            elif selection == "routed":
                experts.append(select_experts(routed, k))
            else:
                groups = coactivation_groups(co, max(1, round(sum(routed))))
                experts.append(select_experts(routed, k, groups))
        return SubnetSpec(
            layers=tuple(range(len(self.ranking))),
            experts=tuple(experts),
            freeze_heads=freeze_heads,
        )

    def rank_limit(self, node: int, max_rank: int) -> int:
        """The largest LoRA rank (up to `max_rank`) whose measured step cost fits the node's declared memory and
        the round deadline (`fit_rank`); `max_rank` when neither limits it. BudgetError: not even rank 1 fits."""
        scores = self.site_scores[node]
        if scores.rank_cost is None or not (scores.memory_bytes > 0 or self.timeout_s):
            return max_rank
        try:
            return fit_rank(
                scores.rank_cost,
                max_rank=max_rank,
                memory_bytes=scores.memory_bytes or math.inf,
                deadline_s=self.timeout_s or math.inf,
                local_steps=self.local_steps,
            )
        except ValueError as error:
            raise BudgetError(str(error)) from error

    def budget(
        self, node: int, shapes: Mapping[str, tuple[int, ...]], *, fitted: bool = True
    ) -> int:
        """The coordinates a Hydra-net of the node's tier trains (fitted to its memory and the deadline, or
        not): what the width and LoRA baselines match."""
        spec = self.hydra_spec(node, fitted=fitted)
        return sum(sl.numel(shapes[name]) for name, sl in layout_slices(self.layout, spec).items())

    _STATE = ("layout", "ranking", "site_scores")

    def state_dict(self) -> dict[str, Any]:
        return {key: copy.deepcopy(getattr(self, key)) for key in self._STATE}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in self._STATE:
            setattr(self, key, copy.deepcopy(state[key]))
