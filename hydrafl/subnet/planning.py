"""What the coordinator does with the sites' scores and costs: a global layer ranking, each site's heads, the
resulting `SubnetSpec`, and the largest Hydra-net a site's measured step cost lets it train (`plan_budget`).

Pure arithmetic on a few floats per site: no model, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hydrafl.subnet.spec import SubnetSpec


def global_layer_scores(
    site_scores: Sequence[tuple[Sequence[float], float]], *, normalize: bool = False
) -> list[float]:
    """S_l = sum_k n_k s_l^(k) / sum_k n_k. `normalize` first divides each site's vector by its sum, so a site
    whose loss scale is larger does not dominate (off by default, as in the design notes)."""
    if not site_scores:
        raise ValueError("no site scores to combine")
    length = len(site_scores[0][0])
    total_n = 0.0
    combined = [0.0] * length
    for k, (scores, n) in enumerate(site_scores):
        if len(scores) != length:
            raise ValueError(f"site {k} sent {len(scores)} layer scores, expected {length}")
        if not n > 0:
            raise ValueError(f"site {k} has sample weight {n}; weights must be > 0")
        if not all(math.isfinite(s) and s >= 0 for s in scores):
            raise ValueError(f"site {k} sent non-finite or negative scores: {list(scores)}")
        scale = sum(scores) if normalize else 1.0
        scale = scale if scale > 0 else 1.0
        for layer, s in enumerate(scores):
            combined[layer] += n * s / scale
        total_n += n
    return [c / total_n for c in combined]


def combine_layer_scores(
    site_scores: Sequence[tuple[Sequence[float], float]], *, normalize: bool = False
) -> list[int]:
    """Global layer ranking (most important first; ties to the lower index) from (scores, n_samples) per site."""
    combined = global_layer_scores(site_scores, normalize=normalize)
    return sorted(range(len(combined)), key=lambda layer: (-combined[layer], layer))


def select_heads(scores: Sequence[float], k: int) -> tuple[int, ...]:
    """Indices of the k highest-scoring heads (KV groups), ascending; ties go to the lower index."""
    if not 1 <= k <= len(scores):
        raise ValueError(f"k must be in 1..{len(scores)}, got {k}")
    order = sorted(range(len(scores)), key=lambda h: (-scores[h], h))
    return tuple(sorted(order[:k]))


def build_spec(
    ranking: Sequence[int],
    num_layers: int,
    head_scores: Sequence[Sequence[float]] | None = None,
    heads_per_layer: int | None = None,
    **kwargs: Any,
) -> SubnetSpec:
    """Top-`num_layers` layers of the global ranking (nested across sites), and in each the site's top
    `heads_per_layer` heads by its own `head_scores[layer]` (all heads when either is None)."""
    if not 1 <= num_layers <= len(ranking):
        raise ValueError(f"num_layers must be in 1..{len(ranking)}, got {num_layers}")
    layers = tuple(sorted(ranking[:num_layers]))
    heads = None
    if head_scores is not None and heads_per_layer is not None:
        heads = tuple(select_heads(head_scores[layer], heads_per_layer) for layer in layers)
    return SubnetSpec(layers=layers, heads=heads, **kwargs)


def coactivation_groups(
    coactivation: Sequence[Sequence[float]], size: int
) -> list[tuple[int, ...]]:
    """Experts that fire together, grouped: start from one group per expert and merge, again and again, the two
    groups with the highest average co-activation between their members (sum of C[i][j] over i in A, j in B,
    over |A| |B|) whose union has at most `size` experts; stop when no pair with co-activation > 0 is left.
    Ties go to the pair that comes first (groups ordered by their lowest expert). Sorted by lowest expert."""
    if size < 1:
        raise ValueError(f"group size must be >= 1, got {size}")
    groups: list[tuple[int, ...]] = [(e,) for e in range(len(coactivation))]
    while True:
        best, best_link = None, 0.0
        for a in range(len(groups)):
            for b in range(a + 1, len(groups)):
                if len(groups[a]) + len(groups[b]) > size:
                    continue
                link = sum(coactivation[i][j] for i in groups[a] for j in groups[b])
                link /= len(groups[a]) * len(groups[b])
                if link > best_link:
                    best, best_link = (a, b), link
        if best is None:
            return groups
        a, b = best
        merged = tuple(sorted(groups[a] + groups[b]))
        groups = sorted([g for i, g in enumerate(groups) if i not in best] + [merged])


def select_experts(
    routed: Sequence[float], k: int, groups: Sequence[Sequence[int]] | None = None
) -> tuple[int, ...]:
    """The `k` experts a site trains: whole groups (`coactivation_groups`) in order of their total routed
    share, the last one cut to its most-routed members; without groups the k most-routed experts. Ties go to
    the lower index. Ascending."""
    if not 1 <= k <= len(routed):
        raise ValueError(f"k must be in 1..{len(routed)}, got {k}")
    groups = groups if groups is not None else [(e,) for e in range(len(routed))]
    order = sorted(groups, key=lambda g: (-sum(routed[e] for e in g), min(g)))
    chosen: list[int] = []
    for group in order:
        members = sorted(group, key=lambda e: (-routed[e], e))
        chosen += members[: k - len(chosen)]
    return tuple(sorted(chosen))


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """Cost of one local step, measured on the reference device (speed 1.0).

    fixed_s / fixed_bytes: step time / peak memory with no trained layer (weights, embeddings, head, the
        forward of frozen layers, their activations).
    per_layer_s / per_layer_bytes: what each trained layer with all heads adds (backward, grads, optimizer
        state, stored activations).
    head_fraction: share of the per-layer cost that scales with the kept heads (q/k/v/o and attention; e.g.
        from FLOP counts: `subnet.counts.forward_flops`); the rest (FFN, norms) does not.
    """

    fixed_s: float
    per_layer_s: float
    fixed_bytes: float
    per_layer_bytes: float
    head_fraction: float = 0.35

    def __post_init__(self) -> None:
        if min(self.fixed_s, self.per_layer_s, self.fixed_bytes, self.per_layer_bytes) < 0:
            raise ValueError("costs must be >= 0")
        if not 0.0 <= self.head_fraction <= 1.0:
            raise ValueError(f"head_fraction must be in [0, 1], got {self.head_fraction}")

    def work(self, layers: int, heads: int, num_groups: int) -> float:
        """Trained-layer equivalents: L * ((1 - f) + f * H / H_max)."""
        return layers * ((1.0 - self.head_fraction) + self.head_fraction * heads / num_groups)


COST_FIELDS = ("fixed_s", "per_layer_s", "fixed_bytes", "per_layer_bytes")
"""The measured LayerCost fields a site reports (as `cost.fixed-s`, ...) in its scores reply."""


@dataclass(frozen=True)
class Budget:
    """The Hydra-net `plan_budget` picks for a site: layers, heads per layer, and what it costs there."""

    layers: int
    heads: int
    step_s: float
    """Estimated step time on the site's device."""
    memory_bytes: float
    """Estimated peak memory."""


