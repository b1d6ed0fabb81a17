"""Hydra over LoRA: the masked mean of the products B A, factored back to the run's rank, by hand; each round set
up through the strategy's hooks (a planning round of crafted scoring replies, then its train messages)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord
from helpers import configure_round, make_reply, make_scores_reply, sent_specs

from hydrafl.config import RunConfig
from hydrafl.lora_pairs import lora_pairs
from hydrafl.strategies import AggregationError, Hydra, build_strategy
from hydrafl.strategies.lora_factors import MaskedProductAccumulator, product_slice
from hydrafl.strategies.outer import OuterOptimizer
from hydrafl.strategies.planner import SitePlanner
from hydrafl.subnet.slices import Slice, layout_slices
from hydrafl.subnet.spec import SubnetSpec

RANK = 4
Q_A, Q_B = (
    "l0.q.lora_A.default.weight",
    "l0.q.lora_B.default.weight",
)  # q-like: B's rows are cut by head
O_A, O_B = (
    "l0.o.lora_A.default.weight",
    "l0.o.lora_B.default.weight",
)  # o-like: A's columns are cut by head
L1_A, L1_B = (
    "l1.q.lora_A.default.weight",
    "l1.q.lora_B.default.weight",
)  # layer 1: no site trains it
HEAD = "classifier.weight"
# (layer, head axis, indices per head): two heads of two rows (q) or columns (o) each
LAYOUT = {
    Q_A: (0, -1, 2),
    Q_B: (0, 0, 2),
    O_A: (0, 1, 2),
    O_B: (0, -1, 2),
    L1_A: (1, -1, 2),
    L1_B: (1, 0, 2),
    HEAD: (-1, -1, 1),
}
rng = np.random.default_rng(0)
START = {
    Q_A: rng.normal(size=(RANK, 3)),
    Q_B: rng.normal(size=(4, RANK)),
    O_A: rng.normal(size=(RANK, 4)),
    O_B: rng.normal(size=(4, RANK)),
    L1_A: rng.normal(size=(RANK, 3)),
    L1_B: rng.normal(size=(4, RANK)),
    HEAD: rng.normal(size=(2, 4)),
}
START = {name: value.astype(np.float32) for name, value in START.items()}
# What the planning round assigns (`_scores`); Hydra keeps the other heads running, frozen.
SMALL = SubnetSpec(
    layers=(0,), heads=((0,),), freeze_heads=True
)  # head 0 of layer 0: q's B rows 0-1, o's A cols 0-1
LARGE = SubnetSpec(layers=(0,), heads=((0, 1),), freeze_heads=True)  # all of layer 0
TIERS = {"one-head": (0.5, 0.5), "two-heads": (0.5, 1.0)}
"""The budgets of the sites here: the top layer and one, or both, of its heads."""
SMALL_DELTA = {
    Q_A: rng.normal(size=(RANK, 3)),
    Q_B: rng.normal(size=(2, RANK)),
    O_A: rng.normal(size=(RANK, 2)),
    O_B: rng.normal(size=(4, RANK)),
    HEAD: rng.normal(size=(2, 4)),
}
LARGE_DELTA = {
    Q_A: rng.normal(size=(RANK, 3)),
    Q_B: rng.normal(size=(4, RANK)),
    O_A: rng.normal(size=(RANK, 4)),
    O_B: rng.normal(size=(4, RANK)),
    HEAD: rng.normal(size=(2, 4)),
}
N_SMALL, N_LARGE = 10, 30


def _hydra(**kwargs) -> Hydra:
    return Hydra(planner=SitePlanner(tiers=TIERS), **kwargs)


def _scores(layout, num_layers: int, tiers=("one-head", "two-heads")) -> dict:
    """Nodes 1, 2, ... of `tiers` (by default node 1 affords one head, node 2 both); all rank layer 0 and head 0
    first."""
    layers, heads = (
        [float(num_layers - layer) for layer in range(num_layers)],
        [[2.0, 1.0]] * num_layers,
    )
    return {
        node: make_scores_reply(node, layout, layers=layers, heads=heads, tier=tier)
        for node, tier in enumerate(tiers, start=1)
    }


def _aggregate(
    strategy: Hydra, start: dict[str, np.ndarray] = START, server_round: int = 1
) -> dict[str, np.ndarray]:
    """One round: node 1 is sent SMALL, node 2 LARGE, and they reply with SMALL_DELTA and LARGE_DELTA."""
    arrays = ArrayRecord({k: Array(v) for k, v in start.items()})
    messages = configure_round(strategy, server_round, arrays, _scores(LAYOUT, 2))
    assert sent_specs(messages) == {1: SMALL, 2: LARGE}
    replies = [
        make_reply(SMALL_DELTA, N_SMALL, node_id=1),
        make_reply(LARGE_DELTA, N_LARGE, node_id=2),
    ]
    new, _ = strategy.aggregate_train(server_round, iter(replies))
    return {name: array.numpy() for name, array in new.items()}


def _end(
    name: str,
    delta: np.ndarray,
    rows: slice = slice(None),
    columns: slice = slice(None),
    start: dict = START,
) -> np.ndarray:
    end = start[name].astype(np.float64)
    end[rows, columns] -= delta
    return end


def _mean_q_step(start: dict[str, np.ndarray]) -> np.ndarray:
    """B0 A0 minus the masked mean of the sites' end products of q, by hand (the pseudo-gradient of B A)."""
    small = _end(Q_B, SMALL_DELTA[Q_B], rows=slice(0, 2), start=start) @ _end(
        Q_A, SMALL_DELTA[Q_A], start=start
    )
    large = _end(Q_B, LARGE_DELTA[Q_B], start=start) @ _end(Q_A, LARGE_DELTA[Q_A], start=start)
    mean = large.copy()
    mean[:2] = (N_SMALL * small[:2] + N_LARGE * large[:2]) / (N_SMALL + N_LARGE)
    return start[Q_B].astype(np.float64) @ start[Q_A] - mean


