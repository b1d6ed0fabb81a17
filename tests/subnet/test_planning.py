"""Coordinator side: sample-weighted layer rankings, head selections, specs, and budgets worked out by hand."""

from __future__ import annotations

import math

import pytest

from hydrafl.subnet.planning import (
    LayerCost,
    build_spec,
    combine_layer_scores,
    global_layer_scores,
    plan_budget,
    select_heads,
)
from hydrafl.subnet.spec import SubnetSpec


def test_combine_layer_scores_is_sample_weighted():
    sites = [([1.0, 3.0, 2.0], 10), ([4.0, 0.0, 1.0], 30)]
    assert global_layer_scores(sites) == pytest.approx(
        [3.25, 0.75, 1.25]
    )  # (10*1+30*4)/40, (30+0)/40, (20+30)/40
    assert combine_layer_scores(sites) == [0, 2, 1]
    # a site with a larger loss scale dominates raw sums; `normalize` compares shapes instead
    sites = [([0.0, 6.0, 0.0], 10), ([10.0, 0.0, 90.0], 10)]
    assert combine_layer_scores(sites) == [2, 0, 1]  # [5, 3, 45]
    assert global_layer_scores(sites, normalize=True) == pytest.approx([0.05, 0.5, 0.45])
    assert combine_layer_scores(sites, normalize=True) == [1, 2, 0]
    assert combine_layer_scores([([1.0, 1.0, 0.0], 1)]) == [0, 1, 2]  # ties: lower index first
    with pytest.raises(ValueError, match="site 1 sent 2 layer scores, expected 3"):
        combine_layer_scores([([1.0, 2.0, 3.0], 1), ([1.0, 2.0], 1)])
    with pytest.raises(ValueError, match="site 0 has sample weight 0"):
        combine_layer_scores([([1.0], 0)])
    with pytest.raises(ValueError, match="non-finite"):
        combine_layer_scores([([math.nan], 1)])


def test_select_heads_and_build_spec():
    assert select_heads([0.1, 0.5, 0.3, 0.5], 2) == (1, 3)
    assert select_heads([0.1, 0.5, 0.3, 0.5], 3) == (1, 2, 3)
    with pytest.raises(ValueError, match=r"k must be in 1..4, got 0"):
        select_heads([0.1, 0.5, 0.3, 0.5], 0)
    head_scores = [[0.9, 0.1], [0.2, 0.3], [0.0, 0.4]]
    spec = build_spec([2, 0, 1], 2, head_scores, 1, bypass=True)
    assert spec == SubnetSpec(layers=(0, 2), heads=((0,), (1,)), bypass=True)
    assert build_spec([2, 0, 1], 1) == SubnetSpec(layers=(2,))


def test_plan_budget_hand_examples():
    cost = LayerCost(
        fixed_s=0.1, per_layer_s=0.2, fixed_bytes=100, per_layer_bytes=50, head_fraction=0.5
    )
    common = dict(num_layers=4, num_groups=4, local_steps=10)
    # fast site, roomy: everything fits (w = 4 -> 0.9 s/step, 300 bytes)
    big = plan_budget(cost, memory_bytes=1000, speed=1.0, deadline_s=10.0, **common)
    assert (big.layers, big.heads) == (4, 4)
    assert big.step_s == pytest.approx(0.9) and big.memory_bytes == pytest.approx(300)
    # half-speed site: (0.1 + 0.2 w) / 0.5 * 10 <= 10.5  ->  w <= 2.125:
    # (2 layers, 4 heads) w = 2 beats (3, 1) w = 1.875
    slow = plan_budget(cost, memory_bytes=1000, speed=0.5, deadline_s=10.5, **common)
    assert (slow.layers, slow.heads) == (2, 4) and slow.step_s == pytest.approx(1.0)
    # small memory: 100 + 50 w <= 190  ->  w <= 1.8: (2, 3) with w = 2 * (0.5 + 0.5 * 3/4) = 1.75
    small = plan_budget(cost, memory_bytes=190, speed=1.0, deadline_s=10.0, **common)
    assert (small.layers, small.heads) == (2, 3) and small.memory_bytes == pytest.approx(187.5)
    # equal work: more layers win ((4, 2) over (2, 4) when all cost scales with heads)
    flat = LayerCost(
        fixed_s=0.0, per_layer_s=1.0, fixed_bytes=0, per_layer_bytes=0, head_fraction=1.0
    )
    tie = plan_budget(
        flat, memory_bytes=1, speed=1.0, deadline_s=2.0, num_layers=4, num_groups=4, local_steps=1
    )
    assert (tie.layers, tie.heads) == (4, 2)
    with pytest.raises(ValueError, match="no Hydra-net fits: 1 layer / 1 head needs"):
        plan_budget(cost, memory_bytes=100, speed=1.0, deadline_s=10.0, **common)
