"""A plain Flower ClientApp that knows nothing of hydrafl (used behind `hydrafl site --app`)."""

from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

client_app = ClientApp()


@client_app.train()
def train(message: Message, context: Context) -> Message:
    weights = message.content["arrays"]["w"].numpy() + 1.0
    content = RecordDict({"arrays": ArrayRecord({"w": Array(weights)}), "metrics": MetricRecord({"num-examples": 2})})
    return Message(content, reply_to=message)


@client_app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    metrics = MetricRecord({"num-examples": 2, "loss": float(message.content["arrays"]["w"].numpy().mean())})
    return Message(RecordDict({"metrics": metrics}), reply_to=message)
