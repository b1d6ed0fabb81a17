"""A coordinator administered over the network by `hydrafl admin ... --coordinator --admin-token-file` from
processes that have no database: create a run, list it, follow its logs, read its status, stop it at a round
boundary with its checkpoint intact, export its model, resume it from that checkpoint and stop it at once."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from deployment import enrol, start_hydrafl, wait_serving, wait_until
from helpers import SMALL_RUN
from safetensors.numpy import load_file

from hydrafl.server.aggregation.checkpoint import load_checkpoint

RUN = SMALL_RUN.replace(sites=2, rounds=500)
"""Far more rounds than the test waits for: it stops the run long before its end."""
RUN_FLAGS = ["--task", "tabular", "--sites", "2", "--samples-per-site", "60", "--rounds", "500"]
RUN_FLAGS += ["--local-steps", "3", "--batch-size", "16", "--lr", "3e-3"]


@pytest.mark.slow
def test_an_administrator_runs_a_coordinator_from_another_process(tmp_path):
    env, db, store, tokens, address = enrol(tmp_path, RUN)
    token_file = tmp_path / "alice.token"
    token_file.write_text(store.add_admin("alice") + "\n")
    admin_home = tmp_path / "admin-home"  # the administrator's machine: no database there
    admin_env = {**env, "HYDRAFL_HOME": str(admin_home)}
    remote = ["--coordinator", address, "--admin-token-file", str(token_file)]

    def admin(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "hydrafl", "admin", *args, *remote]
        done = subprocess.run(command, env=admin_env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done

    def status(run_id: int) -> dict:
        return json.loads(admin("run", "status", str(run_id), "--json").stdout)

    server = ("server", "--listen", address, "--db", db, "--blobs", str(tmp_path / "blobs"))
    processes = [start_hydrafl(*server, env=env, log=tmp_path / "coordinator.log")]
    try:
        wait_serving(address, process=processes[0])
        run_id = int(admin("run", "create", *RUN_FLAGS).stdout.split()[-1])
        [row] = [
            line.split("│") for line in admin("run", "list").stdout.splitlines() if "│" in line
        ]
        cells = [cell.strip() for cell in row[1:6]]
        assert cells[:3] == [str(run_id), "fedavg", "tabular"] and cells[4] == "0/500"
        assert cells[3] in (
            "pending",
            "running",
        )  # running once the coordinator waits for its sites
        for i, token in enumerate(tokens):
            site = ("site", "--coordinator", address, "--token", token)
            processes.append(start_hydrafl(*site, env=env, log=tmp_path / f"site-{i}.log"))
        follower = subprocess.Popen(
            [sys.executable, "-m", "hydrafl", "admin", "run", "logs", str(run_id), "-f", *remote],
            env=admin_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        processes.append(follower)
        # the test's own reads of the database only pace it; the administrator's go over the network
        wait_until(lambda: store.run(run_id).rounds_done >= 2, 120, "no two rounds done")
        assert "stops at the end of its current round" in admin("run", "stop", str(run_id)).stderr
        wait_until(lambda: store.run(run_id).status == "stopped", 60, "the run never stopped")

        stopped = status(run_id)
        run_dir = tmp_path / "home" / "runs" / str(run_id)
        checkpoint = load_checkpoint(run_dir)
        assert 2 <= stopped["rounds_done"] < 500
        assert checkpoint.server_round == stopped["rounds_done"]  # a round boundary, checkpointed
        assert [r["round"] for r in stopped["history"]] == list(range(stopped["rounds_done"] + 1))
        assert checkpoint.history == stopped["history"]
        assert "stopped by an administrator after round" in stopped["detail"]

        followed, _ = follower.communicate(timeout=30)  # the follower ends with the run
        assert follower.returncode == 0
        for server_round in range(1, stopped["rounds_done"] + 1):
            assert f"round {server_round}: loss=" in followed
        assert f"run {run_id} stopped: stopped by an administrator" in followed
        assert admin("run", "logs", str(run_id)).stdout == followed

        out = tmp_path / "model"
        assert "safetensors model in" in admin("run", "export", str(run_id), str(out)).stdout
        exported = load_file(out / "model.safetensors")
        trained = {name: array.numpy() for name, array in checkpoint.arrays.items()}
        for name, array in exported.items():
            assert (array == trained[f"net.{name}"]).all()

        admin("run", "resume", str(run_id))
        wait_until(
            lambda: store.run(run_id).rounds_done > stopped["rounds_done"],
            120,
            "the resumed run did not go on",
        )
        admin("run", "stop", str(run_id), "--now")
        wait_until(lambda: store.run(run_id).status == "stopped", 60, "--now did not stop it")
        again = status(run_id)
        assert load_checkpoint(run_dir).server_round == again["rounds_done"]
        assert again["history"][: len(stopped["history"])] == stopped["history"]
        assert (
            f"resuming after round {stopped['rounds_done']}"
            in admin("run", "logs", str(run_id)).stdout
        )
    finally:
        for process in processes:
            process.kill()
            process.wait()
    assert not admin_home.exists()  # no database was made or opened on the administrator's side
    actions = [event.detail for event in store.audit_events("admin")]
    assert f"admin alice from ipv4:127.0.0.1: run create {RUN.strategy}" in actions
    assert "admin alice from ipv4:127.0.0.1: run stop --now" in actions
    assert sum("run export" in action for action in actions) == 1
