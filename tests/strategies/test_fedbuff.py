"""FedBuff's buffer against hand-computed numbers: staleness factors, the weight cap, the ESS guard, and the
step FedBuff takes from real replies."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord
from helpers import make_reply

from hydrafl.config import RunConfig
from hydrafl.strategies.fedbuff import FedBuff, FedBuffConfig
from hydrafl.strategies.staleness import BufferRule, StalenessBuffer, ess
from hydrafl.validation import ConfigError

START = {"w": np.array([1.0, -2.0, 0.5], dtype=np.float32)}


def _buffer(**rule) -> StalenessBuffer:
    return StalenessBuffer(rule=BufferRule(**rule))


def test_sqrt_staleness_weighs_one_over_sqrt_of_one_plus_tau():
    buffer = _buffer(buffer_size=3)
    assert [buffer.weigh(node, tau, 50) for node, tau in ((1, 0), (2, 3), (3, 8))] == [
        1.0,
        0.5,
        pytest.approx(1 / 3),
    ]
    assert buffer.full


def test_poly_staleness_weighs_one_plus_tau_to_the_minus_a():
    buffer = _buffer(buffer_size=3, staleness="poly", staleness_exponent=1.0)
    weights = [buffer.weigh(node, tau, 50) for node, tau in ((1, 0), (2, 3), (3, 8))]
    assert weights == [1.0, 0.25, pytest.approx(1 / 9)]
    assert _buffer(staleness="poly", staleness_exponent=2.0).weigh(1, 1, 10) == 0.25


def test_example_counts_weigh_against_the_running_mean_and_the_cap_truncates():
    # fresh updates of 100, 100 and 400 examples: the mean is 100, 100, 200 as each arrives -> 1, 1, 2
    uncapped = _buffer(buffer_size=3)
    assert [uncapped.weigh(n, 0, count) for n, count in ((1, 100), (2, 100), (3, 400))] == [
        1.0,
        1.0,
        2.0,
    ]
    capped = _buffer(buffer_size=3, weight_cap=1.5)
    assert [capped.weigh(n, 0, count) for n, count in ((1, 100), (2, 100), (3, 400))] == [
        1.0,
        1.0,
        1.5,
    ]
    report = capped.flush()
    assert report.scale == pytest.approx(3.5 / 3) and report.weights == [1.0, 1.0, 1.5]
    assert not capped.weights and capped.updates_seen == 3  # the running mean outlives the buffer


def test_ess_counts_sites_not_updates():
    assert ess([1, 2, 3, 4], [1.0] * 4) == 4.0
    assert ess([1, 1, 1], [1.0, 1.0, 1.0]) == 1.0  # one fast site filled the buffer alone
    assert ess([1, 1, 2], [1.0, 1.0, 2.0]) == 2.0


@pytest.mark.parametrize("action", ["skip", "shrink"])
def test_the_ess_guard_skips_or_shrinks_a_buffer_dominated_by_one_site(action):
    # planted: site 1 sends three fresh updates, site 2 one 15 versions stale (weight 1/4): W = {1: 3, 2: 0.25}
    buffer = _buffer(buffer_size=4, ess_min=2.0, ess_action=action)
    for node, tau in ((1, 0), (1, 0), (2, 15), (1, 0)):
        buffer.weigh(node, tau, 20)
    report = buffer.flush()
    expected_ess = 3.25**2 / (3**2 + 0.25**2)
    assert report.ess == pytest.approx(expected_ess) and report.ess == pytest.approx(
        1.16552, abs=1e-5
    )
    assert report.staleness == [0, 0, 15, 0] and report.nodes == [1, 1, 2, 1]
    if action == "skip":
        assert report.skipped and report.scale == 0.0
    else:
        assert report.scale == pytest.approx(3.25 / 4 * expected_ess / 2.0)
    balanced = _buffer(buffer_size=2, ess_min=2.0, ess_action=action)
    balanced.weigh(1, 0, 20), balanced.weigh(2, 0, 20)
    assert balanced.flush().scale == 1.0  # ESS 2 is not below 2: untouched


def _reply(delta: list[float], examples: int, node: int):
    return make_reply({"w": np.array(delta)}, examples, node_id=node)


def test_fedbuff_step_is_the_staleness_weighted_sum_over_k():
    strategy = FedBuff(FedBuffConfig(buffer_size=3, weight_cap=0.9))
    arrays = ArrayRecord({"w": Array(START["w"])})
    deltas = {1: [0.3, 0.0, -0.6], 2: [0.9, 0.3, 0.0], 3: [-0.3, 0.6, 0.3]}
    for node, tau in ((1, 0), (2, 3), (3, 0)):
        assert not strategy.buffer_full
        strategy.add(_reply(deltas[node], 10, node), tau)
    assert strategy.buffer_full
    new, metrics, report = strategy.step(arrays)
    weights = [
        0.9,
        0.5,
        0.9,
    ]  # fresh updates capped at 0.9, the 3-versions-stale one weighs 1/sqrt(4)
    assert report.weights == pytest.approx(weights) and report.staleness == [0, 3, 0]
    expected = (
        START["w"]
        - sum(w * np.array(deltas[n]) for w, n in zip(weights, (1, 2, 3), strict=True)) / 3
    )
    np.testing.assert_allclose(new["w"].numpy(), expected, rtol=1e-6)
    assert metrics is not None and not strategy.buffer_full


def test_fedbuff_of_fresh_equal_updates_is_fedavg_and_a_skipped_buffer_keeps_the_model():
    strategy = FedBuff(FedBuffConfig(buffer_size=2))
    arrays = ArrayRecord({"w": Array(START["w"])})
    strategy.add(_reply([0.2, 0.4, 0.0], 30, 1), 0)
    strategy.add(_reply([0.0, -0.4, 1.0], 30, 2), 0)
    new, _, _ = strategy.step(arrays)
    np.testing.assert_allclose(new["w"].numpy(), START["w"] - np.array([0.1, 0.0, 0.5]), rtol=1e-6)
    guarded = FedBuff(FedBuffConfig(buffer_size=2, ess_min=2.0, ess_action="skip"))
    guarded.add(_reply([0.2, 0.4, 0.0], 30, 1), 0)
    guarded.add(_reply([0.2, 0.4, 0.0], 30, 1), 1)  # one site twice: ESS 1
    kept, _, report = guarded.step(arrays)
    assert report.skipped and kept is arrays


def test_knobs_are_checked_and_named():
    cfg = RunConfig.build(
        strategy="fedbuff", buffer_size=3, staleness="poly", staleness_exponent=0.7, weight_cap=2.0
    )
    assert cfg.options.rule_of_buffer() == BufferRule(
        buffer_size=3,
        staleness="poly",
        staleness_exponent=0.7,
        weight_cap=2.0,
        ess_min=0.0,
        ess_action="shrink",
    )
    for knobs, flag in (
        ({"buffer_size": 0}, "buffer-size"),
        ({"staleness": "exp"}, "staleness"),
        ({"ess_min": 3.0}, "ess-min"),
        ({"weight_cap": math.inf}, "weight-cap"),
        ({"ess_action": "drop"}, "ess-action"),
        ({"evaluate_every": 0}, "evaluate-every"),
    ):
        with pytest.raises(ConfigError, match=f"--{flag}="):
            RunConfig.build(strategy="fedbuff", **knobs)
    with pytest.raises(ConfigError, match="--dp-clip="):
        cfg.replace(dp_clip=1.0).options.build(cfg.replace(dp_clip=1.0))
