"""One whole-process run of the stock Flower app (`_stock_app`) on 10 sites: through hydrafl's in-process grid
or through Flower's Ray simulation engine. `simulation_scale` times this process from start to exit, so it
imports only what its runtime needs: the interpreter, the imports and (for Ray) the cluster start all count."""

from __future__ import annotations

import os
import sys

SITES = 10


def main() -> None:
    runtime = sys.argv[1]
    from hydrafl.benchmarks._stock_app import client_app, server_app

    if runtime == "hydrafl":
        from hydrafl.simulation import run_app

        run_app(server_app, client_app, num_sites=SITES)
    elif runtime == "ray":
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        from flwr.simulation import run_simulation

        run_simulation(
            server_app=server_app,
            client_app=client_app,
            num_supernodes=SITES,
            backend_config={
                "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                "init_args": {"num_cpus": os.cpu_count() or 1, "include_dashboard": False},
            },
        )
    else:
        raise SystemExit(f"unknown runtime {runtime!r}; choose hydrafl or ray")


if __name__ == "__main__":
    main()
