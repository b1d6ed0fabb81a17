"""Conformance: stock Flower apps and built-in strategies run unmodified on the in-process grid."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, FedAvgM, FedMedian, FedProx, FedTrimmedAvg, Krum

from hydrafl.simulation import InProcessGrid, run_app

OFFSETS = (1.0, 2.0, 3.0, 10.0)  # site k adds OFFSETS[k] to every weight and reports k + 1 examples
START = np.zeros((2, 3), dtype=np.float32)


def _stock_client_app() -> ClientApp:
    """A plain Flower ClientApp that knows nothing of hydrafl."""
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        site = int(context.node_config["partition-id"])
        weights = message.content["arrays"]["w"].numpy() + OFFSETS[site]
        seen = context.state["seen"]["rounds"] if "seen" in context.state else 0
        context.state["seen"] = MetricRecord({"rounds": seen + 1})
        metrics = {
            "num-examples": site + 1,
            "proximal-mu": float(message.content["config"].get("proximal-mu", -1.0)),
        }
        content = RecordDict(
            {"arrays": ArrayRecord({"w": Array(weights)}), "metrics": MetricRecord(metrics)}
        )
        return Message(content, reply_to=message)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        site = int(context.node_config["partition-id"])
        metrics = MetricRecord({"num-examples": site + 1, "loss": float(site)})
        return Message(RecordDict({"metrics": metrics}), reply_to=message)

    return app


def _stock_server_app(strategy, rounds: int) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        initial = ArrayRecord({"w": Array(START)})
        result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=rounds)
        context.state["final"] = result.arrays
        context.state["train-metrics"] = result.train_metrics_clientapp[rounds]

    return app


def _weighted_mean() -> float:
    return sum((k + 1) * o for k, o in enumerate(OFFSETS)) / sum(range(1, len(OFFSETS) + 1))


CASES = {
    "fedavg": (lambda: FedAvg(min_available_nodes=4), 2 * _weighted_mean()),
    "fedprox": (lambda: FedProx(proximal_mu=0.25, min_available_nodes=4), 2 * _weighted_mean()),
    "fedmedian": (lambda: FedMedian(min_available_nodes=4), 2 * 2.5),
    "fedtrimmedavg": (lambda: FedTrimmedAvg(beta=0.25, min_available_nodes=4), 2 * 2.5),
    # Krum with f=0 keeps the update with the smallest summed distance to its n-f-2=2 nearest: offset 2.
    "krum": (lambda: Krum(num_malicious_nodes=0, min_available_nodes=4), 2 * 2.0),
    # FedAvgM (lr 1, momentum 0.5): round 1 moves by m, round 2 by m + 0.5 m.
    "fedavgm": (
        lambda: FedAvgM(server_momentum=0.5, min_available_nodes=4),
        _weighted_mean() * 2.5,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_builtin_strategy_runs_unmodified(name):
    make_strategy, expected_shift = CASES[name]
    context = run_app(
        _stock_server_app(make_strategy(), rounds=2), _stock_client_app(), num_sites=4
    )
    final = context.state["final"]["w"].numpy()
    np.testing.assert_allclose(final, START + expected_shift, rtol=1e-6)
    mu = context.state["train-metrics"]["proximal-mu"]
    assert mu == pytest.approx(0.25 if name == "fedprox" else -1.0)


def test_site_context_persists_across_rounds_and_crashes_become_error_replies():
    app = _stock_client_app()
    grid = InProcessGrid(app, num_sites=2)
    arrays = ArrayRecord({"w": Array(START)})
    for _ in range(3):
        messages = [
            Message(
                RecordDict({"arrays": arrays, "config": ConfigRecord()}),
                dst_node_id=n,
                message_type="train",
            )
            for n in grid.get_node_ids()
        ]
        replies = list(grid.send_and_receive(messages))
        assert [r.metadata.src_node_id for r in replies] == sorted(grid.get_node_ids())
    assert [ctx.state["seen"]["rounds"] for ctx in grid.contexts.values()] == [3, 3]

    node = min(grid.get_node_ids())
    broken = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=node, message_type="train")
    [reply] = grid.send_and_receive([broken])
    assert reply.has_error() and "KeyError" in reply.error.reason
    missing = Message(RecordDict(), dst_node_id=42, message_type="train")
    [reply] = grid.send_and_receive([missing])
    assert reply.has_error() and "no site with node id 42" in reply.error.reason


def test_server_arrays_are_isolated_from_site_mutation():
    app = ClientApp()

    @app.train()
    def mutate(message: Message, context: Context) -> Message:
        message.content["arrays"]["w"] = Array(START + 99)
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=message)

    grid = InProcessGrid(app, num_sites=1)
    arrays = ArrayRecord({"w": Array(START)})
    node = min(grid.get_node_ids())
    [reply] = grid.send_and_receive(
        [Message(RecordDict({"arrays": arrays}), dst_node_id=node, message_type="train")]
    )
    assert not reply.has_error()
    np.testing.assert_array_equal(arrays["w"].numpy(), START)


def test_replies_stream_in_node_order_each_site_running_when_its_reply_is_asked_for():
    ran = []
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        ran.append(context.node_id)
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=message)

    grid = InProcessGrid(app, num_sites=3)
    nodes = sorted(grid.get_node_ids())
    replies = grid.send_and_receive(
        [Message(RecordDict(), dst_node_id=n, message_type="train") for n in reversed(nodes)]
    )
    assert ran == []
    assert (next(replies).metadata.src_node_id, ran) == (nodes[0], nodes[:1])
    assert [reply.metadata.src_node_id for reply in replies] == nodes[1:]
    assert ran == nodes
