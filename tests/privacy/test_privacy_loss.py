"""The auditor's check of central DP, for every strategy that accepts it: two neighbouring federations (one
site's update replaced by its negation, by zero, by another site's, or scaled x100), the same noise draw, and
the privacy loss mu between them measured against the accounted mu = 2 / z (replace-one, sensitivity 2C of the
sum of clipped updates, noise z C on it).

The noise is the mechanism's only randomness, so the test draws it: where the strategy adds noise, the value
before noise is recorded, and the neighbour's run gets the noise shifted so that the noised aggregate is the
first run's. Two things must then hold: the shift, in units of the noise's std, is at most 2 / z per round
(the loss between the neighbours), and both runs end with the same model (the strategy's output, state
included, depends on the data only through the noised aggregate: post-processing). A strategy that steps an
optimizer on the un-noised mean, or weighs sites by examples, fails one of the two."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from dp_neighbours import NEIGHBOURS, deltas, round_replies
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from helpers import TIERED_RUN

from hydrafl.client import site_app
from hydrafl.config import RunConfig
from hydrafl.privacy import central
from hydrafl.server import server_app
from hydrafl.simulation.grid import InProcessGrid
from hydrafl.strategies import build_strategy
from hydrafl.strategies.registry import config_class, mean_strategies, strategy_names
from hydrafl.updates import records
from hydrafl.validation import ConfigError

Z, CLIP = 1.0, 0.05


class DrawnNoise:
    """Stands in for `add_gaussian_` in central DP: adds a fixed standard-normal draw (call by call) times the
    std; in `follow` mode it shifts each draw so that the noised value is the one the recorded run released."""

    def __init__(self) -> None:
        self.draws: list[torch.Tensor] = []
        self.released: list[torch.Tensor] = []
        self.follow = False
        self.calls = 0
        self.shift_squared = 0.0
        """Sum over calls of ||shift / std||^2 in follow mode: mu^2."""

    def __call__(
        self, tensor: torch.Tensor, std: torch.Tensor | float, generator: torch.Generator
    ) -> torch.Tensor:
        std = torch.as_tensor(std, dtype=torch.float64).expand(tensor.shape)
        value = tensor.double()
        if not self.follow:
            draw = torch.randn(
                tensor.shape,
                generator=torch.Generator().manual_seed(self.calls),
                dtype=torch.float64,
            )
            self.draws.append(draw)
            noised = value + draw * std
            self.released.append(noised)
        else:
            noised = self.released[self.calls]
            shift = noised - value - self.draws[self.calls] * std
            noiseless = std == 0
            assert float(shift[noiseless].abs().sum()) < 1e-6, (
                "a coordinate released without noise changed"
            )
            self.shift_squared += float((shift[~noiseless] / std[~noiseless]).pow(2).sum())
        self.calls += 1
        tensor.copy_(noised.to(tensor.dtype))
        return tensor


def _run(name: str) -> RunConfig:
    lora = {"lora_rank": 4} if config_class(name).federates_lora else {}
    return TIERED_RUN.replace(strategy=name, dp_clip=CLIP, dp_noise_multiplier=Z, **lora)


def _replaced(reply: Message, arrays: dict[str, np.ndarray]) -> Message:
    """`reply` with other delta arrays (the same names, shapes and metrics)."""
    [record] = records(reply.content, ArrayRecord)
    [metrics] = records(reply.content, MetricRecord)
    replaced = ArrayRecord(
        {name: Array(np.ascontiguousarray(value)) for name, value in arrays.items()}
    )
    content = RecordDict({"arrays": replaced, "metrics": MetricRecord(dict(metrics))})
    assert list(record) == list(arrays)
    return Message(content, reply_to=_request(reply))


def _request(reply: Message) -> Message:
    request = Message(
        RecordDict(),
        dst_node_id=reply.metadata.src_node_id,
        message_type=reply.metadata.message_type,
    )
    request.metadata.__dict__["_message_id"] = reply.metadata.reply_to_message_id
    return request


@pytest.mark.parametrize("name", mean_strategies())
def test_one_round_privacy_loss_is_at_most_the_accounted_mu_and_the_output_is_post_processing(
    name, monkeypatch
):
    cfg = _run(name)
    grid = InProcessGrid(site_app.client_app, cfg.sites, cfg.to_flower())
    arrays = server_app.request_initial_arrays(grid, cfg)
    strategy = build_strategy(cfg)
    replies = round_replies(strategy, grid, cfg, 1, arrays)
    own, other = deltas(replies[0]), deltas(replies[1])
    assert (
        math.sqrt(sum(float((v.astype(np.float64) ** 2).sum()) for v in own.values())) > 2 * CLIP
    )  # clipped
    noise = DrawnNoise()
    monkeypatch.setattr(central, "add_gaussian_", noise)
    losses = {}
    for neighbour, replace in NEIGHBOURS.items():
        first, second = copy.deepcopy(strategy), copy.deepcopy(strategy)
        noise.__init__()
        released, _ = first.aggregate_train(1, iter(copy.deepcopy(replies)))
        noise.follow, noise.calls = True, 0
        neighbours = [_replaced(replies[0], replace(own, other)), *copy.deepcopy(replies[1:])]
        followed, _ = second.aggregate_train(1, iter(neighbours))
        assert noise.calls == len(noise.draws) > 0
        losses[neighbour] = math.sqrt(noise.shift_squared)
        for array_name in released:
            np.testing.assert_allclose(
                followed[array_name].numpy(),
                released[array_name].numpy(),
                rtol=1e-5,
                atol=1e-6,
                err_msg=f"{name}, {neighbour} neighbour: the output is not a function of the release",
            )
    accounted = 2 / Z
    assert max(losses.values()) <= accounted * (1 + 1e-4), losses
    assert losses["negated"] >= 0.5 * accounted, (
        losses
    )  # the check can see a loss: the extreme neighbour comes close


def test_stateful_server_optimizers_keep_only_post_processed_state(monkeypatch):
    """FedAvgM's momentum and FedAdam's moments over two rounds: the second round's output too is the same for
    neighbours whose releases agree, and the loss composes as sqrt(2) x 2 / z."""
    for name in ("fedavgm", "fedadam", "diloco"):
        cfg = _run(name)
        grid = InProcessGrid(site_app.client_app, cfg.sites, cfg.to_flower())
        arrays = server_app.request_initial_arrays(grid, cfg)
        strategy = build_strategy(cfg)
        replies = round_replies(strategy, grid, cfg, 1, arrays)
        neighbours = [
            _replaced(replies[0], NEIGHBOURS["negated"](deltas(replies[0]), {})),
            *replies[1:],
        ]
        noise = DrawnNoise()
        monkeypatch.setattr(central, "add_gaussian_", noise)
        first, second = copy.deepcopy(strategy), copy.deepcopy(strategy)
        outputs = []
        for run_strategy, run_replies, follow in (
            (first, replies, False),
            (second, neighbours, True),
        ):
            noise.follow, noise.calls = follow, 0
            model = arrays
            for server_round in (1, 2):
                run_strategy.configure_train(
                    server_round, model, ConfigRecord(cfg.to_flower()), grid
                )
                model, _ = run_strategy.aggregate_train(
                    server_round, iter(copy.deepcopy(run_replies))
                )
            outputs.append(model)
        for array_name in outputs[0]:
            second_model, first_model = (
                outputs[1][array_name].numpy(),
                outputs[0][array_name].numpy(),
            )
            np.testing.assert_allclose(second_model, first_model, rtol=1e-5, atol=1e-6)
        assert math.sqrt(noise.shift_squared) <= math.sqrt(2) * 2 / Z * (1 + 1e-4)


def test_strategies_whose_output_is_not_post_processing_are_refused_by_name():
    refused = set(strategy_names()) - set(mean_strategies())
    assert {"fedmedian", "fedtrimmedavg", "krum", "multikrum", "bulyan"} <= refused
    for name in sorted(refused):
        lora = {"lora_rank": 4} if config_class(name).federates_lora else {}
        with pytest.raises(
            ConfigError, match=f"0 for strategy '{name}': its output is not a post-processing"
        ):
            RunConfig.build(strategy=name, dp_clip=CLIP, dp_noise_multiplier=Z, **lora)
