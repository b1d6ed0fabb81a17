"""The asynchronous driver on the simulation's virtual clock: deterministic, with the event order and
staleness that the sites' speeds dictate, for FedBuff and its Hydra-net variant; a failing site dropped."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from helpers import ASYNC_SITES

from hydrafl.client import site_app
from hydrafl.config import RunConfig
from hydrafl.server import server_app
from hydrafl.server.aggregation import async_driver
from hydrafl.server.aggregation.async_driver import simulated_speeds
from hydrafl.server.aggregation.driver import RoundFailed
from hydrafl.simulation.grid import FIRST_NODE_ID, InProcessGrid

SLOW = FIRST_NODE_ID + 3
RECEIVE = async_driver.VirtualClock.receive


def _run(
    cfg: RunConfig, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, np.ndarray], list[dict], list[int]]:
    """Final arrays, history and the order replies were delivered in (node ids)."""
    order: list[int] = []

    def recorded(clock, timeout_s):
        reply = RECEIVE(clock, timeout_s)
        order.append(reply.metadata.src_node_id)
        return reply

    monkeypatch.setattr(async_driver.VirtualClock, "receive", recorded)
    grid = InProcessGrid(site_app.client_app, cfg.sites, cfg.to_flower())
    result = server_app.run_federation(
        grid, cfg, virtual_speeds=simulated_speeds(grid.contexts, cfg.speed_list)
    )
    return {name: array.numpy() for name, array in result.arrays.items()}, result.history, order


def _timeless(history: list[dict]) -> list[dict]:
    return [
        {k: v for k, v in entry.items() if k not in ("seconds", "aggregation_s", "gap_s")}
        for entry in history
    ]


def test_virtual_clock_runs_are_identical_and_follow_the_sites_speeds(monkeypatch):
    cfg = RunConfig.build(**ASYNC_SITES, strategy="fedbuff", rounds=11, buffer_size=3)
    arrays, history, order = _run(cfg, monkeypatch)
    again, history_again, order_again = _run(cfg, monkeypatch)
    assert order == order_again and _timeless(history) == _timeless(history_again)
    for name in arrays:
        np.testing.assert_array_equal(arrays[name], again[name])
    # three speed-1 sites fill a buffer every virtual second; the 10x slower one answers at t = 10, first of
    # that instant (it was sent first), with the model of version 0 while the model is at version 9
    assert [entry["virtual_s"] for entry in history[1:]] == [float(t) for t in range(1, 11)] + [
        11.0
    ]
    assert (
        order[:3] == [FIRST_NODE_ID, FIRST_NODE_ID + 1, FIRST_NODE_ID + 2]
        and order.index(SLOW) == 27
    )
    # the first two of an instant were sent the model before that instant's step, the third after it
    assert history[1]["staleness"] == [0, 0, 0] and history[2]["staleness"] == [1, 1, 0]
    assert history[10]["staleness"] == [9, 1, 1]
    assert history[10]["ess"] == pytest.approx(
        (1 / np.sqrt(10) + 2 / np.sqrt(2)) ** 2 / (0.1 + 2 * 0.5)
    )
    assert all(entry["loss"] is not None for entry in history)
    assert history[-1]["loss"] < history[0]["loss"]


def test_evaluate_every_skips_evaluations_but_not_the_last(monkeypatch):
    cfg = RunConfig.build(
        **ASYNC_SITES, strategy="fedbuff", rounds=5, buffer_size=2, evaluate_every=2
    )
    _, history, _ = _run(cfg, monkeypatch)
    assert [entry["loss"] is not None for entry in history] == [
        True,
        False,
        True,
        False,
        True,
        True,
    ]


def test_fedbuff_hydra_trains_per_site_hydra_nets_asynchronously(monkeypatch):
    cfg = RunConfig.build(
        **{**ASYNC_SITES, "site_tiers": "small,large"},
        strategy="fedbuff-hydra",
        rounds=4,
        buffer_size=2,
    )
    arrays, history, order = _run(cfg, monkeypatch)
    _, history_again, order_again = _run(cfg, monkeypatch)
    assert order == order_again and _timeless(history) == _timeless(history_again)
    trained = history[1]["trainable_params_per_site"]
    small, large = trained[str(FIRST_NODE_ID)], trained[str(FIRST_NODE_ID + 1)]
    assert 0 < small < large  # a small-tier site trains a smaller Hydra-net
    up = history[1]["bytes_up_per_site"]
    assert up[str(FIRST_NODE_ID)] < up[str(FIRST_NODE_ID + 1)]
    assert (
        all(np.isfinite(a).all() for a in arrays.values())
        and history[-1]["loss"] < history[0]["loss"]
    )


failing_app = ClientApp()


@failing_app.train()
def _train(message: Message, context: Context) -> Message:
    if context.node_config["partition-id"] == 3:
        raise RuntimeError("planted failure")
    return site_app.client_app(message, context)


@failing_app.evaluate()
def _evaluate(message: Message, context: Context) -> Message:
    return site_app.client_app(message, context)


@failing_app.query("init")
def _init(message: Message, context: Context) -> Message:
    return site_app.client_app(message, context)


def _run_failing(cfg: RunConfig):
    grid = InProcessGrid(failing_app, cfg.sites, cfg.to_flower())
    return server_app.run_federation(grid, cfg, virtual_speeds=simulated_speeds(grid.contexts, ()))


def test_a_site_that_keeps_failing_is_sent_no_more_work_and_min_sites_decides():
    cfg = RunConfig.build(
        **{**ASYNC_SITES, "site_speeds": ""},
        strategy="fedbuff",
        rounds=5,
        buffer_size=3,
        min_sites=3,
    )
    history = _run_failing(cfg).history
    # it answers (with an error) at t = 1, 2, 3, each time after the three good replies that made that step
    assert [entry["sites_failed"] for entry in history[1:]] == [0, 1, 1, 1, 0]
    assert [entry["virtual_s"] for entry in history[1:]] == [1.0, 2.0, 3.0, 4.0, 5.0]
    with pytest.raises(RoundFailed, match="only 3 sites are still training, 4 required"):
        _run_failing(cfg.replace(min_sites=0))


def test_a_resumed_run_goes_on_from_its_last_step_with_the_strategy_state(tmp_path, monkeypatch):
    cfg = RunConfig.build(
        **ASYNC_SITES, strategy="fedbuff", rounds=3, buffer_size=3, run_dir=str(tmp_path)
    )
    _, history, _ = _run(cfg, monkeypatch)
    _, resumed, order = _run(cfg.replace(rounds=5, resume=True), monkeypatch)
    assert [entry["round"] for entry in resumed] == [0, 1, 2, 3, 4, 5] and _timeless(
        resumed[:4]
    ) == _timeless(history)
    assert order[:3] == [
        FIRST_NODE_ID + i for i in range(3)
    ]  # every site is sent the version-3 model again
    assert (
        resumed[4]["staleness"] == [0, 0, 0] and resumed[4]["virtual_s"] == 1.0
    )  # the clock restarts
