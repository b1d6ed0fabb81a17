"""A stock Flower app that knows nothing of hydrafl, the shape of Flower's quickstart-numpy: a linear model on
each site's seeded synthetic data, a few local gradient steps, FedAvg. NumPy only, so what a run costs beyond
the sites' arithmetic is the runtime's own (interpreter, imports, cluster start, dispatch). `round_overhead` runs
it deployed (Flower's SuperLink + SuperNodes, hydrafl's coordinator + sites), where the ServerApp times its own
rounds (`TimedFedAvg`), so both runtimes' rounds are measured by the same code."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

FEATURES = 64
SAMPLES = 256
STEPS = 5
LR = 0.05
ROUNDS = 3
RESULT_ENV = "STOCK_APP_RESULT"
ROUND_TIMES_KEY = "round-times-path"
MIN_SITES = 2

client_app = ClientApp()
server_app = ServerApp()


class TimedFedAvg(FedAvg):
    """FedAvg that notes each round's seconds from its start (`configure_train`) to its end (`aggregate_evaluate`):
    sending, the sites' training and evaluation, replies and aggregation, as hydrafl's `rounds.tsv` counts them."""

    def __init__(self, min_available_nodes: int) -> None:
        super().__init__(min_available_nodes=min_available_nodes)
        self.started: dict[int, float] = {}
        self.seconds: list[float] = []

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.started[server_round] = time.monotonic()
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        metrics = super().aggregate_evaluate(server_round, replies)
        self.seconds.append(time.monotonic() - self.started[server_round])
        return metrics


def _partition(context: Context) -> int:
    """The site's `partition-id` (simulations, `flower-supernode --node-config`); a deployed site that has none
    (`hydrafl site --app`) seeds its data by its node id."""
    return int(context.node_config.get("partition-id", context.node_id))


def _wait_for_nodes(grid: Grid, count: int) -> None:
    """Start round 1 once the sites are there, so its seconds do not count the sites' start (a deployment's
    sites join while the ServerApp starts; FedAvg would wait inside round 1)."""
    while len(list(grid.get_node_ids())) < count:
        time.sleep(0.05)


def _site_data(partition: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(partition)
    x = rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
    true_w = np.linspace(-1, 1, FEATURES, dtype=np.float32) + 0.1 * partition
    return x, x @ true_w + 0.1 * rng.standard_normal(SAMPLES).astype(np.float32)


def _loss_and_gradient(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    error = x @ w - y
    return float(np.mean(error**2)), 2 * x.T @ error / len(y)


@client_app.train()
def train(message: Message, context: Context) -> Message:
    x, y = _site_data(_partition(context))
    w = message.content.array_records["arrays"]["w"].numpy().copy()
    for _ in range(STEPS):
        loss, gradient = _loss_and_gradient(w, x, y)
        w -= LR * gradient
    content = RecordDict(
        {
            "arrays": ArrayRecord({"w": Array(w)}),
            "metrics": MetricRecord({"num-examples": SAMPLES, "train_loss": loss}),
        }
    )
    return Message(content, reply_to=message)


@client_app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    x, y = _site_data(_partition(context))
    loss, _ = _loss_and_gradient(message.content.array_records["arrays"]["w"].numpy(), x, y)
    return Message(
        RecordDict({"metrics": MetricRecord({"num-examples": SAMPLES, "loss": loss})}),
        reply_to=message,
    )


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """FedAvg for `num-server-rounds` (default 3: Flower's Ray entry point passes no run config) from w = 0;
    the final weights and evaluation loss go to `$STOCK_APP_RESULT` (an .npz) when it is set, each round's
    seconds to `round-times-path` (a JSON list) when the run config names one."""
    rounds = int(context.run_config.get("num-server-rounds", ROUNDS))
    strategy = TimedFedAvg(min_available_nodes=MIN_SITES)
    initial = ArrayRecord({"w": Array(np.zeros(FEATURES, dtype=np.float32))})
    _wait_for_nodes(grid, MIN_SITES)
    result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=rounds)
    if context.run_config.get(ROUND_TIMES_KEY):
        with open(str(context.run_config[ROUND_TIMES_KEY]), "w") as out:
            json.dump(strategy.seconds, out)
    if os.environ.get(RESULT_ENV):
        loss = result.evaluate_metrics_clientapp[rounds]["loss"]
        assert isinstance(loss, float | int)  # a MetricRecord value may be a list too
        np.savez(os.environ[RESULT_ENV], w=result.arrays["w"].numpy(), loss=np.float64(loss))