def test_products_are_averaged_over_the_heads_each_site_ran_and_factored_back_to_the_rank():
    new = _aggregate(_hydra())

    # q: the small site's product counts on head 0's rows only, the large site's everywhere
    start_q = START[Q_B].astype(np.float64) @ START[Q_A]
    small_q = _end(Q_B, SMALL_DELTA[Q_B], rows=slice(0, 2)) @ _end(Q_A, SMALL_DELTA[Q_A])
    large_q = _end(Q_B, LARGE_DELTA[Q_B]) @ _end(Q_A, LARGE_DELTA[Q_A])
    expected_q = large_q.copy()
    expected_q[:2] = (N_SMALL * small_q[:2] + N_LARGE * large_q[:2]) / (N_SMALL + N_LARGE)
    # out 4 x in 3 has rank <= 3 < RANK: factoring back is exact
    np.testing.assert_allclose(new[Q_B] @ new[Q_A], expected_q, atol=1e-5)
    np.testing.assert_allclose(
        start_q - _mean_q_step(START), expected_q
    )  # the helper the outer-step test uses

    # o: the small site counts on head 0's columns only
    small_o = _end(O_B, SMALL_DELTA[O_B]) @ _end(O_A, SMALL_DELTA[O_A], columns=slice(0, 2))
    large_o = _end(O_B, LARGE_DELTA[O_B]) @ _end(O_A, LARGE_DELTA[O_A])
    expected_o = large_o.copy()
    expected_o[:, :2] = (N_SMALL * small_o[:, :2] + N_LARGE * large_o[:, :2]) / (N_SMALL + N_LARGE)
    np.testing.assert_allclose(new[O_B] @ new[O_A], expected_o, atol=1e-5)

    # the factors come back as B = U S, A = V^T (orthonormal rows)
    np.testing.assert_allclose(new[O_A] @ new[O_A].T, np.eye(RANK), atol=1e-5)
    # a module no site trained keeps its factors bit for bit; other arrays take the masked mean
    np.testing.assert_array_equal(new[L1_A], START[L1_A])
    np.testing.assert_array_equal(new[L1_B], START[L1_B])
    expected_head = START[HEAD] - (N_SMALL * SMALL_DELTA[HEAD] + N_LARGE * LARGE_DELTA[HEAD]) / (
        N_SMALL + N_LARGE
    )
    np.testing.assert_allclose(new[HEAD], expected_head, rtol=1e-5)


def test_averaging_the_factors_apart_is_what_products_avoid():
    """With factors, B A is mean(B) mean(A): the cross terms move it off the mean product."""
    factors, products = _aggregate(_hydra(lora_products=False)), _aggregate(_hydra())
    gap = np.abs(factors[Q_B] @ factors[Q_A] - products[Q_B] @ products[Q_A]).max()
    assert gap > 0.1


def test_a_product_of_higher_rank_is_cut_to_its_best_rank_r_approximation():
    """8 x 8 products at rank 2: the averaged product (head 1's rows, which no site ran, at their start) has
    rank above 2, and what comes back is its best rank-2 approximation, so head 1's rows move only by that cut."""
    rank, q_a, q_b = 2, "m.q.lora_A.default.weight", "m.q.lora_B.default.weight"
    start = {
        q_a: rng.normal(size=(rank, 8)).astype(np.float32),
        q_b: rng.normal(size=(8, rank)).astype(np.float32),
    }
    deltas = [
        {q_a: rng.normal(size=(rank, 8)), q_b: rng.normal(size=(4, rank))}
        for _ in range(2)  # head 0: rows 0-3
    ]
    strategy = _hydra()
    scores = _scores({q_a: (0, -1, 4), q_b: (0, 0, 4)}, 1, tiers=("one-head", "one-head"))
    messages = configure_round(
        strategy, 1, ArrayRecord({k: Array(v) for k, v in start.items()}), scores
    )
    assert sent_specs(messages) == {1: SMALL, 2: SMALL}
    new, _ = strategy.aggregate_train(
        1,
        iter(
            [
                make_reply(d, n, node_id=i + 1)
                for i, (d, n) in enumerate(zip(deltas, (1, 3), strict=True))
            ]
        ),
    )
    new = {name: array.numpy() for name, array in new.items()}

    ends = [
        _end(q_b, d[q_b], rows=slice(0, 4), start=start) @ _end(q_a, d[q_a], start=start)
        for d in deltas
    ]
    expected = start[q_b].astype(np.float64) @ start[q_a]
    expected[:4] = (1 * ends[0][:4] + 3 * ends[1][:4]) / 4
    assert np.linalg.matrix_rank(expected) > rank
    u, s, vh = np.linalg.svd(expected)
    best = (u[:, :rank] * s[:rank]) @ vh[:rank]
    np.testing.assert_allclose(new[q_b] @ new[q_a], best, atol=1e-4)
    head_1_moved = np.abs(best[4:] - expected[4:]).max()
    assert 1e-3 < head_1_moved < np.abs(expected[4:]).max()


