"""Storage stays bounded on a real coordinator with three real sites: after round 30 the blob store and the
per-round tables hold what they held after round 3, give or take a round in flight; the coordinator's home
(database, blobs, run folders) after round 20 is at most 1.5x its size after round 3; and a kill -9 in the middle
of a sweep leaves nothing referenced missing: the restarted coordinator finishes the run."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from stat import S_ISREG

import pytest
from deployment import enrol, queue_run, start_hydrafl, wait_serving, wait_until
from helpers import SMALL_RUN
from sqlalchemy import func, select

from hydrafl.config import RunConfig
from hydrafl.server.blobs import BlobStore
from hydrafl.server.retention import SWEEP_PAUSE_ENV, Retention
from hydrafl.server.store import Store
from hydrafl.server.tables import AuditEvent, OutboundMessage, Reply

LONG_RUN = SMALL_RUN.replace(rounds=30, local_steps=1)
ROUND_ROWS = LONG_RUN.sites * 2 * 2
"""Rows one round adds: a train and an evaluate message per site, each with its reply."""


def _files_bytes(*folders: Path) -> int:
    """Bytes of the files under `folders` (and files), each hard-linked file once.

    The coordinator keeps sweeping while this walks, so a file listed and then deleted counts as gone."""
    seen: dict[tuple[int, int], int] = {}
    for folder in folders:
        walked = [Path(top, name) for top, _, names in os.walk(folder) for name in names]
        paths = [folder] if folder.is_file() else walked
        for path in paths:
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            if S_ISREG(stat.st_mode):
                seen[(stat.st_dev, stat.st_ino)] = stat.st_size
    return sum(seen.values())


def _measure(store: Store, db_file: Path, blobs: Path, runs: Path) -> dict[str, int]:
    with store.session() as session:
        rows = {
            table.__tablename__: session.scalar(select(func.count()).select_from(table))
            for table in (OutboundMessage, Reply, AuditEvent)
        }
    home = _files_bytes(db_file, db_file.with_name(db_file.name + "-journal"), blobs, runs)
    return {
        "round_rows": rows["messages"] + rows["replies"],
        "audit_rows": rows["audit_events"],
        "blob_bytes": _files_bytes(blobs),
        "home_bytes": home,
    }


class Deployment:
    """A coordinator process (its database, blobs and run folders under one home) and three site processes."""

    def __init__(self, tmp_path: Path, cfg: RunConfig) -> None:
        self.tmp_path = tmp_path
        self.env, self.db, self.store, self.tokens, self.address = enrol(tmp_path, cfg)
        self.run_id = queue_run(self.store, cfg)
        self.home = tmp_path / "home"
        self.blobs, self.runs = self.home / "blobs", self.home / "runs"
        self.processes: list[subprocess.Popen] = []

    def start_coordinator(self, **env: str) -> subprocess.Popen:
        process = start_hydrafl(
            "server",
            "--listen",
            self.address,
            "--db",
            self.db,
            "--blobs",
            str(self.blobs),
            env={**self.env, **env},
            log=self.tmp_path / "coordinator.log",
        )
        self.processes.append(process)
        wait_serving(self.address, process=process)
        return process

    def start_sites(self) -> None:
        for i, token in enumerate(self.tokens):
            self.processes.append(
                start_hydrafl(
                    "site",
                    "--coordinator",
                    self.address,
                    "--token",
                    token,
                    env=self.env,
                    log=self.tmp_path / f"site-{i}.log",
                )
            )

    def after_round(self, server_round: int, timeout_s: float = 120) -> dict[str, int]:
        deadline = time.monotonic() + timeout_s
        while self.store.run(self.run_id).rounds_done < server_round:
            assert time.monotonic() < deadline, f"round {server_round} never completed"
            time.sleep(0.02)
        return self.measure()

    def measure(self) -> dict[str, int]:
        return _measure(self.store, self.tmp_path / "coordinator.db", self.blobs, self.runs)

    def peak_of_round(self, server_round: int, timeout_s: float = 120) -> dict[str, int]:
        """The most each measure reached from the end of `server_round` until the next round (or the run) ended.
        One look can fall between a sweep and the next round's writes, and so miss a model; the peak cannot."""
        peak = self.after_round(server_round, timeout_s)
        while (
            run := self.store.run(self.run_id)
        ).rounds_done <= server_round and run.status == "running":
            time.sleep(0.02)
            now = self.measure()
            peak = {key: max(value, now[key]) for key, value in peak.items()}
        return peak

    def stop(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()


@pytest.fixture
def deployment(tmp_path, request):
    made = Deployment(tmp_path, request.param)
    yield made
    made.stop()


@pytest.mark.slow
@pytest.mark.parametrize("deployment", [LONG_RUN], indirect=True)
def test_thirty_rounds_keep_blobs_rows_and_the_home_bounded(deployment, capsys):
    deployment.start_coordinator()
    deployment.start_sites()
    at = {server_round: deployment.peak_of_round(server_round) for server_round in (3, 20, 30)}
    wait_until(
        lambda: deployment.store.run(deployment.run_id).status != "running",
        60,
        "the run did not end",
    )
    run = deployment.store.run(deployment.run_id)
    assert run.status == "finished", run.detail
    with capsys.disabled():
        print(f"\nstorage at its peak in rounds 3, 20, 30: {at}")
    assert at[30]["round_rows"] <= at[3]["round_rows"] + ROUND_ROWS  # a round in flight at most
    one_round = run.history[3]["bytes_up"] + max(
        run.history[3]["bytes_down_per_site"].values()
    )  # deltas + a model
    assert at[30]["blob_bytes"] <= at[3]["blob_bytes"] + one_round
    assert at[20]["home_bytes"] <= 1.5 * at[3]["home_bytes"]
    # what an ended run keeps: its history, audit events and last checkpoints; its messages and chunks go, in the
    # sweep the coordinator runs once it has marked the run finished
    log = deployment.tmp_path / "coordinator.log"
    wait_until(
        lambda: f"run {deployment.run_id} ended; deleted" in log.read_text(),
        60,
        "no end-of-run sweep",
    )
    final = deployment.measure()
    assert final["round_rows"] == 0 and final["blob_bytes"] == 0
    assert [entry["round"] for entry in run.history] == list(range(31))
    folder = deployment.runs / str(deployment.run_id)
    kept = sorted(path.name for path in (folder / "checkpoints").iterdir())
    assert [name[:11] for name in kept] == ["round-00029"] * 2 + ["round-00030"] * 2


@pytest.mark.slow
@pytest.mark.parametrize("deployment", [SMALL_RUN.replace(rounds=5, local_steps=1)], indirect=True)
def test_kill_9_mid_sweep_then_restart_finishes_the_run(deployment):
    log = deployment.tmp_path / "coordinator.log"
    coordinator = deployment.start_coordinator(**{SWEEP_PAUSE_ENV: "120"})
    deployment.start_sites()
    wait_until(
        lambda: log.exists() and "sweep paused" in log.read_text(), 120, "no sweep deleted a chunk"
    )
    coordinator.send_signal(signal.SIGKILL)
    coordinator.wait()
    rounds_done = deployment.store.run(deployment.run_id).rounds_done
    retention = Retention(
        deployment.store, BlobStore(deployment.blobs), deployment.runs, dry_run=True
    )
    assert retention.collect().chunks > 0  # the rows went first: the chunks left behind are orphans
    deployment.start_coordinator()
    wait_until(
        lambda: deployment.store.run_status(deployment.run_id) != "running",
        120,
        "the run did not end",
    )
    run = deployment.store.run(deployment.run_id)
    assert run.status == "finished", run.detail
    assert [entry["round"] for entry in run.history] == list(range(6)) and rounds_done < 5
    wait_until(
        lambda: f"run {deployment.run_id} ended; deleted" in log.read_text(),
        60,
        "no end-of-run sweep",
    )
    assert _files_bytes(deployment.blobs) == 0
