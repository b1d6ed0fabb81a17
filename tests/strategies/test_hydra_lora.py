"""Hydra over LoRA: the masked mean of the products B A, factored back to the run's rank, by hand."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord
from helpers import make_reply

from hydrafl.config import RunConfig
from hydrafl.hydranet import Slice, SubnetSpec
from hydrafl.strategies import AggregationError, Hydra, build_strategy
from hydrafl.strategies.lora_factors import product_slice

RANK = 4
Q_A, Q_B = "l0.q.lora_A.default.weight", "l0.q.lora_B.default.weight"  # q-like: B's rows are cut by head
O_A, O_B = "l0.o.lora_A.default.weight", "l0.o.lora_B.default.weight"  # o-like: A's columns are cut by head
L1_A, L1_B = "l1.q.lora_A.default.weight", "l1.q.lora_B.default.weight"  # layer 1: no site trains it
HEAD = "classifier.weight"
# (layer, head axis, indices per head): two heads of two rows (q) or columns (o) each
LAYOUT = {
    Q_A: (0, -1, 2), Q_B: (0, 0, 2), O_A: (0, 1, 2), O_B: (0, -1, 2), L1_A: (1, -1, 2), L1_B: (1, 0, 2),
    HEAD: (-1, -1, 1),
}
rng = np.random.default_rng(0)
START = {
    Q_A: rng.normal(size=(RANK, 3)), Q_B: rng.normal(size=(4, RANK)),
    O_A: rng.normal(size=(RANK, 4)), O_B: rng.normal(size=(4, RANK)),
    L1_A: rng.normal(size=(RANK, 3)), L1_B: rng.normal(size=(4, RANK)),
    HEAD: rng.normal(size=(2, 4)),
}
START = {name: value.astype(np.float32) for name, value in START.items()}
SMALL = SubnetSpec(layers=(0,), heads=((0,),))  # head 0 of layer 0: q's B rows 0-1, o's A columns 0-1
LARGE = SubnetSpec(layers=(0,), heads=((0, 1),))  # all of layer 0
SMALL_DELTA = {
    Q_A: rng.normal(size=(RANK, 3)), Q_B: rng.normal(size=(2, RANK)),
    O_A: rng.normal(size=(RANK, 2)), O_B: rng.normal(size=(4, RANK)), HEAD: rng.normal(size=(2, 4)),
}
LARGE_DELTA = {
    Q_A: rng.normal(size=(RANK, 3)), Q_B: rng.normal(size=(4, RANK)),
    O_A: rng.normal(size=(RANK, 4)), O_B: rng.normal(size=(4, RANK)), HEAD: rng.normal(size=(2, 4)),
}
N_SMALL, N_LARGE = 10, 30


def _aggregate(strategy: Hydra) -> dict[str, np.ndarray]:
    strategy.layout, strategy.specs = dict(LAYOUT), {1: SMALL, 2: LARGE}
    strategy.current_arrays = ArrayRecord({k: Array(v) for k, v in START.items()})
    replies = [make_reply(SMALL_DELTA, N_SMALL, node_id=1), make_reply(LARGE_DELTA, N_LARGE, node_id=2)]
    new, _ = strategy.aggregate_train(1, iter(replies))
    return {name: array.numpy() for name, array in new.items()}


def _end(name: str, delta: np.ndarray, rows: slice = slice(None), columns: slice = slice(None)) -> np.ndarray:
    end = START[name].astype(np.float64)
    end[rows, columns] -= delta
    return end


def test_products_are_averaged_over_the_heads_each_site_ran_and_factored_back_to_the_rank():
    new = _aggregate(Hydra())

    # q: the small site's product counts on head 0's rows only, the large site's everywhere
    start_q = START[Q_B].astype(np.float64) @ START[Q_A]
    small_q = _end(Q_B, SMALL_DELTA[Q_B], rows=slice(0, 2)) @ _end(Q_A, SMALL_DELTA[Q_A])
    large_q = _end(Q_B, LARGE_DELTA[Q_B]) @ _end(Q_A, LARGE_DELTA[Q_A])
    expected_q = large_q.copy()
    expected_q[:2] = (N_SMALL * small_q[:2] + N_LARGE * large_q[:2]) / (N_SMALL + N_LARGE)
    # out 4 x in 3 has rank <= 3 < RANK: factoring back is exact
    np.testing.assert_allclose(new[Q_B] @ new[Q_A], expected_q, atol=1e-5)
    assert not np.allclose(expected_q, start_q)

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
    expected_head = START[HEAD] - (N_SMALL * SMALL_DELTA[HEAD] + N_LARGE * LARGE_DELTA[HEAD]) / (N_SMALL + N_LARGE)
    np.testing.assert_allclose(new[HEAD], expected_head, rtol=1e-5)


def test_averaging_the_factors_apart_is_what_products_avoid():
    """With factors, B A is mean(B) mean(A): the cross terms move it off the mean product."""
    factors, products = _aggregate(Hydra(lora_products=False)), _aggregate(Hydra())
    np.testing.assert_allclose(factors[L1_A], START[L1_A])
    gap = np.abs(factors[Q_B] @ factors[Q_A] - products[Q_B] @ products[Q_A]).max()
    assert gap > 0.1


def test_outer_step_in_product_space_with_lr_one_and_no_momentum_is_the_plain_mean():
    plain = _aggregate(Hydra())
    outer = _aggregate(Hydra(outer_lr=1.0, momentum=0.0, nesterov=True))
    np.testing.assert_array_equal(outer[Q_B] @ outer[Q_A], plain[Q_B] @ plain[Q_A])
    halved = _aggregate(Hydra(outer_lr=0.5))
    start_q = START[Q_B].astype(np.float64) @ START[Q_A]
    np.testing.assert_allclose(halved[Q_B] @ halved[Q_A], (start_q + plain[Q_B] @ plain[Q_A]) / 2, atol=1e-5)


@pytest.mark.parametrize("name", ["heterofl", "fjord", "fedrolex"])
def test_width_baselines_keep_their_papers_coordinate_rule_over_lora(name):
    assert build_strategy(RunConfig(strategy=name, lora_rank=4)).lora_products is False
    assert build_strategy(RunConfig(strategy="hydra", lora_rank=4)).lora_products is True
    assert build_strategy(RunConfig(strategy="hydra", lora_rank=4, hydra_lora="factors")).lora_products is False


def test_product_slice_of_a_sites_factor_slices():
    assert product_slice(Slice(None), Slice(0, (2, 3))) == Slice(0, (2, 3))
    assert product_slice(Slice(1, (0, 1)), Slice(None)) == Slice(1, (0, 1))
    assert product_slice(Slice(None), None) == Slice(None)
    with pytest.raises(AggregationError, match="both A and B"):
        product_slice(Slice(1, (0,)), Slice(0, (0,)))
    with pytest.raises(AggregationError, match="rank axis"):
        product_slice(Slice(0, (0,)), Slice(None))
