"""A stock Flower ServerApp + ClientApp run unchanged over hydrafl's coordinator and site agents."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from hydrafl.server.config import CoordinatorConfig
from hydrafl.server.coordinator import Coordinator
from hydrafl.server.transport.grid import CoordinatorGrid

TESTS = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_stock_flower_apps_behind_hydrafl_site(tmp_path):
    coordinator = Coordinator(
        CoordinatorConfig(
            listen="127.0.0.1:0",
            db_url=f"sqlite:///{tmp_path / 'c.db'}",
            blob_dir=tmp_path / "blobs",
            runs_dir=tmp_path / "runs",
        )
    )
    coordinator.start()
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
