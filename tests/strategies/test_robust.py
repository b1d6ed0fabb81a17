"""The masked robust rules against a numpy reference computed coordinate by coordinate over only the sites that
trained it, through the rule itself, a subnetwork strategy's and a LoRA baseline's aggregation; the trimmed
mean's cut on coordinates of 3 or 4 sites and the count of coordinates of 1 or 2 it cannot protect; the
clipped mean's sizes per site; and the knobs' refusals (FLoRA, central DP, Hydra's LoRA products, bad values)."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord
from flwr.serverapp.strategy import Bulyan, MultiKrum
from helpers import SMALL_RUN, configure_round, make_reply, make_scores_reply

from hydrafl import protocol
from hydrafl.config import ConfigError, RunConfig
from hydrafl.strategies import FedIT, FlexLoRA, HetLoRA, build_strategy
from hydrafl.strategies.lora import rank_slices, truncate
from hydrafl.strategies.robust import (
    MaskedRobustAggregator,
    RobustRule,
    masked_median,
    masked_trimmed_mean,
    trim_counts,
)
from hydrafl.strategies.subnet_strategy import SubnetStrategy
from hydrafl.subnet.slices import Slice, extract
from hydrafl.subnet.spec import SubnetSpec


def _reference(stacked: np.ndarray, rule: str, beta: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Coordinate by coordinate: the rule over the sites with a value there (NaN: did not train it)."""
    flat = stacked.reshape(stacked.shape[0], -1)
    out, covered = np.zeros(flat.shape[1]), np.zeros(flat.shape[1], dtype=bool)
    for j in range(flat.shape[1]):
        values = np.sort(flat[~np.isnan(flat[:, j]), j])
        if values.size == 0:
            continue
        covered[j] = True
        if rule == "median":
            out[j] = np.median(values)
        else:  # at least one cut at each end once 3 values allow it
            cut = math.floor(beta * values.size)
            cut = max(cut, 1) if beta > 0 and values.size >= 3 else cut
            out[j] = values[cut : values.size - cut].mean()
    return out.reshape(stacked.shape[1:]), covered.reshape(stacked.shape[1:])


