"""A private run's planning round releases nothing about a site's data: under central DP or secure aggregation
every site's layer and head scores are a function of the global model alone (each site reports the same ones),
where a plain run's sites report scores from their own data (which differ)."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord, MetricRecord
from helpers import TIERED_RUN

from hydrafl import protocol
from hydrafl.client import site_app
from hydrafl.server import server_app
from hydrafl.simulation.grid import InProcessGrid
from hydrafl.strategies import build_strategy
from hydrafl.updates import records


def _scores(**private: object) -> list[dict[str, float]]:
    cfg = TIERED_RUN.replace(**private)
    grid = InProcessGrid(site_app.client_app, cfg.sites, cfg.to_flower())
    arrays = server_app.request_initial_arrays(grid, cfg)
    queries = list(
        build_strategy(cfg).configure_query(1, arrays, ConfigRecord(cfg.to_flower()), grid)
    )
    replies = list(grid.send_and_receive(queries))
    assert len(replies) == cfg.sites and not any(reply.has_error() for reply in replies)
    prefixes = (protocol.LAYER_PREFIX, protocol.HEAD_PREFIX)
    return [
        {
            key: float(value)
            for key, value in records(reply.content, MetricRecord)[0].items()
            if key.startswith(prefixes)
        }
        for reply in replies
    ]


@pytest.mark.parametrize(
    "private", [{"dp_clip": 0.5, "dp_noise_multiplier": 1.0}, {"secagg": True}]
)
def test_private_runs_plan_from_the_weights_alone(private):
    plain, scored = _scores(), _scores(**private)
    assert plain[0].keys() == scored[0].keys() and len(scored[0]) > 4
    assert plain[0] != plain[1] != plain[2]  # scores from each site's own data
    assert (
        scored[0] == scored[1] == scored[2]
    )  # the same model, the same scores, whatever the site's data
    assert any(value > 0 for value in scored[0].values())
