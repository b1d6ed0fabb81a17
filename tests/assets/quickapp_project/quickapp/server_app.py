"""quickapp: the ServerApp (FedAvg); with `result-path` it writes its Result there as JSON."""

import json

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from quickapp.task import DIM

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    strategy = FedAvg(min_available_nodes=int(context.run_config["min-nodes"]))
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord([np.zeros(DIM, dtype=np.float32)]),
        train_config=ConfigRecord({"lr": float(context.run_config["lr"])}),
        num_rounds=int(context.run_config["num-server-rounds"]),
    )
    if "result-path" in context.run_config:
        record = {
            "weights": result.arrays.to_numpy_ndarrays()[0].tolist(),
            "train": {str(r): dict(m) for r, m in result.train_metrics_clientapp.items()},
            "evaluate": {str(r): dict(m) for r, m in result.evaluate_metrics_clientapp.items()},
        }
        with open(str(context.run_config["result-path"]), "w") as file:
            json.dump(record, file)