def plan_budget(
    cost: LayerCost,
    *,
    num_layers: int,
    num_groups: int,
    memory_bytes: float,
    speed: float,
    deadline_s: float,
    local_steps: int,
) -> Budget:
    """Largest Hydra-net (layers L, heads per layer H) that fits a site.

    Model: w = L * ((1 - f) + f * H / H_max) trained-layer equivalents;
        step_s = (fixed_s + w * per_layer_s) / speed;     memory = fixed_bytes + w * per_layer_bytes;
    feasible when local_steps * step_s <= deadline_s and memory <= memory_bytes. Picks the feasible (L, H)
    with the largest w, ties to more layers, then more heads. Raises ValueError when even (1 layer, 1 head)
    does not fit.
    """
    if speed <= 0 or deadline_s <= 0 or local_steps <= 0:
        raise ValueError("speed, deadline_s and local_steps must be > 0")
    best: Budget | None = None
    best_key = (-1.0, -1, -1)
    for layers in range(1, num_layers + 1):
        for heads in range(1, num_groups + 1):
            w = cost.work(layers, heads, num_groups)
            step_s = (cost.fixed_s + w * cost.per_layer_s) / speed
            mem = cost.fixed_bytes + w * cost.per_layer_bytes
            if local_steps * step_s <= deadline_s and mem <= memory_bytes:
                key = (round(w, 12), layers, heads)
                if key > best_key:
                    best_key, best = key, Budget(layers, heads, step_s, mem)
    if best is None:
        w = cost.work(1, 1, num_groups)
        need_s = local_steps * (cost.fixed_s + w * cost.per_layer_s) / speed
        need_bytes = cost.fixed_bytes + w * cost.per_layer_bytes
        raise ValueError(
            f"no Hydra-net fits: 1 layer / 1 head needs {need_s:.3g} s (deadline {deadline_s} s) "
            f"and {need_bytes:.4g} bytes (site has {memory_bytes})"
        )
    return best


@dataclass(frozen=True, kw_only=True)
class RankCost:
    """Cost of one local step of a LoRA site that trains every layer at rank r, measured on the reference
    device (speed 1.0): step_s = fixed_s + r * per_rank_s, memory = fixed_bytes + r * per_rank_bytes (weights,
    the backward through every layer and the head are the fixed part; factors, their gradients, optimizer
    state and rank-r activations grow with r)."""

    fixed_s: float
    per_rank_s: float
    fixed_bytes: float
    per_rank_bytes: float

    def __post_init__(self) -> None:
        if min(self.fixed_s, self.per_rank_s, self.fixed_bytes, self.per_rank_bytes) < 0:
            raise ValueError("costs must be >= 0")


RANK_COST_FIELDS = ("fixed_s", "per_rank_s", "fixed_bytes", "per_rank_bytes")
"""The measured RankCost fields a site reports (as `rank-cost.fixed-s`, ...) when the scoring query asks."""


def fit_rank(
    cost: RankCost, *, max_rank: int, memory_bytes: float, deadline_s: float, local_steps: int
) -> int:
    """Largest LoRA rank r in 1..max_rank with fixed_bytes + r * per_rank_bytes <= memory_bytes and
    local_steps * (fixed_s + r * per_rank_s) <= deadline_s: what a LoRA baseline's site affords, as
    `plan_budget` is what a Hydra-net affords. Raises ValueError when not even rank 1 fits."""
    if max_rank < 1 or deadline_s <= 0 or local_steps <= 0:
        raise ValueError("max_rank, deadline_s and local_steps must be > 0")
    fits = [
        r
        for r in range(1, max_rank + 1)
        if cost.fixed_bytes + r * cost.per_rank_bytes <= memory_bytes
        and local_steps * (cost.fixed_s + r * cost.per_rank_s) <= deadline_s
    ]
    if not fits:
        raise ValueError(
            f"no LoRA rank fits: rank 1 needs {local_steps * (cost.fixed_s + cost.per_rank_s):.3g} s "
            f"(deadline {deadline_s} s) and {cost.fixed_bytes + cost.per_rank_bytes:.4g} bytes "
            f"(site has {memory_bytes})"
        )
    return fits[-1]


__all__ = [
    "COST_FIELDS",
    "Budget",
    "LayerCost",
    "RANK_COST_FIELDS",
    "RankCost",
    "build_spec",
    "coactivation_groups",
    "combine_layer_scores",
    "fit_rank",
    "global_layer_scores",
    "plan_budget",
    "select_experts",
    "select_heads",
]
