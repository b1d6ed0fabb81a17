"""quickapp: the ClientApp."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from quickapp.task import loss, target

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    partition_id = int(context.node_config["partition-id"])
    weights = msg.content["arrays"].to_numpy_ndarrays()[0]
    lr = float(msg.content["config"]["lr"])
    trained = weights - lr * (weights - target(partition_id))
    metrics = MetricRecord(
        {"train_loss": loss(trained, partition_id), "num-examples": 10 * (partition_id + 1)}
    )
    content = RecordDict({"arrays": ArrayRecord([trained]), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    partition_id = int(context.node_config["partition-id"])
    weights = msg.content["arrays"].to_numpy_ndarrays()[0]
    metrics = MetricRecord(
        {"eval_loss": loss(weights, partition_id), "num-examples": 10 * (partition_id + 1)}
    )
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
