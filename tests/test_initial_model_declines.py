"""A site that cannot build the initial model (its data does not fit the run) declines; the next site is asked."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from helpers import SMALL_RUN

from hydrafl.client import site_app
from hydrafl.server import server_app
from hydrafl.simulation.grid import FIRST_NODE_ID, InProcessGrid

CFG = SMALL_RUN.replace(
    samples_per_site=40, rounds=1, local_steps=2, batch_size=8, lr=2e-3, min_sites=2
)
Handler = Callable[[Message, Context], Message]
REASON = "ValueError: --label-column 'outcom' is not a column of visits.csv (columns: age, lactate, outcome)"


def _declining_app(declining: set[int]) -> ClientApp:
    """The real site app, except that the sites in `declining` fail every message, as a wrong label column does."""
    app = ClientApp()

    def refuse_or(handler: Handler) -> Handler:
        def handle(message: Message, context: Context) -> Message:
            if context.node_id in declining:
                raise ValueError(REASON.removeprefix("ValueError: "))
            return handler(message, context)

        return handle

    app.train()(refuse_or(site_app.train))
    app.evaluate()(refuse_or(site_app.evaluate_site))
    app.query("init")(refuse_or(site_app.initial_model))
    return app


def test_the_next_site_builds_the_initial_model_when_the_first_declines(caplog):
    grid = InProcessGrid(_declining_app({FIRST_NODE_ID}), CFG.sites, CFG.to_flower())
    with caplog.at_level(logging.WARNING, logger="hydrafl.server.server_app"):
        arrays = server_app.request_initial_arrays(grid, CFG)
    expected = server_app.request_initial_arrays(
        InProcessGrid(site_app.client_app, CFG.sites, CFG.to_flower()), CFG
    )
    assert list(arrays) == list(expected)
    for name in expected:
        np.testing.assert_array_equal(arrays[name].numpy(), expected[name].numpy())
    declines = [r.getMessage() for r in caplog.records if r.name == "hydrafl.server.server_app"]
    assert declines == [f"site {FIRST_NODE_ID} declined to build the initial model: {REASON}"]


def test_a_run_with_one_misconfigured_site_trains_on_the_others():
    grid = InProcessGrid(_declining_app({FIRST_NODE_ID}), CFG.sites, CFG.to_flower())
    history = server_app.run_federation(grid, CFG).history
    assert [(r["round"], r["sites_ok"], r["sites_failed"]) for r in history[1:]] == [(1, 2, 1)]
    assert history[1]["loss"] > 0


def test_the_run_fails_only_when_every_site_declined_with_each_reason():
    grid = InProcessGrid(
        _declining_app({FIRST_NODE_ID, FIRST_NODE_ID + 1, FIRST_NODE_ID + 2}), CFG.sites
    )
    with pytest.raises(RuntimeError) as failure:
        server_app.request_initial_arrays(grid, CFG)
    reasons = "; ".join(f"site {FIRST_NODE_ID + i}: {REASON}" for i in range(CFG.sites))
    assert str(failure.value) == f"every site declined to build the initial model: {reasons}"
