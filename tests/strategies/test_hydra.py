"""Hydra's masked aggregation against hand-computed numbers, its outer step, state, and slice layout, each
set up through the strategy's own hooks: the planning round answered with crafted scoring replies, then the
train messages it sends and the replies it aggregates."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord
from helpers import FakeGrid, configure_round, make_reply, make_scores_reply, sent_specs
from toy_hydra import DELTA_A, DELTA_B, SPEC_A, SPEC_B, START, toy_record, toy_scores

from hydrafl.backbones import TinyShape, build_causal_lm
from hydrafl.client.site_app import slice_layout
from hydrafl.config import ConfigError, RunConfig
from hydrafl.data import TaskSpec
from hydrafl.models import build_model
from hydrafl.strategies import AggregationError, Hydra, MaskedDeltaAccumulator, build_strategy
from hydrafl.strategies.outer import OuterOptimizer
from hydrafl.strategies.planner import SitePlanner
from hydrafl.subnet.apply import trainable_slices
from hydrafl.subnet.planning import LayerCost
from hydrafl.subnet.slices import layout_slices
from hydrafl.subnet.spec import SubnetSpec


def _hydra(**kwargs) -> Hydra:
    """Hydra whose untiered sites train every layer and half the heads of each."""
    return Hydra(planner=SitePlanner(untiered=(1.0, 0.5)), **kwargs)


def _built(**knobs) -> Hydra:
    """Hydra as a run configures it, untiered sites training every layer and half the heads of each."""
    return build_strategy(RunConfig.build(strategy="hydra", sites=2, hydra_heads=0.5, **knobs))


def _step(strategy: Hydra, arrays, replies, server_round=1):
    """One round: `arrays` go out (after the planning round, when the strategy has not planned yet) as SPEC_A to
    node 1 and SPEC_B to node 2; A (10 examples) and B (30 examples) reply with `replies`."""
    messages = configure_round(strategy, server_round, toy_record(arrays), toy_scores())
    assert sent_specs(messages) == {1: SPEC_A, 2: SPEC_B}
    replies = [make_reply(delta, n, node_id=i + 1) for i, (delta, n) in enumerate(replies)]
    new, metrics = strategy.aggregate_train(server_round, iter(replies))
    assert metrics is not None
    return {name: array.numpy() for name, array in new.items()}


def test_masked_mean_by_hand():
    new = _step(_hydra(), START, [(DELTA_A, 10), (DELTA_B, 30)])
    expected_w = np.array(
        [
            [1.0 - 0.1, 2.0 - 0.2],  # only A trained row 0
            [
                3.0 - (10 * 0.4 + 30 * 0.8) / 40,
                4.0 - (10 * 0.4 + 30 * 0.0) / 40,
            ],  # both: weighted mean 0.7, 0.1
            [5.0 - 0.3, 6.0 + 0.3],  # only B
            [7.0, 8.0],  # nobody: unchanged
        ]
    )
    np.testing.assert_allclose(new["w"], expected_w, rtol=1e-6)
    np.testing.assert_allclose(new["v"], START["v"] - DELTA_B["v"], rtol=1e-6)  # only B
    np.testing.assert_allclose(
        new["o"], [2.0 - (10 - 30) / 40, -2.0 - 60 / 40], rtol=1e-6
    )  # [2.5, -3.5]
    np.testing.assert_array_equal(new["w"][3], START["w"][3])


def test_a_reply_that_is_not_its_sites_slice_is_refused():
    full_shape = {
        "w": np.zeros((4, 2)),
        "o": np.zeros(2),
    }  # A's w must be its two rows, not the whole tensor
    with pytest.raises(
        AggregationError, match=r"array 'w' has shape \(4, 2\), its slice is \(2, 2\)"
    ):
        _step(_hydra(), START, [(full_shape, 10), (DELTA_B, 30)])
    strategy = _hydra()
    configure_round(strategy, 1, toy_record(START), toy_scores())
    assert strategy.reply_shapes(1, toy_record(START)) == {"w": (2, 2), "o": (2,)}
    assert strategy.reply_shapes(2, toy_record(START)) == {"w": (2, 2), "v": (3,), "o": (2,)}
    assert strategy.reply_shapes(3, toy_record(START)) is None  # sent nothing


def test_accumulator_coverage_and_refusals():
    accumulator = MaskedDeltaAccumulator()
    masks = {"w": torch.tensor([True, False, True])}
    accumulator.add(make_reply({"w": np.array([1.0, 9.0, 3.0])}, 2, node_id=1), masks)
    accumulator.add(
        make_reply({"w": np.array([4.0, 9.0, 0.0])}, 1, node_id=2),
        {"w": torch.tensor([True, False, False])},
    )
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
    strategy = _hydra(outer=OuterOptimizer(lr=lr, momentum=momentum, nesterov=True))
    arrays = {k: v.copy() for k, v in START.items()}
    reference = torch.tensor(
        START["v"], requires_grad=True
    )  # only B trains v: its pseudo-gradient is B's delta
    optimizer = torch.optim.SGD([reference], lr=lr, momentum=momentum, nesterov=True)
    for server_round in (1, 2, 3):
        arrays = _step(strategy, arrays, [(DELTA_A, 10), (DELTA_B, 30)], server_round)
        reference.grad = torch.tensor(DELTA_B["v"], dtype=torch.float32)
        optimizer.step()
        np.testing.assert_allclose(arrays["v"], reference.detach().numpy(), rtol=1e-5)
        np.testing.assert_array_equal(arrays["w"][3], START["w"][3])
    assert float(strategy.state_dict()["momentum_buffer"]["w"][3].abs().sum()) == 0.0


def test_outer_nesterov_with_lr_one_and_no_momentum_equals_plain_hydra():
    plain = _built()
    outer = _built(outer="nesterov", outer_lr=1.0, outer_momentum=0.0)
    for server_round in (1, 2):
        a = _step(plain, START, [(DELTA_A, 10), (DELTA_B, 30)], server_round)
        b = _step(outer, START, [(DELTA_A, 10), (DELTA_B, 30)], server_round)
        for name in START:
            np.testing.assert_array_equal(a[name], b[name])
    assert outer.state_dict()["momentum_buffer"] == {}  # no momentum: nothing kept between rounds


def test_the_run_config_wires_the_outer_optimizer_into_hydra():
    built = _built(outer="nesterov", outer_lr=0.7, outer_momentum=0.9)
    by_hand = _hydra(outer=OuterOptimizer(lr=0.7, momentum=0.9, nesterov=True))
    unused = _built(
        outer_lr=0.7, outer_momentum=0.9
    )  # without outer = nesterov these knobs take no effect
    plain = _hydra()
    for server_round in (1, 2):  # the momentum shows from the second round on
        a = _step(built, START, [(DELTA_A, 10), (DELTA_B, 30)], server_round)
        b = _step(by_hand, START, [(DELTA_A, 10), (DELTA_B, 30)], server_round)
        c = _step(unused, START, [(DELTA_A, 10), (DELTA_B, 30)], server_round)
        d = _step(plain, START, [(DELTA_A, 10), (DELTA_B, 30)], server_round)
        for name in START:
            np.testing.assert_array_equal(a[name], b[name])
            np.testing.assert_array_equal(c[name], d[name])
        assert not np.array_equal(a["v"], c["v"])  # the outer step is not the plain mean


def test_state_dict_round_trip():
    first = _hydra(outer=OuterOptimizer(lr=0.5, momentum=0.9, nesterov=True))
    _step(first, START, [(DELTA_A, 10), (DELTA_B, 30)], 1)
    second = _hydra(outer=OuterOptimizer(lr=0.5, momentum=0.9, nesterov=True))
    second.load_state_dict(first.state_dict())
    assert second.trainable_params == {1: {"1": 2 * 2 + 2, "2": 2 * 2 + 3 + 2}}  # w rows, v, o
    assert (
        list(second.configure_query(2, toy_record(START), ConfigRecord(), FakeGrid([1, 2]))) == []
    )  # planned
    a = _step(first, START, [(DELTA_A, 10), (DELTA_B, 30)], 2)
    b = _step(
        second, START, [(DELTA_A, 10), (DELTA_B, 30)], 2
    )  # the same specs, from the restored planning round
    for name in START:
        np.testing.assert_array_equal(a[name], b[name])
    first.trainable_params[1]["1"] = 0
    assert second.trainable_params[1]["1"] == 6  # state is a copy, not a view


TEXT = TaskSpec(
    name="text",
    modality="text",
    num_classes=3,
    class_names=("a", "b", "c"),
    vocab_size=40,
    seq_len=8,
)
IMAGE = TaskSpec(
    name="image", modality="image", num_classes=2, class_names=("a", "b"), image_size=16, channels=1
)
SHAPE = TinyShape(hidden=32, layers=3, heads=4, intermediate=48, patch_size=8)


@pytest.mark.parametrize("family", ["bert", "vit", "llama"])
def test_layout_slices_equal_trainable_slices_of_the_live_model(family):
    model = {
        "bert": lambda: build_model(TEXT, shape=SHAPE),
        "vit": lambda: build_model(IMAGE, model="vit", shape=SHAPE),
        "llama": lambda: build_causal_lm(
            40, shape=TinyShape(hidden=32, layers=3, heads=4, kv_heads=2)
        ),
    }[family]()
    layout = slice_layout(model)
    layout = dict(
        zip(
            layout["layout.names"],
            zip(
                layout["layout.layers"], layout["layout.axes"], layout["layout.units"], strict=True
            ),
            strict=True,
        )
    )
    groups = 2 if family == "llama" else 4
    for spec in (
        SubnetSpec(layers=(1,), heads=((groups - 1,),)),
        SubnetSpec(layers=(0, 2), heads=((0, 1), (1,))),
        SubnetSpec(layers=(0, 1, 2)),
        dataclasses.replace(SubnetSpec(layers=(2,), heads=((0,),)), train_outside=False),
    ):
        assert layout_slices(layout, spec) == trainable_slices(model, spec)


# Four layers, each one tensor of four head groups (a row each).
FOUR_LAYERS = {f"l{layer}": (layer, 0, 1) for layer in range(4)}


def _sized(strategy: Hydra, resources: dict[int, dict]) -> dict[int, SubnetSpec]:
    """What `strategy` assigns sites that score four layers of four head groups (descending scores), untiered,
    each with the measured cost / declared memory in `resources`."""
    descending = [4.0, 3.0, 2.0, 1.0]
    scores = {
        node: make_scores_reply(
            node, FOUR_LAYERS, layers=descending, heads=[descending] * 4, **given
        )
        for node, given in resources.items()
    }
    arrays = toy_record({name: np.zeros((4, 1)) for name in FOUR_LAYERS})
    return sent_specs(configure_round(strategy, 1, arrays, scores))


def test_declared_memory_and_the_round_deadline_shrink_a_sites_hydra_net_by_hand(caplog):
    cost = LayerCost(
        fixed_s=0.1, per_layer_s=0.1, fixed_bytes=100.0, per_layer_bytes=50.0, head_fraction=0.35
    )
    with caplog.at_level(logging.WARNING):
        specs = _sized(
            Hydra(planner=SitePlanner(local_steps=10)),
            {
                1: {},
                2: {"cost": cost, "memory_bytes": 200.0},
                3: {"cost": cost, "memory_bytes": 120.0},
            },
        )
    assert specs[1].layers == (0, 1, 2, 3)  # nothing declared: the tier (untiered: all)
    # memory 200 = 100 + w * 50 -> at most w = 2 trained-layer equivalents: 2 layers with all 4 heads (frozen
    # heads save no memory), the top two (a frozen layer above a trained one would hold its activations)
    assert specs[2].layers == (2, 3) and specs[2].heads_for(2) in (None, (0, 1, 2, 3))
    # 1 layer, 1 head needs 100 + 0.7375 * 50 > 120: the site is sent nothing to train
    assert 3 not in specs and "site 3 cannot train this round: no Hydra-net fits" in caplog.text
    # deadline 2.5 s for 10 steps of (0.1 + 0.1 w) s -> w <= 1.5; frozen heads still run, so whole layers: one
    # (w = 1), the top one
    specs = _sized(
        Hydra(planner=SitePlanner(local_steps=10, timeout_s=2.5)), {1: {"cost": cost}, 2: {}}
    )
    assert specs[1].layers == (3,) and specs[1].heads_for(3) in (None, (0, 1, 2, 3))
    assert specs[2].layers == (0, 1, 2, 3)  # measured nothing: nothing to size against the deadline


def test_outer_knobs_that_the_default_outer_step_ignores_are_refused_by_name():
    for knob, value in (("outer_lr", 0.5), ("outer_momentum", 0.0), ("outer_nesterov", False)):
        with pytest.raises(
            ConfigError, match=f"--{knob.replace('_', '-')}=.*ignored with --outer none"
        ):
            RunConfig.build(strategy="hydra", **{knob: value})
        assert (
            getattr(
                RunConfig.build(strategy="hydra", outer="nesterov", **{knob: value}).options, knob
            )
            == value
        )
