"""The in-process grid's worker processes: the same replies, state and sums as the sites run one after another,
a dead worker costs only its site's reply, and the replies run ahead of the consumer by a bounded window."""

from __future__ import annotations

import logging
import multiprocessing
import os
import random
import signal

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import ServerApp
from flwr.serverapp.strategy import FedAvg, FedMedian, Krum

from hydrafl.server.aggregation.checkpoint import load_checkpoint
from hydrafl.simulation import InProcessGrid, run_app
from hydrafl.simulation.compare import run_strategy
from hydrafl.simulation.workers import WorkerPool, available_cores, make_job, worker_count
from hydrafl.simulation_config import build_simulation_config
from hydrafl.validation import ConfigError

START = np.zeros((2, 3), dtype=np.float32)
CRASH = {"exit": lambda: os._exit(3), "kill": lambda: os.kill(os.getpid(), signal.SIGKILL)}


def _stateful_app(crash_site: int | None = None, crash: str = "exit") -> ClientApp:
    """A stock Flower app whose update depends on its site's Context state: site k adds (k + 1) x (the rounds
    it trained before + 1), so a lost or misrouted state changes the sums. `crash_site` dies in training."""
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        site = int(context.node_config["partition-id"])
        if site == crash_site:
            CRASH[crash]()
        seen = int(context.state["seen"]["rounds"]) if "seen" in context.state else 0
        context.state["seen"] = MetricRecord({"rounds": seen + 1})
        logging.getLogger("hydrafl.tests.site").warning("site %d trained %d times", site, seen + 1)
        weights = message.content["arrays"]["w"].numpy() + np.float32(0.1) * (site + 1) * (seen + 1)
        content = RecordDict(
            {
                "arrays": ArrayRecord({"w": Array(weights)}),
                "metrics": MetricRecord({"num-examples": 3 * site + 1, "seen": seen + 1}),
            }
        )
        return Message(content, reply_to=message)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        if "fail" in message.content["config"]:
            raise KeyError("no such column")
        site = int(context.node_config["partition-id"])
        loss = float(message.content["arrays"]["w"].numpy().sum()) / (site + 1)
        return Message(
            RecordDict({"metrics": MetricRecord({"num-examples": site + 1, "loss": loss})}),
            reply_to=message,
        )

    return app


def _train(
    grid: InProcessGrid, arrays: ArrayRecord, nodes: list[int] | None = None
) -> list[Message]:
    messages = [
        Message(
            RecordDict({"arrays": arrays, "config": ConfigRecord()}),
            dst_node_id=n,
            message_type="train",
        )
        for n in nodes or grid.get_node_ids()
    ]
    return list(grid.send_and_receive(messages))


def _rounds(
    strategy, workers: int, sites: int = 7, rounds: int = 3
) -> tuple[np.ndarray, list, list]:
    """A stock strategy's run on the stateful app: final weights, each round's train metrics, site states."""
    random.seed(0)  # Flower samples the sites with `random`
    with InProcessGrid(_stateful_app(), sites, workers=workers) as grid:
        result = strategy.start(
            grid=grid, initial_arrays=ArrayRecord({"w": Array(START)}), num_rounds=rounds
        )
        states = [
            int(c.state["seen"]["rounds"]) if "seen" in c.state else 0
            for c in grid.contexts.values()
        ]
    metrics = [dict(result.train_metrics_clientapp[r]) for r in range(1, rounds + 1)]
    return result.arrays["w"].numpy(), metrics, states


@pytest.mark.parametrize(
    "make_strategy",
    [lambda: FedAvg(fraction_train=0.6), FedMedian, lambda: Krum(num_malicious_nodes=1)],
)
def test_workers_give_the_sequential_sums_bit_for_bit_with_site_state_kept(make_strategy):
    sequential = _rounds(make_strategy(), workers=1)
    parallel = _rounds(make_strategy(), workers=2)
    assert sequential[0].tobytes() == parallel[0].tobytes()
    assert sequential[1] == parallel[1]
    assert sequential[2] == parallel[2]
    assert (
        sum(sequential[2]) > 3
    )  # sampled sites trained more than once: their state decided their updates


