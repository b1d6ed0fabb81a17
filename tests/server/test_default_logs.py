"""Without -v the coordinator and the sites still say what happens: sites joining, the run starting, each
round with its sites and loss, the run finishing; a site says when it takes part in a run and when that run
ended at the coordinator. The per-message details stay behind -v."""

from __future__ import annotations

import re

import pytest
from deployment import enrol, queue_run, start_hydrafl, wait_serving, wait_until
from helpers import SMALL_RUN

RUN = SMALL_RUN.replace(strategy="fedavg", sites=2, rounds=2)


@pytest.mark.slow
def test_coordinator_and_sites_log_joins_rounds_and_the_run_end_at_the_default_level(tmp_path):
    env, db, store, tokens, address = enrol(tmp_path, RUN)
    logs = [tmp_path / "coordinator.log", tmp_path / "site-0.log", tmp_path / "site-1.log"]
    processes = [
        start_hydrafl(
            "server",
            "--listen",
            address,
            "--db",
            db,
            "--blobs",
            str(tmp_path / "blobs"),
            env=env,
            log=logs[0],
            verbose=False,
        )
    ]
    try:
        wait_serving(address, process=processes[0])
        for token, log in zip(tokens, logs[1:], strict=True):
            processes.append(
                start_hydrafl(
                    "site",
                    "--coordinator",
                    address,
                    "--token",
                    token,
                    env=env,
                    log=log,
                    verbose=False,
                )
            )
        run_id = queue_run(store, RUN)
        wait_until(
            lambda: store.run(run_id).status in ("finished", "failed"),
            300,
            "the run did not finish",
        )
        ended = f"run {run_id} finished at the coordinator; waiting for the next run"
        wait_until(
            lambda: all(ended in " ".join(log.read_text().split()) for log in logs[1:]),
            60,
            "a site did not say the run ended",
        )
    finally:
        for process in processes:
            process.kill()
            process.wait()

    coordinator = " ".join(logs[0].read_text().split())
    assert (
        "site hospital-0 joined (node" in coordinator
        and "site hospital-1 joined (node" in coordinator
    )
    assert f"run {run_id} started: fedavg, 2 rounds, 2 sites required" in coordinator
    for server_round in (1, 2):
        assert re.search(
            rf"round {server_round}: loss=[0-9.]+ accuracy=[0-9.]+ sites=2/2", coordinator
        )
    final = store.run(run_id).history[-1]
    assert (
        f"run {run_id} finished after 2 rounds: loss {final['loss']:.4f}, accuracy {final['accuracy']:.4f}"
        in coordinator
    )
    for log in logs[1:]:
        site = " ".join(log.read_text().split())
        assert "joined as hospital-" in site and f"run {run_id}: taking part" in site
        assert re.search(r"round 2: \d+ samples on 1 process", site)
        assert "pushed reply" not in site  # a per-message detail: -v only
