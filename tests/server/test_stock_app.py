"""A stock Flower ServerApp + ClientApp run unchanged over hydrafl's coordinator and site agents."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from helpers import local_coordinator

from hydrafl.server.transport.grid import CoordinatorGrid

TESTS = Path(__file__).resolve().parents[1]
HYDRAFL_SCRIPT = str(Path(sys.executable).with_name("hydrafl"))
"""The console script README's users run (unlike `python -m`, it puts no working directory on the path)."""


@pytest.mark.slow
def test_stock_flower_apps_behind_hydrafl_site(tmp_path):
    coordinator = local_coordinator(tmp_path)
    tokens = [coordinator.store.add_site(name)[1] for name in ("a", "b")]
    run = coordinator.store.create_run({"strategy": "fedavg"})
    coordinator.store.set_run_status(run.id, "running")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    sites = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hydrafl",
                "site",
                "--coordinator",
                f"127.0.0.1:{coordinator.port}",
                "--token",
                token,
                "--app",
                "stock_flower_app:client_app",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for token in tokens
    ]
    try:
        deadline = time.monotonic() + 120
        while len(coordinator.service.connected_nodes()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        server_app = ServerApp()
        result = {}

        @server_app.main()
        def main(grid: Grid, context: Context) -> None:
            initial = ArrayRecord({"w": Array(np.zeros(3, dtype=np.float32))})
            strategy = FedAvg(min_available_nodes=2)
            result["final"] = strategy.start(
                grid=grid, initial_arrays=initial, num_rounds=2, timeout=120
            ).arrays

        grid = CoordinatorGrid(coordinator.store, coordinator.blobs, coordinator.service, run.id)
        server_app(
            grid,
            Context(run_id=run.id, node_id=0, node_config={}, state=RecordDict(), run_config={}),
        )
        np.testing.assert_array_equal(
            result["final"]["w"].numpy(), np.full(3, 2.0, dtype=np.float32)
        )
        accepted = (
            2 * 2 * 2
        )  # 2 rounds x train+eval x 2 sites; each audited just after its reply is stored
        deadline = time.monotonic() + 10
        while (
            len(coordinator.store.audit_events("update-accepted")) < accepted
            and time.monotonic() < deadline
        ):
            time.sleep(0.1)
        assert len(coordinator.store.audit_events("update-accepted")) == accepted
    finally:
        for process in sites:
            process.kill()
        coordinator.stop()


NODE_CONFIG_APP = """
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(message: Message, context: Context) -> Message:
    seen = {"partition-id": context.node_config["partition-id"], "scale": context.node_config["scale"]}
    seen["num-examples"] = 1
    content = RecordDict({"arrays": message.content["arrays"], "metrics": MetricRecord(seen)})
    return Message(content, reply_to=message)
"""


@pytest.mark.slow
def test_a_site_runs_an_app_from_its_working_directory_with_flowers_node_config(tmp_path):
    """`hydrafl site --app my_app:app --node-config "partition-id=1 scale=0.5"`, as `flower-supernode` takes
    them: the module is found in the working directory (no PYTHONPATH), every message's context carries the
    node config with Flower's types, and a site with its own app says nothing of a demo cohort."""
    coordinator = local_coordinator(tmp_path)
    app_dir = tmp_path / "project"
    app_dir.mkdir()
    (app_dir / "my_node_app.py").write_text(NODE_CONFIG_APP)
    tokens = [coordinator.store.add_site(name)[1] for name in ("a", "b")]
    run = coordinator.store.create_run({"strategy": "fedavg"})
    coordinator.store.set_run_status(run.id, "running")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    logs = [tmp_path / f"site-{i}.log" for i in range(2)]
    sites = [
        subprocess.Popen(
            [
                HYDRAFL_SCRIPT,
                "site",
                "--coordinator",
                f"127.0.0.1:{coordinator.port}",
            ]
            + ["--token", token, "--app", "my_node_app:app"]
            + ["--node-config", f"partition-id={i} scale={0.5 * (i + 1)}"],
            cwd=app_dir,
            env=env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
        )
        for i, (token, log) in enumerate(zip(tokens, logs, strict=True))
    ]
    try:
        deadline = time.monotonic() + 120
        while len(coordinator.service.connected_nodes()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        grid = CoordinatorGrid(coordinator.store, coordinator.blobs, coordinator.service, run.id)
        messages = [
            Message(
                RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(2, dtype=np.float32))})}),
                dst_node_id=node,
                message_type="train",
                group_id="1",
            )
            for node in sorted(grid.get_node_ids())
        ]
        replies = list(grid.send_and_receive(messages, timeout=120))
        assert not any(reply.has_error() for reply in replies), [r.error for r in replies]
        seen = sorted(
            (reply.content["metrics"]["partition-id"], reply.content["metrics"]["scale"])
            for reply in replies
        )
        assert seen == [(0, 0.5), (1, 1.0)]
        assert all(isinstance(p, int) and isinstance(s, float) for p, s in seen)
    finally:
        for process in sites:
            process.kill()
        coordinator.stop()
    assert not any("demo cohort" in log.read_text() for log in logs)
