"""A plain Flower ServerApp and ClientApp that know nothing of hydrafl (used behind `hydrafl admin run create
--server-app` and `hydrafl site --app`): each train round adds 1.0 to every weight, so FedAvg's `w` after N
rounds is N."""

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

client_app = ClientApp()
server_app = ServerApp()


@client_app.train()
def train(message: Message, context: Context) -> Message:
    weights = message.content["arrays"]["w"].numpy() + 1.0
    content = RecordDict(
        {"arrays": ArrayRecord({"w": Array(weights)}), "metrics": MetricRecord({"num-examples": 2})}
    )
    return Message(content, reply_to=message)


@client_app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    metrics = MetricRecord(
        {"num-examples": 2, "loss": float(message.content["arrays"]["w"].numpy().mean())}
    )
    return Message(RecordDict({"metrics": metrics}), reply_to=message)


failing_client_app = ClientApp()


@failing_client_app.train()
@failing_client_app.evaluate()
def fail(message: Message, context: Context) -> Message:
    raise OSError("disk full at the site")


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """FedAvg over `num-server-rounds` rounds from w = 0; the final arrays go to `result-path` (an .npz) when set."""
    strategy = FedAvg(min_available_nodes=int(context.run_config.get("min-nodes", 2)))
    initial = ArrayRecord({"w": Array(np.zeros(3, dtype=np.float32))})
    result = strategy.start(
        grid=grid, initial_arrays=initial, num_rounds=int(context.run_config["num-server-rounds"])
    )
    if "result-path" in context.run_config:
        final = {name: array.numpy() for name, array in result.arrays.items()}
        np.savez(str(context.run_config["result-path"]), **final)
