"""In-process simulation: a Flower Grid whose sites live in this process, and the strategy comparison.

For any Flower app, `run_app` is the one-line switch from Flower's Ray simulation:

    from hydrafl.simulation import run_app
    run_app(server_app, client_app, num_sites=10, run_config={"num-server-rounds": 3})
"""

from __future__ import annotations

from flwr.app import Context, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import ServerApp

from hydrafl.simulation.grid import InProcessGrid


def run_app(
    server_app: ServerApp,
    client_app: ClientApp,
    *,
    num_sites: int,
    run_config: dict | None = None,
    workers: int = 1,
) -> Context:
    """Run any Flower ServerApp + ClientApp on `num_sites` in-process sites; returns the server's Context.
    `workers` > 1 (0: one per core) runs the sites in forked worker processes, with the same results; what the
    ClientApp changes outside its Context then stays in its worker."""
    with InProcessGrid(client_app, num_sites, run_config, workers=workers) as grid:
        context = Context(
            run_id=grid.run.run_id,
            node_id=SUPERLINK_NODE_ID,
            node_config={},
            state=RecordDict(),
            run_config=dict(run_config or {}),
        )
        server_app(grid, context)
    return context


__all__ = ["InProcessGrid", "run_app"]