def test_run_app_takes_workers_and_ends_them():
    finals = []
    for workers in (1, 2):
        server_app = ServerApp()

        @server_app.main()
        def main(grid, context: Context) -> None:
            result = FedAvg().start(
                grid=grid, initial_arrays=ArrayRecord({"w": Array(START)}), num_rounds=2
            )
            context.state["final"] = result.arrays

        finals.append(
            run_app(server_app, _stateful_app(), num_sites=3, workers=workers)
            .state["final"]["w"]
            .numpy()
        )
    assert finals[0].tobytes() == finals[1].tobytes()
    assert not [
        child for child in multiprocessing.active_children() if child.name == "hydrafl-site-worker"
    ]


def test_state_travels_with_each_message_so_any_worker_can_answer_any_site():
    with InProcessGrid(_stateful_app(), num_sites=5, workers=3) as grid:
        arrays = ArrayRecord({"w": Array(START)})
        nodes = sorted(grid.get_node_ids())
        for subset in (
            nodes,
            nodes[::2],
            nodes[1:],
            nodes,
        ):  # uneven rounds: sites land on different workers
            replies = _train(grid, arrays, subset)
            assert [r.metadata.src_node_id for r in replies] == subset
        seen = [int(context.state["seen"]["rounds"]) for context in grid.contexts.values()]
        assert seen == [3, 3, 4, 3, 4]
        assert [r.content["metrics"]["seen"] for r in replies] == [3, 3, 4, 3, 4]


def test_a_dead_worker_fails_only_its_site_and_the_next_round_goes_on():
    with InProcessGrid(_stateful_app(crash_site=1), num_sites=4, workers=2) as grid:
        arrays = ArrayRecord({"w": Array(START)})
        for _ in range(2):
            replies = _train(grid, arrays)
            failed = [r for r in replies if r.has_error()]
            assert [r.metadata.src_node_id for r in failed] == [grid_node(grid, 1)]
            assert failed[0].error.code == ErrorCode.CLIENT_APP_CRASHED
            assert (
                failed[0].error.reason == "its worker process exited with code 3 while it answered"
            )
            assert all(not r.has_error() for r in replies if r not in failed) and len(replies) == 4
        seen = {
            context.node_config["partition-id"]: context.state.get("seen")
            for context in grid.contexts.values()
        }
        assert seen[1] is None and [int(seen[k]["rounds"]) for k in (0, 2, 3)] == [2, 2, 2]


def test_a_killed_worker_is_named_by_its_signal():
    with InProcessGrid(_stateful_app(crash_site=0, crash="kill"), num_sites=2, workers=2) as grid:
        replies = _train(grid, ArrayRecord({"w": Array(START)}))
    assert replies[0].error.reason == "its worker process was killed by SIGKILL while it answered"
    assert not replies[1].has_error()


def test_an_app_exception_and_its_logs_reach_the_server_as_in_sequence(caplog):
    """The error reply is the sequential grid's; the sites' log records come back in node order."""
    caplog.set_level(logging.WARNING)
    arrays = ArrayRecord({"w": Array(START)})
    reasons = {}
    for workers in (1, 2):
        caplog.clear()
        with InProcessGrid(_stateful_app(), num_sites=3, workers=workers) as grid:
            _train(grid, arrays)
            assert [r.message for r in caplog.records] == [
                f"site {k} trained 1 times" for k in range(3)
            ]
            evaluate = [
                Message(
                    RecordDict({"arrays": arrays, "config": ConfigRecord({"fail": 1})}),
                    dst_node_id=n,
                    message_type="evaluate",
                )
                for n in grid.get_node_ids()
            ]
            reasons[workers] = [
                (r.error.code, r.error.reason) for r in grid.send_and_receive(evaluate)
            ]
            missing = Message(RecordDict(), dst_node_id=42, message_type="train")
            [reply] = grid.send_and_receive([missing])
            assert reply.error.reason == "no site with node id 42"
    assert (
        reasons[1]
        == reasons[2]
        == [(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "KeyError: 'no such column'")] * 3
    )


