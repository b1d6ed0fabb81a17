"""hydrafl's own ClientApp behind `hydrafl site --app slow_site_app:client_app`, made `HYDRAFL_SLOW_FACTOR` times
slower at training (it waits that many times its own training time minus one after training): a slow site
for the asynchronous end-to-end test, slower than the others by the same factor however busy the machine is.
Its first training is not slowed: it includes building the model and the data, which on a busy machine can take
longer than the whole run's other steps, and multiplied would leave the slow site out of the run altogether."""

import os
import time

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from hydrafl.apps import client_app as hydrafl_app

client_app = ClientApp()
trained = 0


@client_app.train()
def train(message: Message, context: Context) -> Message:
    global trained
    started = time.monotonic()
    reply = hydrafl_app(message, context)
    if trained:
        time.sleep(
            (float(os.environ.get("HYDRAFL_SLOW_FACTOR", "10")) - 1) * (time.monotonic() - started)
        )
    trained += 1
    return reply


@client_app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    return hydrafl_app(message, context)


@client_app.query("init")
def initial_model(message: Message, context: Context) -> Message:
    return hydrafl_app(message, context)