def _masked_values(seed: int, sites: int = 7, shape: tuple[int, ...] = (5, 6)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    values = rng.normal(size=(sites, *shape)).astype(np.float32)
    values[rng.random(values.shape) < 0.4] = (
        np.nan
    )  # each coordinate trained by its own subset of sites
    values[:, 0, 0] = np.nan  # trained by nobody
    values[:, 0, 1] = np.nan
    values[3, 0, 1] = 2.5  # trained by one site
    values[1:, 0, 2] = np.nan
    values[0, 0, 2], values[4, 0, 2] = -1.0, 3.0  # by two: the mean of the two middle values
    return values


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_masked_median_is_each_coordinates_median_over_the_sites_that_trained_it(seed):
    values = _masked_values(seed)
    median, covered = masked_median(torch.from_numpy(values))
    expected, expected_covered = _reference(values, "median")
    np.testing.assert_array_equal(covered.numpy(), expected_covered)
    np.testing.assert_allclose(median.numpy(), expected, rtol=1e-6, atol=1e-7)
    assert median[0, 0] == 0 and not covered[0, 0]
    assert median[0, 1] == pytest.approx(2.5) and median[0, 2] == pytest.approx(1.0)


@pytest.mark.parametrize("beta", [0.0, 0.2, 0.34, 0.49])
def test_masked_trimmed_mean_cuts_at_least_one_of_each_coordinates_own_k_sites_once_k_is_3(beta):
    values = _masked_values(7, sites=9)
    mean, covered = masked_trimmed_mean(torch.from_numpy(values), beta)
    expected, expected_covered = _reference(values, "trimmed", beta)
    np.testing.assert_array_equal(covered.numpy(), expected_covered)
    np.testing.assert_allclose(mean.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_a_trimmed_mean_of_five_values_drops_the_outlier_at_each_end():
    stacked = torch.tensor([[1.0], [2.0], [3.0], [4.0], [1000.0]])
    mean, _ = masked_trimmed_mean(stacked, 0.2)
    assert mean.item() == pytest.approx(3.0)  # (2 + 3 + 4) / 3: one cut at each end


def test_the_trimmed_mean_trims_coordinates_of_three_and_four_sites_and_none_of_two():
    # one column per coordinate, NaN: that site did not train it; k = 3, 4, 2, 10 sites
    nan = math.nan
    stacked = torch.tensor(
        [
            [1.0, 1.0, 1.0, 1.0],
            [2.0, 2.0, 100.0, 2.0],
            [100.0, 3.0, nan, 3.0],
            [nan, 100.0, nan, 4.0],
            *([[nan, nan, nan, v] for v in (5.0, 6.0, 7.0, 8.0, -50.0, 90.0)]),
        ]
    )
    mean, covered = masked_trimmed_mean(stacked, 0.2)
    assert covered.tolist() == [True] * 4
    assert mean[0].item() == pytest.approx(
        2.0
    )  # k 3: floor(0.6) = 0 would have given 34.33; 1 cut: the middle one
    assert mean[1].item() == pytest.approx(2.5)  # k 4: (2 + 3) / 2, not 26.5
    assert mean[2].item() == pytest.approx(50.5)  # k 2: nothing to trim, the plain mean
    assert mean[3].item() == pytest.approx(
        (2 + 3 + 4 + 5 + 6 + 7) / 6
    )  # k 10: floor(2) at each end, as before
    k = torch.tensor([0, 1, 2, 3, 4, 5, 9, 10, 15])
    assert trim_counts(k, 0.2).tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 3]
    assert trim_counts(k, 0.0).tolist() == [0] * 9  # beta 0 is the plain mean everywhere
    assert trim_counts(k, 0.49).tolist() == [0, 0, 0, 1, 1, 2, 4, 4, 7]  # always leaves one value


@pytest.mark.parametrize("rule", ["trimmed-mean", "median"])
def test_the_coordinates_no_majority_protects_are_counted_and_logged(rule, caplog):
    shape = (
        2,
        3,
    )  # site 0 all of it, site 1 columns 0-1, site 2 row 0: (0, 0) and (0, 1) have 3 sites,
    # (0, 2) sites 0 and 2, (1, 0) and (1, 1) sites 0 and 1, (1, 2) site 0 alone
    aggregator = MaskedRobustAggregator(RobustRule(name=rule))
    aggregator.add_slices(
        {"w": torch.ones(2, 3), "b": torch.ones(4)},
        {"w": Slice(None), "b": Slice(None)},
        {"w": shape, "b": (4,)},
    )
    aggregator.add_slices(
        {"w": torch.full((2, 2), 2.0), "b": torch.ones(4)},
        {"w": Slice(1, (0, 1)), "b": Slice(None)},
        {"w": shape, "b": (4,)},
    )
    aggregator.add_slices({"w": torch.full((1, 3), 9.0)}, {"w": Slice(0, (0,))}, {"w": shape})
    with caplog.at_level(logging.WARNING, logger="hydrafl.strategies.robust"):
        out = aggregator.aggregate()
    assert aggregator.unprotected == {"w": 4, "b": 4}  # b: two sites everywhere
    assert f"{rule}: 8 of 10 trained coordinates had only 1 or 2 sites" in caplog.text
    w, covered = out["w"]
    assert covered.all()
    assert w[0].tolist() == pytest.approx(
        [2.0, 2.0, 5.0]
    )  # (1, 2, 9): the 9 cut; (1, 9): no majority, the mean
    assert w[1].tolist() == pytest.approx([1.5, 1.5, 1.0])


def test_nothing_is_logged_when_every_coordinate_has_a_majority(caplog):
    aggregator = MaskedRobustAggregator(RobustRule(name="trimmed-mean"))
    for value in (1.0, 2.0, 3.0):
        aggregator.add_slices({"w": torch.full((2,), value)}, {"w": Slice(None)}, {"w": (2,)})
    with caplog.at_level(logging.WARNING, logger="hydrafl.strategies.robust"):
        [(mean, _)] = aggregator.aggregate().values()
    assert mean.tolist() == [2.0, 2.0] and aggregator.unprotected == {"w": 0} and caplog.text == ""


def test_the_clipped_mean_scales_each_site_down_to_the_median_size_then_averages():
    aggregator = MaskedRobustAggregator(RobustRule(name="clipped-mean"))
    for values in ([1.0, 1.0], [2.0, 0.0], [100.0, 100.0]):  # RMS 1, sqrt 2, 100: the median sqrt 2
        aggregator.add_slices({"w": torch.tensor(values)}, {"w": Slice(None)}, {"w": (2,)})
    [(mean, covered)] = aggregator.aggregate().values()
    clipped = math.sqrt(2) / 100  # the third site scaled to RMS sqrt 2: (sqrt 2, sqrt 2)
    assert covered.all() and aggregator.unprotected == {}
    assert mean.tolist() == pytest.approx(
        [(1 + 2 + 100 * clipped) / 3, (1 + 0 + 100 * clipped) / 3]
    )


def test_the_clipped_mean_sizes_a_site_by_its_rms_so_a_small_tier_is_not_judged_by_its_norm():
    shape = (
        4,
    )  # sites 0 and 1 train coordinate 0 only (norm 1), site 2 all four (norm 2); every RMS is 1
    aggregator = MaskedRobustAggregator(RobustRule(name="clipped-mean"))
    aggregator.add_slices({"w": torch.ones(1)}, {"w": Slice(0, (0,))}, {"w": shape})
    aggregator.add_slices({"w": torch.ones(1)}, {"w": Slice(0, (0,))}, {"w": shape})
    aggregator.add_slices({"w": torch.ones(4)}, {"w": Slice(None)}, {"w": shape})
    [(mean, _)] = aggregator.aggregate().values()
    assert mean.tolist() == [
        1.0,
        1.0,
        1.0,
        1.0,
    ]  # clipping to the median norm (1) would give site 2's 0.5
    loud = MaskedRobustAggregator(RobustRule(name="clipped-mean", clip_factor=2.0))
    for site, value in enumerate(
        (1.0, 1.0, 1.0, 50.0)
    ):  # the fourth at 50x: cut to 2 x the median RMS
        loud.add("w", Slice(None), torch.full((3,), value), (3,), site=site)
    assert loud.aggregate()["w"][0].tolist() == pytest.approx([(3 + 2) / 4] * 3)


def test_sites_are_numbered_by_arrival_per_tensor_unless_named():
    aggregator = MaskedRobustAggregator(RobustRule(name="clipped-mean"))
    for value in (1.0, 1.0, 40.0):  # no site given: the i-th value of each tensor is site i
        aggregator.add("a", Slice(None), torch.full((2,), value), (2,))
        aggregator.add("b", Slice(None), torch.full((2,), value), (2,))
    out = aggregator.aggregate()
    assert out["a"][0].tolist() == pytest.approx([1.0, 1.0]) and out["b"][
        0
    ].tolist() == pytest.approx([1.0, 1.0])


def test_the_aggregator_places_compact_slices_before_taking_the_rule():
    shape = (4, 3)
    slices = [Slice(0, (0, 2)), Slice(None), Slice(1, (1,)), Slice(0, (2, 3))]
    full = np.arange(4 * 12, dtype=np.float32).reshape(4, *shape) ** 1.5
    stacked = np.full((4, *shape), np.nan, dtype=np.float32)
    aggregator = MaskedRobustAggregator(RobustRule(name="median"))
    for k, sl in enumerate(slices):
        mask = sl.mask(shape).numpy()
        stacked[k][mask] = full[k][mask]
        aggregator.add("w", sl, sl.take(torch.from_numpy(full[k])), shape)
    [(median, covered)] = aggregator.aggregate().values()
    expected, expected_covered = _reference(stacked, "median")
    np.testing.assert_allclose(median.numpy(), expected, rtol=1e-6)
    np.testing.assert_array_equal(covered.numpy(), expected_covered)
    with pytest.raises(ValueError, match="its slice is"):
        aggregator.add("w", Slice(0, (0,)), torch.zeros(2, 3), shape)


class _FixedSlices(SubnetStrategy):
    """A subnetwork strategy whose sites train fixed slices, to check its aggregation alone."""

    def __init__(self, slices, **kwargs):
        super().__init__(**kwargs)
        self.fixed = slices

    def site_slices(self, node):
        return self.fixed[node]


def test_a_subnetwork_strategy_takes_the_masked_median_of_the_slices_its_sites_trained():
    start = {"w": np.ones((4, 2), dtype=np.float32), "b": np.zeros(3, dtype=np.float32)}
    slices = {
        1: {"w": Slice(0, (0, 1)), "b": Slice(None)},
        2: {"w": Slice(0, (1, 2)), "b": Slice(None)},
        3: {"w": Slice(0, (1, 2, 3)), "b": Slice(None)},
        4: {"w": Slice(None), "b": Slice(None)},
    }
    rng = np.random.default_rng(3)
    deltas = {
        node: {name: rng.normal(size=a.shape).astype(np.float32) for name, a in start.items()}
        for node in slices
    }
    deltas[4]["w"][1] = 1e6  # a huge update on the row every site trained: the median ignores it
    strategy = _FixedSlices(slices, robust=RobustRule(name="median"))
    strategy.current_arrays = ArrayRecord({name: Array(a) for name, a in start.items()})
    strategy.specs = {node: SubnetSpec(layers=(0,)) for node in slices}
    replies = []
    for node, delta in deltas.items():
        compact = extract({n: torch.from_numpy(d) for n, d in delta.items()}, slices[node])
        replies.append(
            make_reply(
                {n: t.numpy() for n, t in compact.items()}, num_examples=10 * node, node_id=node
            )
        )
    new, metrics = strategy.aggregate_train(1, iter(replies))
    assert metrics is not None
    for name, array in start.items():
        stacked = np.full((4, *array.shape), np.nan, dtype=np.float32)
        for k, node in enumerate(slices):
            mask = slices[node][name].mask(array.shape).numpy()
            stacked[k][mask] = deltas[node][name][mask]
        median, covered = _reference(stacked, "median")
        np.testing.assert_allclose(
            new[name].numpy(), np.where(covered, array - median, array), rtol=1e-6
        )
    assert np.abs(new["w"].numpy()).max() < 10  # the 1e6 never reached the model


def test_a_subnetwork_strategys_trimmed_mean_cuts_a_hostile_site_on_a_row_three_sites_trained():
    start = {"w": np.zeros((3, 2), dtype=np.float32)}
    slices = {
        1: {"w": Slice(0, (0, 1))},
        2: {"w": Slice(0, (0, 1, 2))},
        3: {"w": Slice(0, (1, 2))},
        4: {"w": Slice(0, (1, 2))},
    }  # row 0: sites 1-2 (no majority), rows 1 and 2: 4 and 3 sites
    deltas = {
        1: [[1.0, 1.0], [1.0, 1.0]],
        2: [[3.0, 3.0], [2.0, 2.0], [2.0, 2.0]],
        3: [[3.0, 3.0], [4.0, 4.0]],
        4: [[-1e6, -1e6], [-1e6, -1e6]],
    }  # site 4 hostile on rows 1 and 2
    strategy = _FixedSlices(slices, robust=RobustRule(name="trimmed-mean", trim_fraction=0.2))
    strategy.current_arrays = ArrayRecord({"w": Array(start["w"])})
    strategy.specs = {node: SubnetSpec(layers=(0,)) for node in slices}
    replies = [
        make_reply({"w": np.asarray(d, dtype=np.float32)}, num_examples=10, node_id=n)
        for n, d in deltas.items()
    ]
    new, _ = strategy.aggregate_train(1, iter(replies))
    # new = start - delta; row 0: mean(1, 3); row 1: 4 sites, (1, 2, 3, -1e6) cut 1 each end -> (1 + 2) / 2;
    # row 2: 3 sites (2, 4, -1e6) cut 1 each end -> 2. floor(0.2 k) cut nothing: -249999 and -333331
    np.testing.assert_allclose(new["w"].numpy(), -np.array([[2.0, 2.0], [1.5, 1.5], [2.0, 2.0]]))


def test_a_subnetwork_strategys_clipped_mean_bounds_a_hostile_site():
    start = {"w": np.zeros((2, 2), dtype=np.float32)}
    slices = {node: {"w": Slice(None)} for node in (1, 2, 3, 4)}
    deltas = {1: 1.0, 2: 2.0, 3: 3.0, 4: 1e6}  # RMS 1, 2, 3, 1e6: the median 2.5
    strategy = _FixedSlices(slices, robust=RobustRule(name="clipped-mean"))
    strategy.current_arrays = ArrayRecord({"w": Array(start["w"])})
    strategy.specs = {node: SubnetSpec(layers=(0,)) for node in slices}
    replies = [
        make_reply({"w": np.full((2, 2), d, dtype=np.float32)}, num_examples=10, node_id=n)
        for n, d in deltas.items()
    ]
    new, _ = strategy.aggregate_train(1, iter(replies))
    np.testing.assert_allclose(
        new["w"].numpy(), np.full((2, 2), -(1 + 2 + 2.5 + 2.5) / 4), rtol=1e-6
    )


# FedIT's toy (as in test_lora_baselines): A [R=2, in=2], B [out=2, R=2], one layer of two heads; rank 1 is
# tier small, rank 2 tier large.
A, B = "m.lora_A.default.weight", "m.lora_B.default.weight"
TIER_OF_RANK = {1: "small", 2: "large"}


RANKS = {1: 2, 2: 2, 3: 1, 4: 2}
"""Four sites of the toy, the third of rank 1."""


def _lora_round(strategy, start):
    """One round of `strategy` over the toy: the planning round gives the sites `RANKS`, then each sends a random
    delta of its rank's components (the fourth a hostile -1e5 on A); returns (new arrays, the full deltas)."""
    layout = {
        name: (0, 1, 1) if name == A else (0, 0, 1) if name == B else (-1, -1, 1) for name in start
    }
    scores = {
        node: make_scores_reply(
            node, layout, layers=[1.0], heads=[[2.0, 1.0]], tier=TIER_OF_RANK[rank]
        )
        for node, rank in RANKS.items()
    }
    record = ArrayRecord({k: Array(np.asarray(v, dtype=np.float32)) for k, v in start.items()})
    messages = configure_round(strategy, 1, record, scores)
    assert {node: m.content["config"][protocol.SITE_RANK] for node, m in messages.items()} == RANKS
    rng = np.random.default_rng(5)
    deltas = {
        node: {n: rng.normal(size=a.shape).astype(np.float32) for n, a in start.items()}
        for node in RANKS
    }
    deltas[4][A][:] = -1e5
    replies = []
    for node, delta in deltas.items():
        full = {n: torch.from_numpy(d) for n, d in delta.items()}
        slices = rank_slices(delta, RANKS[node])
        deltas[node] = {
            n: slices[n].put(torch.zeros_like(t), slices[n].take(t)).numpy()
            for n, t in full.items()
        }
        compact = extract(full, slices)
        replies.append(make_reply({n: t.numpy() for n, t in compact.items()}, 10.0, node_id=node))
    new, _ = strategy.aggregate_train(1, iter(replies))
    return {name: array.numpy() for name, array in new.items()}, deltas


def test_fedit_takes_each_rank_components_median_over_the_sites_whose_rank_holds_it():
    start = {A: np.ones((2, 2)), B: np.zeros((2, 2)), "head": np.array([1.0, 2.0])}
    ranks = RANKS
    new, deltas = _lora_round(FedIT(robust=RobustRule(name="median")), start)
    a = np.stack([deltas[node][A] for node in ranks])
    a[2, 1] = np.nan  # the rank-1 site holds component 0 only (row 0 of A)
    b = np.stack([deltas[node][B] for node in ranks])
    b[2, :, 1] = np.nan  # and column 0 of B
    np.testing.assert_allclose(new[A], start[A] - _reference(a, "median")[0], rtol=1e-5)
    np.testing.assert_allclose(new[B], start[B] - _reference(b, "median")[0], rtol=1e-5)
    head = np.median(np.stack([deltas[node]["head"] for node in ranks]), axis=0)
    np.testing.assert_allclose(new["head"], start["head"] - head, rtol=1e-5)


def test_flexlora_takes_the_median_of_the_sites_products():
    start = {
        A: np.array([[1.0, 0.5], [0.2, 1.0]]),
        B: np.array([[0.3, 0.1], [0.2, 0.4]]),
        "head": np.zeros(2),
    }
    new, deltas = _lora_round(FlexLoRA(robust=RobustRule(name="median")), start)
    products = []
    for node, rank in RANKS.items():
        a0, b0 = truncate(torch.tensor(start[A]), torch.tensor(start[B]), rank)
        products.append(
            ((b0 - torch.tensor(deltas[node][B])) @ (a0 - torch.tensor(deltas[node][A]))).numpy()
        )
    # rank 2 of a 2 x 2 product: the SVD factors give the median product back exactly
    np.testing.assert_allclose(
        new[B] @ new[A], np.median(np.stack(products), axis=0), rtol=1e-4, atol=1e-5
    )


def test_hetlora_takes_each_components_median_over_the_sites_whose_rank_holds_it():
    start = {
        A: np.array([[1.0, 0.5], [0.2, 1.0]]),
        B: np.array([[0.3, 0.1], [0.2, 0.4]]),
        "head": np.zeros(2),
    }
    new, deltas = _lora_round(HetLoRA(robust=RobustRule(name="median"), tail_penalty=0.0), start)
    ends = {name: np.stack([start[name] - deltas[node][name] for node in RANKS]) for name in (A, B)}
    ends[A][2, 1], ends[B][2, :, 1] = np.nan, np.nan  # beyond the rank-1 site's rank
    np.testing.assert_allclose(new[A], _reference(ends[A], "median")[0], rtol=1e-5)
    np.testing.assert_allclose(new[B], _reference(ends[B], "median")[0], rtol=1e-5)


def test_flora_refuses_a_robust_rule_and_bad_knobs_are_named():
    with pytest.raises(ConfigError, match="robust-rule.*FLoRA stacks"):
        RunConfig.build(
            **{**SMALL_RUN.flat(), "strategy": "flora", "lora_rank": 2, "robust_rule": "median"}
        )
    with pytest.raises(ConfigError, match="robust-rule='mode'.*mean, median, trimmed-mean"):
        RunConfig.build(**{**SMALL_RUN.flat(), "strategy": "hydra", "robust_rule": "mode"})
    with pytest.raises(ConfigError, match="clip-factor=0"):
        RunConfig.build(
            **{
                **SMALL_RUN.flat(),
                "strategy": "hydra",
                "robust_rule": "clipped-mean",
                "clip_factor": 0,
            }
        )
    with pytest.raises(ConfigError, match="trim-fraction=0.5"):
        RunConfig.build(**{**SMALL_RUN.flat(), "strategy": "heterofl", "trim_fraction": 0.5})
    with pytest.raises(ConfigError, match="robust-rule.*dp-clip"):
        RunConfig.build(
            **{**SMALL_RUN.flat(), "strategy": "hydra", "robust_rule": "median", "dp_clip": 1.0}
        )
    lora_hydra = RunConfig.build(
        **{**SMALL_RUN.flat(), "strategy": "hydra", "lora_rank": 2, "robust_rule": "median"}
    )
    with pytest.raises(ConfigError, match="hydra-lora=factors"):
        build_strategy(lora_hydra)
    for strategy in ("hydra", "heterofl", "fjord", "fedrolex", "fedit", "hetlora", "flexlora"):
        run = RunConfig.build(
            **{
                **SMALL_RUN.flat(),
                "strategy": strategy,
                "lora_rank": 2,
                "robust_rule": "trimmed-mean",
                "trim_fraction": 0.3,
                **({"hydra_lora": "factors"} if strategy == "hydra" else {}),
            }
        )
        assert build_strategy(run).robust == RobustRule(name="trimmed-mean", trim_fraction=0.3)
    clipped = RunConfig.build(
        **{
            **SMALL_RUN.flat(),
            "strategy": "fjord",
            "robust_rule": "clipped-mean",
            "clip_factor": 1.5,
        }
    )
    assert build_strategy(clipped).robust == RobustRule(name="clipped-mean", clip_factor=1.5)


def test_multikrum_and_bulyan_are_flowers_own_with_their_knobs():
    multikrum = build_strategy(
        RunConfig.build(
            **{**SMALL_RUN.flat(), "strategy": "multikrum", "krum_malicious": 1, "krum_selected": 2}
        )
    )
    assert type(multikrum) is MultiKrum
    assert (multikrum.num_malicious_nodes, multikrum.num_nodes_to_select) == (1, 2)
    bulyan = build_strategy(
        RunConfig.build(
            **{**SMALL_RUN.flat(), "strategy": "bulyan", "sites": 7, "krum_malicious": 1}
        )
    )
    assert type(bulyan) is Bulyan and bulyan.num_malicious_nodes == 1
    with pytest.raises(
        ConfigError,
        match=r"krum-malicious=1.*at most \(sites - 3\) / 4 = 0 for Bulyan over 6 sites",
    ):
        build_strategy(
            RunConfig.build(
                **{**SMALL_RUN.flat(), "strategy": "bulyan", "sites": 6, "krum_malicious": 1}
            )
        )