def test_outer_nesterov_runs_on_the_products_across_rounds_and_resumes():
    lr, momentum = 0.7, 0.9
    strategy = _hydra(outer=OuterOptimizer(lr=lr, momentum=momentum, nesterov=True))
    after_1 = _aggregate(strategy)
    d1 = _mean_q_step(START)
    p1 = START[Q_B].astype(np.float64) @ START[Q_A] - lr * (d1 + momentum * d1)  # buffer b1 = d1
    np.testing.assert_allclose(after_1[Q_B] @ after_1[Q_A], p1, atol=1e-4)  # rank 3 < 4: no cut
    assert sorted(strategy.state_dict()["momentum_buffer"]) == [
        HEAD,
        "l0.o.lora-product",
        "l0.q.lora-product",
    ]

    resumed = _hydra(outer=OuterOptimizer(lr=lr, momentum=momentum, nesterov=True))
    resumed.load_state_dict(strategy.state_dict())
    after_2 = _aggregate(resumed, start=after_1, server_round=2)
    d2 = _mean_q_step(after_1)
    b2 = momentum * d1 + d2
    p2 = after_1[Q_B].astype(np.float64) @ after_1[Q_A] - lr * (d2 + momentum * b2)
    np.testing.assert_allclose(after_2[Q_B] @ after_2[Q_A], p2, atol=1e-4)
    np.testing.assert_array_equal(after_2[L1_A], START[L1_A])  # untrained: no momentum leaks in


@pytest.mark.parametrize("name", ["heterofl", "fjord", "fedrolex"])
def test_width_baselines_keep_their_papers_coordinate_rule_over_lora(name):
    assert build_strategy(RunConfig(strategy=name, lora_rank=4)).lora_products is False
    assert build_strategy(RunConfig(strategy="hydra", lora_rank=4)).lora_products is True
    assert (
        build_strategy(
            RunConfig.build(strategy="hydra", lora_rank=4, hydra_lora="factors")
        ).lora_products
        is False
    )


def test_a_product_that_overflows_is_refused_by_name():
    start = {
        **START,
        Q_A: np.full((RANK, 3), 1e30, np.float32),
        Q_B: np.full((4, RANK), 1e30, np.float32),
    }
    with pytest.raises(AggregationError, match="product B A of 'l0.q' is not finite"):
        _aggregate(_hydra(), start=start)


def test_product_slice_of_a_sites_factor_slices():
    assert product_slice(Slice(None), Slice(0, (2, 3))) == Slice(0, (2, 3))
    assert product_slice(Slice(1, (0, 1)), Slice(None)) == Slice(1, (0, 1))
    assert product_slice(Slice(None), None) == Slice(None)
    with pytest.raises(AggregationError, match="both A and B"):
        product_slice(Slice(1, (0,)), Slice(0, (0,)))
    with pytest.raises(AggregationError, match="rank axis"):
        product_slice(Slice(0, (0,)), Slice(None))


def test_the_product_weights_are_a_vector_per_module_not_a_dense_matrix():
    """Sites mask whole rows (q) or columns (o), so the summed weights are a column (row) vector: the
    coordinator holds one dense sum per module, not two."""
    start = {name: torch.from_numpy(value) for name, value in START.items()}
    products = MaskedProductAccumulator(lora_pairs(start), start)
    for node, (spec, delta, n) in enumerate(
        [(SMALL, SMALL_DELTA, N_SMALL), (LARGE, LARGE_DELTA, N_LARGE)], 1
    ):
        products.add(make_reply(delta, n, node_id=node), layout_slices(LAYOUT, spec), float(n))
    torch.testing.assert_close(
        products.weights["l0.q"], torch.tensor([[40.0], [40.0], [30.0], [30.0]])
    )
    torch.testing.assert_close(products.weights["l0.o"], torch.tensor([[40.0, 40.0, 30.0, 30.0]]))
    assert "l1.q" not in products.weights
    means = products.mean()
    assert means["l0.q"][1].shape == (4, 3) and bool(means["l0.q"][1].all())
    np.testing.assert_allclose(means["l0.q"][0].numpy(), _mean_q_step(START), rtol=1e-5, atol=1e-6)
