"""A stock Flower app that knows nothing of hydrafl, the shape of Flower's quickstart-numpy: a linear model on
each site's seeded synthetic data, a few local gradient steps, FedAvg. NumPy only, so what a run costs beyond
the sites' arithmetic is the runtime's own (interpreter, imports, cluster start, dispatch)."""

from __future__ import annotations

import os

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

FEATURES = 64
SAMPLES = 256
STEPS = 5
LR = 0.05
ROUNDS = 3
RESULT_ENV = "STOCK_APP_RESULT"

client_app = ClientApp()
server_app = ServerApp()


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
    x, y = _site_data(int(context.node_config["partition-id"]))
    w = message.content["arrays"]["w"].numpy().copy()
    for _ in range(STEPS):
        loss, gradient = _loss_and_gradient(w, x, y)
        w -= LR * gradient
    content = RecordDict({"arrays": ArrayRecord({"w": Array(w)}),
                          "metrics": MetricRecord({"num-examples": SAMPLES, "train_loss": loss})})
    return Message(content, reply_to=message)


@client_app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    x, y = _site_data(int(context.node_config["partition-id"]))
    loss, _ = _loss_and_gradient(message.content["arrays"]["w"].numpy(), x, y)
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": SAMPLES, "loss": loss})}), reply_to=message)


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """FedAvg for `num-server-rounds` (default 3: Flower's Ray entry point passes no run config) from w = 0;
    the final weights and evaluation loss go to `$STOCK_APP_RESULT` (an .npz) when it is set."""
    rounds = int(context.run_config.get("num-server-rounds", ROUNDS))
    strategy = FedAvg(min_available_nodes=2)
    initial = ArrayRecord({"w": Array(np.zeros(FEATURES, dtype=np.float32))})
    result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=rounds)
    if os.environ.get(RESULT_ENV):
        loss = float(result.evaluate_metrics_clientapp[rounds]["loss"])
        np.savez(os.environ[RESULT_ENV], w=result.arrays["w"].numpy(), loss=np.float64(loss))
