"""HeteroFL, FjORD and FedRolex: width windows, masking on live models, aggregation by hand, and a tiered run."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import Array, ArrayRecord, ConfigRecord
from helpers import (
    TIER_OF_NODE,
    TIERED_RUN,
    assert_resume_matches_a_straight_run,
    configure_round,
    make_reply,
    make_scores_reply,
    reply_layout,
    sent_specs,
)

from hydrafl.backbones import TinyShape, build_causal_lm, with_lora
from hydrafl.client import site_app
from hydrafl.data import TaskSpec
from hydrafl.models import build_model
from hydrafl.server import server_app
from hydrafl.simulation.compare import compare_strategies
from hydrafl.simulation.grid import FIRST_NODE_ID, InProcessGrid
from hydrafl.simulation_config import SimulationConfig
from hydrafl.strategies import FedRolex, FjORD, HeteroFL, build_strategy
from hydrafl.subnet.apply import apply_spec, trainable_slices, width_layout
from hydrafl.subnet.slices import extract
from hydrafl.subnet.spec import SpecError, SubnetSpec
from hydrafl.subnet.width import WidthAxis, width_layout_from_heads, width_slices, width_window

TEXT = TaskSpec(
    name="text",
    modality="text",
    num_classes=3,
    class_names=("a", "b", "c"),
    vocab_size=40,
    seq_len=8,
)
SHAPE = TinyShape(hidden=32, layers=2, heads=4, intermediate=48)  # head dim 8
LLAMA = TinyShape(hidden=32, layers=2, heads=4, kv_heads=2, intermediate=48, max_positions=32)


def test_width_window_keeps_leading_channels_or_rolls_and_wraps():
    assert width_window(8, 0.5) == (0, 1, 2, 3)
    assert width_window(16, 0.3) == (0, 1, 2, 3, 4)  # ceil(4.8)
    assert width_window(8, 0.5, offset=6) == (0, 1, 6, 7)  # 6, 7, then wraps to 0, 1
    assert width_window(8, 0.5, offset=9) == width_window(8, 0.5, offset=1) == (1, 2, 3, 4)
    assert width_window(4, 1.0, offset=3) == (0, 1, 2, 3)
    assert width_window(100, 0.001) == (0,)  # never empty


def test_width_spec_round_trips_and_refuses_heads_with_a_width():
    spec = SubnetSpec(
        layers=(0, 1), width_ratio=0.4, width_offset=3, width_levels=(0.6, 0.2), width_seed=7
    )
    back = SubnetSpec.from_config(dict(ConfigRecord(spec.to_config())))
    assert back == spec and back.width_levels == (0.2, 0.6) and back.is_width
    assert (
        "hydra.width-offset" not in SubnetSpec(layers=(0,)).to_config()
    )  # Hydra specs travel as before
    with pytest.raises(SpecError, match="selects heads or a width"):
        SubnetSpec(layers=(0,), heads=((0,),), width_ratio=0.5)
    with pytest.raises(SpecError, match="width_offset must be an integer >= 0"):
        SubnetSpec(layers=(0,), width_offset=-1)


# --------------------------------------------------------------------------------------------------------------
# Masking a live model
# --------------------------------------------------------------------------------------------------------------


def _bert():
    return build_model(TEXT, seed=0, shape=SHAPE)


def _llama():
    return build_causal_lm(40, shape=LLAMA, seed=0)


def _loss(model, x, y):
    if y is None:  # causal LM: next-token loss
        return model(input_ids=x, labels=x).loss
    return F.cross_entropy(model(x), y)


def _batch(kind):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(1, 40, (4, 8), generator=g)
    return x, (torch.randint(0, 3, (4,), generator=g) if kind == "bert" else None)


@pytest.mark.parametrize("kind", ["bert", "llama", "bert-lora", "llama-lora"])
def test_masked_width_channels_get_exactly_zero_gradient(kind):
    model = _bert() if kind.startswith("bert") else _llama()
    if kind.endswith("lora"):
        model = with_lora(model, rank=4, init_lora_weights=False)
    x, y = _batch(kind.split("-")[0])
    spec = SubnetSpec(layers=(0, 1), width_ratio=0.4, width_offset=5)
    slices = trainable_slices(model, spec)
    model.zero_grad()
    with apply_spec(model, spec):
        _loss(model, x, y).backward()
    sliced = 0
    for name, p in model.named_parameters():
        if name not in slices or p.grad is None:
            continue
        mask = slices[name].mask(p.shape)
        assert float(p.grad[~mask].abs().sum()) == 0.0, name
        assert float(p.grad[mask].abs().sum()) > 0.0, name
        sliced += int(not mask.all())
    assert sliced >= 8  # q/k/v/o (or their LoRA factors) of both layers, FFN too without LoRA


def test_width_masking_equals_the_model_with_dropped_channels_zeroed():
    model = _bert()
    x, _ = _batch("bert")
    keep = 3  # ceil(0.3 * 8) dims of each head, ceil(0.3 * 48) = 15 FFN units
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for layer in reference.net.bert.encoder.layer:
            dropped = [h * 8 + j for h in range(4) for j in range(keep, 8)]
            for linear in (layer.attention.self.query, layer.attention.self.key):
                linear.weight[dropped] = 0.0
                linear.bias[dropped] = 0.0
            layer.attention.output.dense.weight[:, dropped] = 0.0
            layer.output.dense.weight[:, 15:] = 0.0
        expected = reference(x)
        with apply_spec(model, SubnetSpec(layers=(0, 1), width_ratio=0.3)):
            masked = model(x)
        unmasked = model(x)
    torch.testing.assert_close(masked, expected, rtol=0, atol=1e-6)
    assert not torch.allclose(unmasked, expected)  # the hooks are gone after the block


def test_fjord_draws_nested_widths_per_step_and_only_trains_inside_its_widest():
    model = _bert()
    x, y = _batch("bert")
    spec = SubnetSpec(
        layers=(0, 1), width_ratio=0.6, width_levels=(0.2, 0.4, 0.6, 0.8, 1.0), width_seed=3
    )
    widest = trainable_slices(model, spec)
    drawn, name = set(), "net.bert.encoder.layer.0.intermediate.dense.weight"
    with apply_spec(model, spec) as handle:
        for _ in range(12):
            model.zero_grad()
            _loss(model, x, y).backward()
            drawn.add(handle.width_ratio)
            rows = (model.get_parameter(name).grad.abs().sum(1) > 0).nonzero().flatten().tolist()
            assert rows == list(range(len(width_window(48, handle.width_ratio))))  # a leading slice
            assert not model.get_parameter(name).grad[~widest[name].mask((48, 32))].any()
    assert drawn == {0.2, 0.4, 0.6}  # never wider than p_max


def test_site_and_coordinator_agree_on_the_width_layout():
    for model in (_llama(), with_lora(_bert(), rank=4)):
        site = width_layout(model)
        layout = site_app.slice_layout(model)
        heads = dict(
            zip(
                layout["layout.names"],
                zip(
                    layout["layout.layers"],
                    layout["layout.axes"],
                    layout["layout.units"],
                    strict=True,
                ),
                strict=True,
            )
        )
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}
        assert width_layout_from_heads(heads, shapes) == site


# --------------------------------------------------------------------------------------------------------------
# Aggregation rules against hand-computed numbers
# --------------------------------------------------------------------------------------------------------------

# A toy model: "q" is layer 0's query (2 heads of head dim 2: rows 0-1 and 2-3), FF_OUT its FFN output projection
# (4 hidden units: columns), "n" a layer-0 norm (not width-sliced), "e" an embedding outside the layers. Layers 1
# and 2 hold one whole tensor each ("m1", "m2"): every width trains them, so a Hydra-net of fewer layers trains
# less than a width does, and the tiers' Hydra budgets come out as widths 0.5 (tier medium) and 0.25 (small).
FF_OUT = "0.output.dense.weight"  # named as in BERT, so the coordinator finds its width axis from the name
LAYOUT = {
    "q": WidthAxis(0, 0, 2, (4, 1)),
    FF_OUT: WidthAxis(0, 1, 4, (1, 4)),
    "n": WidthAxis(0, -1, 0, (2,)),
    "e": WidthAxis(-1, -1, 0, (2,)),
    "m1": WidthAxis(1, -1, 0, (1,)),
    "m2": WidthAxis(2, -1, 0, (3,)),
}
HEAD_LAYOUT = {
    "q": (0, 0, 2),
    FF_OUT: (0, -1, 2),
    "n": (0, -1, 2),
    "e": (-1, -1, 2),
    "m1": (1, -1, 2),
    "m2": (2, -1, 2),
}
"""What the sites report in the planning round (`site_app.slice_layout`): per tensor its layer, head axis, head dim."""
START = {
    "q": [[1.0], [2.0], [3.0], [4.0]],
    FF_OUT: [[1.0, 1.0, 1.0, 1.0]],
    "n": [1.0, 1.0],
    "e": [0.0, 0.0],
    "m1": [1.0],
    "m2": [1.0, 1.0, 1.0],
}
# Site A (node 1, 10 examples, width 0.5) and site C (node 2, 30 examples, width 0.25); junk (100) outside their
# slices never travels. Neither moves "m1" or "m2".
DELTA_A = {
    "q": [[0.2], [100.0], [0.4], [100.0]],
    FF_OUT: [[0.1, 0.3, 100.0, 100.0]],
    "n": [0.2, 0.2],
    "e": [1.0, 1.0],
    "m1": [0.0],
    "m2": [0.0, 0.0, 0.0],
}
DELTA_C = {
    "q": [[0.6], [100.0], [0.8], [100.0]],
    FF_OUT: [[0.5, 100.0, 100.0, 100.0]],
    "n": [0.6, -0.2],
    "e": [3.0, 1.0],
    "m1": [0.0],
    "m2": [0.0, 0.0, 0.0],
}


def _scores():
    """Both sites rank layer 0, then 1, then 2. A is tier medium: a Hydra-net of layers 0-1 with both heads,
    4 + 4 + 2 + 1 + 2 = 13 coordinates; C is tier small: layer 0 with one head, 2 + 4 + 2 + 2 = 10. The widths
    train 11 (0.25), 12 (0.5), 15 (0.75) or 16 (1.0) coordinates: the closest are 0.5 and 0.25."""
    return {
        node: make_scores_reply(
            node, HEAD_LAYOUT, layers=[3.0, 2.0, 1.0], heads=[[2.0, 1.0]] * 3, tier=tier
        )
        for node, tier in ((1, "medium"), (2, "small"))
    }


def test_the_coordinator_reads_the_toys_width_layout_from_the_reported_heads():
    shapes = {name: axis.shape for name, axis in LAYOUT.items()}
    assert width_layout_from_heads(HEAD_LAYOUT, shapes) == LAYOUT


def _aggregate(strategy, deltas, server_round=1):
    """One round: the planning round (before the strategy's first) sizes A at width 0.5 and C at width 0.25
    over every layer, and the train messages say so (FedRolex: from channel `server_round - 1` on). Each site
    sends what `site_app.train` sends: its slices of the delta under the spec it was sent, compact (the junk is
    cut off)."""
    records = ArrayRecord({k: Array(np.asarray(v, dtype=np.float32)) for k, v in START.items()})
    specs = sent_specs(configure_round(strategy, server_round, records, _scores()))
    offset = server_round - 1 if isinstance(strategy, FedRolex) else 0
    assert {node: (s.layers, s.width_ratio, s.width_offset) for node, s in specs.items()} == {
        1: ((0, 1, 2), 0.5, offset),
        2: ((0, 1, 2), 0.25, offset),
    }
    replies = []
    for node, (delta, n) in enumerate(deltas, start=1):
        full = {name: torch.tensor(values, dtype=torch.float32) for name, values in delta.items()}
        slices = {
            name: sl for name, sl in width_slices(LAYOUT, specs[node]).items() if name in full
        }
        compact = extract(full, slices)
        replies.append(
            make_reply({name: t.numpy() for name, t in compact.items()}, n, node_id=node)
        )
    new, metrics = strategy.aggregate_train(server_round, iter(replies))
    assert metrics is not None
    return {name: array.numpy() for name, array in new.items()}


def test_heterofl_is_the_plain_mean_over_the_sites_that_trained_each_coordinate():
    new = _aggregate(HeteroFL(), [(DELTA_A, 10), (DELTA_C, 30)])
    # q keeps dim 0 of each head for both sites (ceil(0.5 * 2) = ceil(0.25 * 2) = 1): rows 0 and 2.
    np.testing.assert_allclose(
        new["q"], [[1 - 0.4], [2.0], [3 - 0.6], [4.0]], rtol=1e-6
    )  # (0.2+0.6)/2, (0.4+0.8)/2
    # FF_OUT: A keeps units 0-1, C unit 0: unit 0 by both, unit 1 by A only, units 2-3 by nobody.
    np.testing.assert_allclose(new[FF_OUT], [[1 - 0.3, 1 - 0.3, 1.0, 1.0]], rtol=1e-6)
    np.testing.assert_allclose(new["n"], [1 - 0.4, 1 - 0.0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(new["e"], [0 - 2.0, 0 - 1.0], rtol=1e-6)


def test_fjord_weights_the_nested_blocks_by_samples():
    new = _aggregate(FjORD(), [(DELTA_A, 10), (DELTA_C, 30)])
    np.testing.assert_allclose(
        new["q"], [[1 - 0.5], [2.0], [3 - 0.7], [4.0]], rtol=1e-6
    )  # (2 + 18) / 40, (4 + 24) / 40
    np.testing.assert_allclose(
        new[FF_OUT], [[1 - 0.4, 1 - 0.3, 1.0, 1.0]], rtol=1e-6
    )  # (1 + 15) / 40; A alone
    np.testing.assert_allclose(
        new["n"], [1 - 0.5, 1 + 0.1], rtol=1e-6
    )  # (2 + 18) / 40, (2 - 6) / 40
    np.testing.assert_allclose(new["e"], [0 - 2.5, 0 - 1.0], rtol=1e-6)


def test_fedrolex_rolls_the_window_and_averages_plainly():
    delta_a = {**DELTA_A, "q": [[100.0], [0.2], [100.0], [0.4]], FF_OUT: [[100.0, 0.1, 0.3, 100.0]]}
    delta_c = {
        **DELTA_C,
        "q": [[100.0], [0.6], [100.0], [0.8]],
        FF_OUT: [[100.0, 0.5, 100.0, 100.0]],
    }
    new = _aggregate(
        FedRolex(), [(delta_a, 10), (delta_c, 30)], server_round=2
    )  # the window from channel 1 on
    np.testing.assert_allclose(
        new["q"], [[1.0], [2 - 0.4], [3.0], [4 - 0.6]], rtol=1e-6
    )  # dim 1 of each head
    np.testing.assert_allclose(
        new[FF_OUT], [[1.0, 1 - 0.3, 1 - 0.3, 1.0]], rtol=1e-6
    )  # units 1-2 and 1
    only_a = [
        ({"q": START["q"], FF_OUT: [[0.5, 100.0, 100.0, 0.5]]}, 10)
    ]  # C sends nothing this round
    new = _aggregate(FedRolex(), only_a, server_round=4)  # A's width 0.5 from channel 3 on
    np.testing.assert_allclose(
        new[FF_OUT], [[0.5, 1.0, 1.0, 0.5]], rtol=1e-6
    )  # units 3, then 0: wrapped


# --------------------------------------------------------------------------------------------------------------
# On the in-process grid
# --------------------------------------------------------------------------------------------------------------

CFG = TIERED_RUN
QUERY = "net.encoder.encoder.layer.0.attention.self.query.weight"  # 4 heads of 16 rows
FFN_IN = "net.encoder.encoder.layer.0.intermediate.dense.weight"  # 128 hidden units


def test_fedrolex_window_advances_each_round_and_wraps():
    cfg = CFG.replace(strategy="fedrolex")
    strategy = build_strategy(cfg)
    grid = InProcessGrid(site_app.client_app, cfg.sites, cfg.to_flower())
    arrays = server_app.request_initial_arrays(grid, cfg)
    queries = list(strategy.configure_query(1, arrays, ConfigRecord(cfg.to_flower()), grid))
    scores = list(
        grid.send_and_receive(queries)
    )  # the planning round, as the round driver exchanges it
    strategy.aggregate_query(1, scores)
    shapes = {name: tuple(arrays[name].shape) for name in arrays}
    layout = width_layout_from_heads(
        reply_layout(scores[0]), shapes
    )  # what the coordinator slices widths by
    small = FIRST_NODE_ID  # the small tier
    rows = {}
    for server_round in (1, 2, 17):
        messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
        spec = sent_specs(messages)[small]
        assert spec.width_offset == server_round - 1
        slices = width_slices(layout, spec)
        rows[server_round] = (slices[QUERY].index, slices[FFN_IN].index)
    kept = len(rows[1][0]) // 4
    assert 0 < kept < 16 and rows[1][0][:kept] == tuple(range(kept))
    assert rows[2][0][:kept] == tuple(range(1, kept + 1))  # advanced by one channel in every head
    assert rows[17][0] == rows[1][0]  # head dim 16: round 17 wraps back to round 1's window
    assert (
        rows[17][1] != rows[1][1] and rows[17][1][0] == 16
    )  # the 128 FFN units have not wrapped yet


@pytest.mark.slow
def test_simulate_width_baselines_train_at_the_hydra_budget_of_each_tier(tmp_path):
    strategies = ("hydra", "heterofl", "fjord", "fedrolex")
    config = SimulationConfig(run=CFG.replace(rounds=2), strategies=strategies, out=str(tmp_path))
    compare_strategies(config, show_progress=False)
    results = json.loads((tmp_path / "results.json").read_text())

    def per_tier(strategy, server_round="1"):
        params = results["strategies"][strategy]["trainable_params_per_site"][server_round]
        return {TIER_OF_NODE[int(node)]: n for node, n in params.items()}

    hydra = per_tier("hydra")
    # One more kept dim of every head moves the count by 2 layers x 4 heads x (3 q/k/v rows of 65 + an o column of 64).
    step = 2 * 4 * (3 * 65 + 64)
    for strategy in strategies[1:]:
        for server_round in ("1", "2"):
            params = per_tier(strategy, server_round)
            assert params["small"] < params["medium"] < params["large"] == hydra["large"]
            for tier, budget in hydra.items():
                assert abs(params[tier] - budget) <= step, (strategy, tier, params[tier], budget)
        rounds = results["strategies"][strategy]["rounds"]
        assert rounds[-1]["loss"] != rounds[0]["loss"]  # it trained
        up = {TIER_OF_NODE[int(node)]: n for node, n in rounds[1]["bytes_up_per_site"].items()}
        assert set(up) == {"small", "medium", "large"}


@pytest.mark.parametrize("strategy", [pytest.param("fjord", marks=pytest.mark.slow), "fedrolex"])
def test_resume_ends_with_the_same_numbers(tmp_path, strategy):
    cfg = CFG.replace(strategy=strategy, rounds=2)
    assert_resume_matches_a_straight_run(cfg, tmp_path)
