"""Hydra's masked aggregation against hand-computed numbers, its outer step, state, and slice layout."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from helpers import make_reply
from flwr.app import Array, ArrayRecord

from hydrafl.site_app import slice_layout
from hydrafl.config import RunConfig
from hydrafl.data import TaskSpec
from hydrafl.hydranet import SubnetSpec, trainable_slices
from hydrafl.model_zoo import TinyLlamaShape, build_causal_lm
from hydrafl.models import TinyShape, build_model
from hydrafl.hydranet import LayerCost
from hydrafl.strategies import AggregationError, Hydra, MaskedDeltaAccumulator, build_strategy, layout_slices
from hydrafl.strategies.hydra import BudgetError, SiteScores

# A toy "model": w is layer 0's q-like tensor, 4 head groups of one row each (axis 0, unit 1); v is layer 1,
# shared by its heads; o lies outside the layers.
LAYOUT = {"w": (0, 0, 1), "v": (1, -1, 1), "o": (-1, -1, 1)}
START = {
    "w": np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]], dtype=np.float32),
    "v": np.array([0.5, -0.5, 1.0], dtype=np.float32),
    "o": np.array([2.0, -2.0], dtype=np.float32),
}
SPEC_A = SubnetSpec(layers=(0,), heads=((0, 1),))  # w rows 0-1, o
SPEC_B = SubnetSpec(layers=(0, 1), heads=((1, 2), (0,)))  # w rows 1-2, v, o
DELTA_A = {  # sites send only their slices: A's rows 0-1 of w, and o
    "w": np.array([[0.1, 0.2], [0.4, 0.4]]),
    "o": np.array([1.0, 0.0]),
}
DELTA_B = {  # B's rows 1-2 of w, v and o
    "w": np.array([[0.8, 0.0], [0.3, -0.3]]),
    "v": np.array([0.2, 0.2, -0.4]),
    "o": np.array([-1.0, 2.0]),
}


def _record(arrays):
    return ArrayRecord({k: Array(np.asarray(v, dtype=np.float32)) for k, v in arrays.items()})


def _step(strategy: Hydra, arrays, replies, server_round=1):
    """One aggregation with A (node 1, 10 examples) and B (node 2, 30 examples) assigned SPEC_A / SPEC_B."""
    strategy.layout, strategy.specs = dict(LAYOUT), {1: SPEC_A, 2: SPEC_B}
    strategy.current_arrays = _record(arrays)
    messages = [make_reply(delta, n, node_id=i + 1) for i, (delta, n) in enumerate(replies)]
    new, metrics = strategy.aggregate_train(server_round, iter(messages))
    assert metrics is not None
    return {name: array.numpy() for name, array in new.items()}


def test_masked_mean_by_hand():
    new = _step(Hydra(), START, [(DELTA_A, 10), (DELTA_B, 30)])
    expected_w = np.array(
        [
            [1.0 - 0.1, 2.0 - 0.2],  # only A trained row 0
            [3.0 - (10 * 0.4 + 30 * 0.8) / 40, 4.0 - (10 * 0.4 + 30 * 0.0) / 40],  # both: weighted mean 0.7, 0.1
            [5.0 - 0.3, 6.0 + 0.3],  # only B
            [7.0, 8.0],  # nobody: unchanged
        ]
    )
    np.testing.assert_allclose(new["w"], expected_w, rtol=1e-6)
    np.testing.assert_allclose(new["v"], START["v"] - DELTA_B["v"], rtol=1e-6)  # only B
    np.testing.assert_allclose(new["o"], [2.0 - (10 - 30) / 40, -2.0 - 60 / 40], rtol=1e-6)  # [2.5, -3.5]
    np.testing.assert_array_equal(new["w"][3], START["w"][3])


def test_a_reply_that_is_not_its_sites_slice_is_refused():
    full_shape = {"w": np.zeros((4, 2)), "o": np.zeros(2)}  # A's w must be its two rows, not the whole tensor
    with pytest.raises(AggregationError, match=r"array 'w' has shape \(4, 2\), its slice is \(2, 2\)"):
        _step(Hydra(), START, [(full_shape, 10), (DELTA_B, 30)])
    strategy = Hydra()
    strategy.layout, strategy.specs = dict(LAYOUT), {1: SPEC_A, 2: SPEC_B}
    assert strategy.reply_shapes(1, _record(START)) == {"w": (2, 2), "o": (2,)}
    assert strategy.reply_shapes(2, _record(START)) == {"w": (2, 2), "v": (3,), "o": (2,)}


def test_accumulator_coverage_and_refusals():
    accumulator = MaskedDeltaAccumulator()
    masks = {"w": torch.tensor([True, False, True])}
    accumulator.add(make_reply({"w": np.array([1.0, 9.0, 3.0])}, 2, node_id=1), masks)
    accumulator.add(make_reply({"w": np.array([4.0, 9.0, 0.0])}, 1, node_id=2), {"w": torch.tensor([True, False, False])})
    mean, trained = accumulator.mean()["w"]
    np.testing.assert_allclose(mean.numpy(), [(2 * 1 + 4) / 3, 0.0, 3.0], rtol=1e-6)
    assert trained.tolist() == [True, False, True]
    with pytest.raises(AggregationError, match="outside its subnetwork"):
        MaskedDeltaAccumulator().add(make_reply({"u": np.zeros(3)}, 1), masks)
    with pytest.raises(AggregationError, match="shape"):
        MaskedDeltaAccumulator().add(make_reply({"w": np.zeros(2)}, 1), masks)
    with pytest.raises(AggregationError, match="no successful reply"):
        MaskedDeltaAccumulator().mean()


def test_nesterov_steps_trained_coordinates_like_torch_sgd_and_freezes_the_rest():
    lr, momentum = 0.5, 0.9
    strategy = Hydra(outer_lr=lr, momentum=momentum, nesterov=True)
    arrays = {k: v.copy() for k, v in START.items()}
    reference = torch.tensor(START["v"], requires_grad=True)  # only B trains v: its pseudo-gradient is B's delta
    optimizer = torch.optim.SGD([reference], lr=lr, momentum=momentum, nesterov=True)
    for server_round in (1, 2, 3):
        arrays = _step(strategy, arrays, [(DELTA_A, 10), (DELTA_B, 30)], server_round)
        reference.grad = torch.tensor(DELTA_B["v"], dtype=torch.float32)
        optimizer.step()
        np.testing.assert_allclose(arrays["v"], reference.detach().numpy(), rtol=1e-5)
        np.testing.assert_array_equal(arrays["w"][3], START["w"][3])
    assert float(strategy.momentum_buffer["w"][3].abs().sum()) == 0.0


def test_outer_nesterov_with_lr_one_and_no_momentum_equals_plain_hydra():
    plain = build_strategy(RunConfig(strategy="hydra", sites=2))
    outer = build_strategy(RunConfig(strategy="hydra", sites=2, outer="nesterov", outer_lr=1.0, outer_momentum=0.0))
    assert (outer.outer_lr, outer.momentum) == (1.0, 0.0)
    for server_round in (1, 2):
        a = _step(plain, START, [(DELTA_A, 10), (DELTA_B, 30)], server_round)
        b = _step(outer, START, [(DELTA_A, 10), (DELTA_B, 30)], server_round)
        for name in START:
            np.testing.assert_array_equal(a[name], b[name])


def test_the_run_config_wires_the_outer_optimizer_into_hydra():
    built = build_strategy(RunConfig(strategy="hydra", sites=2, outer="nesterov", outer_lr=0.7, outer_momentum=0.9))
    assert (built.outer_lr, built.momentum, built.nesterov) == (0.7, 0.9, True)
    assert (build_strategy(RunConfig(strategy="hydra", sites=2, outer_lr=0.7, outer_momentum=0.9)).outer_lr) == 1.0
    by_hand = Hydra(outer_lr=0.7, momentum=0.9, nesterov=True)
    for server_round in (1, 2):  # the momentum shows from the second round on
        a = _step(built, START, [(DELTA_A, 10), (DELTA_B, 30)], server_round)
        b = _step(by_hand, START, [(DELTA_A, 10), (DELTA_B, 30)], server_round)
        for name in START:
            np.testing.assert_array_equal(a[name], b[name])


def test_state_dict_round_trip():
    first = Hydra(outer_lr=0.5, momentum=0.9)
    first.ranking, first.trainable_params = [1, 0], {1: {"1": 6}}
    _step(first, START, [(DELTA_A, 10), (DELTA_B, 30)], 1)
    second = Hydra(outer_lr=0.5, momentum=0.9)
    second.load_state_dict(first.state_dict())
    assert second.ranking == [1, 0] and second.specs == {1: SPEC_A, 2: SPEC_B} and second.layout == LAYOUT
    a = _step(first, START, [(DELTA_A, 10), (DELTA_B, 30)], 2)
    b = _step(second, START, [(DELTA_A, 10), (DELTA_B, 30)], 2)
    for name in START:
        np.testing.assert_array_equal(a[name], b[name])
    first.trainable_params[2] = {}
    assert 2 not in second.trainable_params  # state is a copy, not a view


TEXT = TaskSpec(name="text", modality="text", num_classes=3, class_names=("a", "b", "c"), vocab_size=40, seq_len=8)
IMAGE = TaskSpec(name="image", modality="image", num_classes=2, class_names=("a", "b"), image_size=16, channels=1)
SHAPE = TinyShape(hidden=32, layers=3, heads=4, intermediate=48, patch_size=8)


@pytest.mark.parametrize("family", ["bert", "vit", "llama"])
def test_layout_slices_equal_trainable_slices_of_the_live_model(family):
    model = {
        "bert": lambda: build_model(TEXT, shape=SHAPE),
        "vit": lambda: build_model(IMAGE, shape=SHAPE),
        "llama": lambda: build_causal_lm(40, shape=TinyLlamaShape(hidden=32, layers=3, heads=4, kv_heads=2)),
    }[family]()
    layout = slice_layout(model)
    layout = dict(zip(layout["layout.names"], zip(layout["layout.layers"], layout["layout.axes"], layout["layout.units"])))
    groups = 2 if family == "llama" else 4
    for spec in (
        SubnetSpec(layers=(1,), heads=((groups - 1,),)),
        SubnetSpec(layers=(0, 2), heads=((0, 1), (1,))),
        SubnetSpec(layers=(0, 1, 2)),
        dataclasses.replace(SubnetSpec(layers=(2,), heads=((0,),)), train_outside=False),
    ):
        assert layout_slices(layout, spec) == trainable_slices(model, spec)


def _scores(**resources) -> SiteScores:
    """Four layers of four head groups (descending scores), untiered, with the given measured cost/memory."""
    heads = [[4.0, 3.0, 2.0, 1.0]] * 4
    return SiteScores(layers=[4.0, 3.0, 2.0, 1.0], heads=heads, weight=1.0, tier="", **resources)


def test_declared_memory_and_the_round_deadline_shrink_a_sites_hydra_net_by_hand():
    cost = LayerCost(fixed_s=0.1, per_layer_s=0.1, fixed_bytes=100.0, per_layer_bytes=50.0, head_fraction=0.35)
    strategy = Hydra(local_steps=10)
    strategy.ranking = [0, 1, 2, 3]
    assert strategy._spec(_scores()).layers == (0, 1, 2, 3)  # nothing declared: the tier (untiered: all)
    # memory 200 = 100 + w * 50 -> at most w = 2 trained-layer equivalents: 2 layers with all 4 heads
    spec = strategy._spec(_scores(cost=cost, memory_bytes=200.0))
    assert spec.layers == (0, 1) and spec.heads_for(0) in (None, (0, 1, 2, 3))
    # deadline 2.5 s for 10 steps of (0.1 + 0.1 w) s -> w <= 1.5; 2 layers x 1 head: w = 2 (0.65 + 0.35 / 4) = 1.475
    strategy.timeout_s = 2.5
    spec = strategy._spec(_scores(cost=cost))
    assert spec.layers == (0, 1) and spec.heads_for(0) == (0,) and spec.heads_for(1) == (0,)
    with pytest.raises(BudgetError, match="no Hydra-net fits"):
        strategy._spec(_scores(cost=cost, memory_bytes=120.0))  # 1 layer, 1 head needs 100 + 0.7375 * 50
