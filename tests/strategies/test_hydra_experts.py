"""Hydra on a mixture-of-experts model: the sites' routing picks their experts, and each expert is averaged over
the sites that trained it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord
from helpers import configure_round, make_reply, make_scores_reply, sent_specs

from hydrafl import protocol
from hydrafl.backbones import TinyShape, build_moe_lm
from hydrafl.strategies import Hydra
from hydrafl.strategies.planner import SitePlanner
from hydrafl.subnet.planning import coactivation_groups, select_experts
from hydrafl.subnet.scoring import expert_routing
from hydrafl.subnet.spec import SubnetSpec

EXPERTS = "model.layers.0.mlp.experts.down_proj"  # [experts=4, 2]
ROUTER = "model.layers.0.mlp.gate.weight"  # [experts=4, 1]
ATTENTION = "model.layers.0.self_attn.o_proj.weight"  # every site trains it whole
START = {
    EXPERTS: np.array([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [4.0, 4.0]]),
    ROUTER: np.array([[0.1], [0.2], [0.3], [0.4]]),
    ATTENTION: np.array([[5.0]]),
}
LAYOUT = {EXPERTS: (0, -1, 1), ROUTER: (0, -1, 1), ATTENTION: (0, -1, 1)}


def _scores(
    node: int,
    tier: str,
    routed: list[float],
    num_examples: float,
    coactivation: dict[tuple[int, int], float] | None = None,
):
    reply = make_scores_reply(
        node, LAYOUT, layers=[1.0], heads=[[1.0]], tier=tier, num_examples=num_examples
    )
    metrics = reply.content["metrics"]
    for e, share in enumerate(routed):
        metrics[f"{protocol.EXPERT_PREFIX}0-{e}"] = share
    for (i, j), share in (coactivation or {}).items():
        metrics[f"{protocol.COACTIVATION_PREFIX}0-{i}-{j}"] = share
    return reply


def test_each_expert_is_the_mean_over_the_sites_that_trained_it_by_hand():
    """Node 1 (small: 1 of 4 experts) routes most to expert 2; node 2 (medium: 2 of 4) to experts 2 and 0."""
    strategy = Hydra(planner=SitePlanner(), expert_select="routed")
    scores = {
        1: _scores(1, "small", [0.1, 0.2, 1.5, 0.2], 10),
        2: _scores(2, "medium", [0.7, 0.1, 0.9, 0.3], 30),
    }
    record = ArrayRecord({name: Array(value.astype(np.float32)) for name, value in START.items()})
    messages = configure_round(strategy, 1, record, scores)
    assert sent_specs(messages) == {
        1: SubnetSpec(layers=(0,), experts=((2,),), freeze_heads=True),
        2: SubnetSpec(layers=(0,), experts=((0, 2),), freeze_heads=True),
    }
    replies = [  # each site uploads its experts' rows only (and the router rows that select them)
        make_reply({EXPERTS: [[1.0, 2.0]], ROUTER: [[0.5]], ATTENTION: [[1.0]]}, 10, node_id=1),
        make_reply(
            {EXPERTS: [[3.0, 3.0], [4.0, 8.0]], ROUTER: [[0.2], [0.1]], ATTENTION: [[2.0]]},
            30,
            node_id=2,
        ),
    ]
    new, _ = strategy.aggregate_train(1, iter(replies))
    got = {name: array.numpy() for name, array in new.items()}
    expected_experts = [
        [1.0 - 3.0, 1.0 - 3.0],  # expert 0: node 2 alone
        [2.0, 2.0],  # expert 1: nobody trained it, unchanged
        [3.0 - (10 * 1.0 + 30 * 4.0) / 40, 3.0 - (10 * 2.0 + 30 * 8.0) / 40],  # both: 3.25, 6.5
        [4.0, 4.0],
    ]
    np.testing.assert_allclose(got[EXPERTS], expected_experts, rtol=1e-6)
    expected_router = [[0.1 - 0.2], [0.2], [0.3 - (10 * 0.5 + 30 * 0.1) / 40], [0.4]]
    np.testing.assert_allclose(got[ROUTER], expected_router, rtol=1e-6)
    np.testing.assert_allclose(got[ATTENTION], [[5.0 - (10 * 1.0 + 30 * 2.0) / 40]], rtol=1e-6)


@pytest.mark.parametrize(("selection", "expected"), [("coactivation", (0, 1)), ("routed", (0, 2))])
def test_a_site_reporting_coactivation_gets_the_pair_that_fires_together(selection, expected):
    """Routed shares 0.8, 0.5, 0.6, 0.1 of a top-2 router (they sum to 2: groups of 2); experts 0 and 1 fire
    together on 0.3 of the tokens, 0 and 2 on 0.2, so (0, 1) merge first and 2 and 3, never together, stay
    alone: the medium tier's 2 experts are the group (0, 1) (1.3 routed, ahead of (2,) 0.6), or one by one the
    two most-routed, 0 and 2."""
    strategy = Hydra(planner=SitePlanner(), expert_select=selection)
    co = {(0, 1): 0.3, (0, 2): 0.2}
    scores = {node: _scores(node, "medium", [0.8, 0.5, 0.6, 0.1], 10, co) for node in (1, 2)}
    record = ArrayRecord({name: Array(value.astype(np.float32)) for name, value in START.items()})
    specs = sent_specs(configure_round(strategy, 1, record, scores))
    assert specs[1].experts == specs[2].experts == (expected,)


def test_random_experts_take_the_same_budget_and_change_by_round():
    strategy = Hydra(planner=SitePlanner(), expert_select="random")
    record = ArrayRecord({name: Array(value.astype(np.float32)) for name, value in START.items()})
    scores = {node: _scores(node, "medium", [0.5, 0.5, 0.5, 0.5], 10) for node in (1, 2)}
    specs = [
        sent_specs(configure_round(strategy, r, record, scores))[1].experts[0] for r in range(1, 6)
    ]
    assert all(len(experts) == 2 for experts in specs)
    assert len(set(specs)) > 1


# Planted routing, 12 positions of one row: 4 tokens to experts (0, 1), 4 to (2, 3), 3 to (0, 2), and one
# padding position (target -100) to (4, 5), which is not counted.
PLANTED = [(0, 1)] * 4 + [(2, 3)] * 4 + [(0, 2)] * 3 + [(4, 5)]


def test_routing_shares_and_coactivation_groups_of_a_planted_pattern_by_hand():
    shape = TinyShape(hidden=8, layers=1, heads=2, intermediate=4, experts=6, experts_per_token=2)
    model = build_moe_lm(16, shape=shape, seed=0)
    router = model.get_submodule("model.layers.0.mlp.gate")
    planted = torch.tensor(PLANTED)
    hook = router.register_forward_hook(lambda m, args, out: (out[0], out[1], planted))
    x = torch.randint(3, 16, (1, 12))
    y = torch.cat([torch.randint(3, 16, (1, 11)), torch.tensor([[-100]])], dim=1)
    try:
        routed, co = expert_routing(model, [(x, y)])
    finally:
        hook.remove()
    np.testing.assert_allclose(routed[0], [7 / 11, 4 / 11, 7 / 11, 4 / 11, 0.0, 0.0])
    np.testing.assert_allclose(co[0][0][1], 4 / 11)
    np.testing.assert_allclose(co[0][0][2], 3 / 11)
    np.testing.assert_allclose(co[0][2][3], 4 / 11)
    np.testing.assert_allclose(co[0][1][2], 0.0)
    # (0, 1) and (2, 3) link at 4/11, ahead of (0, 2) at 3/11; pairs are full at the router's top-2
    groups = coactivation_groups(co[0], 2)
    assert groups == [(0, 1), (2, 3), (4,), (5,)]
    # both pairs route 11/11 in total: the tie goes to the lower expert; one by one, 0 and 2 route most
    assert select_experts(routed[0], 2, groups) == (0, 1)
    assert select_experts(routed[0], 2) == (0, 2)
    assert select_experts(routed[0], 3, groups) == (
        0,
        1,
        2,
    )  # then the most-routed member of (2, 3)


def test_average_linkage_merges_groups_up_to_the_size():
    co = [
        [0.0, 0.9, 0.1, 0.0],
        [0.9, 0.0, 0.5, 0.0],
        [0.1, 0.5, 0.0, 0.2],
        [0.0, 0.0, 0.2, 0.0],
    ]
    # (0, 1) at 0.9; then (0, 1) with 2 at (0.1 + 0.5) / 2 = 0.3 beats (2, 3) at 0.2
    assert coactivation_groups(co, 3) == [(0, 1, 2), (3,)]
    assert coactivation_groups(co, 2) == [(0, 1), (2, 3)]
    assert coactivation_groups([[0.0, 0.0], [0.0, 0.0]], 2) == [
        (0,),
        (1,),
    ]  # nothing fires together
    with pytest.raises(ValueError, match="k must be in 1..2"):
        select_experts([1.0, 2.0], 3)