def test_the_pool_takes_jobs_only_a_window_ahead_of_the_consumer():
    """Memory stays bounded by the window, however many sites: the jobs (and their replies) it holds."""
    app = _stateful_app()
    context = Context(
        run_id=1, node_id=7, node_config={"partition-id": 0}, state=RecordDict(), run_config={}
    )
    message = Message(
        RecordDict({"arrays": ArrayRecord({"w": Array(START)}), "config": ConfigRecord()}),
        dst_node_id=7,
        message_type="train",
    )
    message.metadata.__dict__["_message_id"] = "m"
    taken = []

    def jobs():
        for index in range(50):
            taken.append(index)
            yield make_job(message, context)

    with WorkerPool(2, lambda m, c: app(message=m, context=c)) as pool:
        results = pool.run(jobs(), window=4)
        first = next(results)
        assert len(taken) <= 5 and not first.crash
        assert len(list(results)) == 49 and len(taken) == 50
        assert len(list(pool.run(iter([None, make_job(message, context)])))) == 2


def test_results_of_a_run_stopped_early_never_answer_the_next_run():
    app = _stateful_app()
    arrays = ArrayRecord({"w": Array(START)})

    def job(site: int):
        context = Context(
            run_id=1,
            node_id=site,
            node_config={"partition-id": site},
            state=RecordDict(),
            run_config={},
        )
        message = Message(
            RecordDict({"arrays": arrays, "config": ConfigRecord()}),
            dst_node_id=site,
            message_type="train",
        )
        message.metadata.__dict__["_message_id"] = str(site)
        return make_job(message, context)

    def first_weight(result) -> float:
        return float(result.reply_message().content["arrays"]["w"].numpy()[0, 0])

    with WorkerPool(2, lambda m, c: app(message=m, context=c)) as pool:
        stopped = pool.run([job(site) for site in range(6)])
        assert first_weight(next(stopped)) == pytest.approx(0.1)
        stopped.close()  # workers were busy with sites 1 and 2
        assert [first_weight(r) for r in pool.run([job(5), job(4)])] == [
            pytest.approx(0.6),
            pytest.approx(0.5),
        ]


def test_worker_count_defaults_to_the_cores_and_refuses_a_negative_number():
    assert worker_count(0, 1000) == available_cores()
    assert worker_count(0, 1) == 1 and worker_count(8, 3) == 3 and worker_count(1, 100) == 1
    with pytest.raises(ValueError, match="workers must be >= 0"):
        worker_count(-1, 10)
    assert build_simulation_config({"workers": 2, "strategies": "fedavg", "out": "x"}).workers == 2
    with pytest.raises(ConfigError, match="workers"):
        build_simulation_config({"workers": -2, "strategies": "fedavg", "out": "x"})


def test_a_hydrafl_federation_on_two_workers_ends_bit_identical(small_run, tmp_path):
    """hydrafl's own sites (a trained model, the site pipeline, sampled sites): final arrays and every round's
    numbers are the sequential run's."""
    cfg = small_run.replace(sites=5, fraction_train=0.6, rounds=2)
    histories, arrays = {}, {}
    for workers in (1, 2):
        run_dir = tmp_path / f"workers-{workers}"
        histories[workers] = run_strategy(
            cfg.replace(run_dir=str(run_dir)), "inprocess", workers=workers
        )
        arrays[workers] = load_checkpoint(run_dir).arrays
    assert list(arrays[1]) == list(arrays[2])
    assert all(
        arrays[1][name].numpy().tobytes() == arrays[2][name].numpy().tobytes() for name in arrays[1]
    )
    timing = ("seconds", "aggregation_s", "gap_s")
    untimed = [
        [{k: v for k, v in r.items() if k not in timing} for r in histories[w]] for w in (1, 2)
    ]
    assert untimed[0] == untimed[1]
    assert [r["sites_ok"] for r in histories[2][1:]] == [3, 3]


def grid_node(grid: InProcessGrid, partition: int) -> int:
    return next(
        node
        for node, context in grid.contexts.items()
        if context.node_config["partition-id"] == partition
    )
