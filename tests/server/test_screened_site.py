"""A real coordinator, two honest site processes and one that scales every update it sends by 1000
(tests/scaling_site.py): with norm screening on, its replies are rejected every round with an audit event naming
it, the run id and the reason, and the run finishes on the honest sites' updates."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from deployment import enrol, queue_run, start_hydrafl, wait_joined, wait_serving, wait_until
from helpers import SMALL_RUN

RUN = SMALL_RUN.replace(
    strategy="fedavg", rounds=2, min_sites=2, round_timeout_s=60, screen_norm=3.0
)
SCALING = 2
"""The scaling site is the third enrolled, never the one asked for the initial model."""


@pytest.mark.slow
def test_screening_rejects_a_huge_update_with_an_audit_event_and_the_run_finishes(tmp_path):
    env, db, store, tokens, address = enrol(tmp_path, RUN)
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
            log=tmp_path / "coordinator.log",
        )
    ]
    try:
        wait_serving(address)
        for i, token in enumerate(tokens[:SCALING]):
            token_file = tmp_path / f"site-{i}.token"
            token_file.write_text(token)
            processes.append(
                start_hydrafl(
                    "site",
                    "--coordinator",
                    address,
                    "--token-file",
                    str(token_file),
                    env=env,
                    log=tmp_path / f"site-{i}.log",
                )
            )
        with (tmp_path / "scaling.log").open("w") as log:
            processes.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(Path(__file__).parents[1] / "scaling_site.py"),
                        address,
                        tokens[SCALING],
                    ],
                    env=env,
                    stdout=log,
                    stderr=log,
                )
            )
        logs = [tmp_path / f"site-{i}.log" for i in range(SCALING)] + [tmp_path / "scaling.log"]
        wait_joined(logs)
        run_id = queue_run(store, RUN)
        wait_until(
            lambda: store.run(run_id).status in ("finished", "failed"),
            200,
            "the run did not finish",
        )
        finished = store.run(run_id)
        assert finished.status == "finished", finished.detail
    finally:
        for process in processes:
            process.kill()
            process.wait()

    site = store.sites()[SCALING]
    events = store.audit_events("update-screened")
    assert [(e.site_name, e.run_id) for e in events] == [(site.name, run_id)] * RUN.rounds
    assert [e.detail.split(":")[0] for e in events] == [
        f"round {r}" for r in range(1, RUN.rounds + 1)
    ]
    assert all(
        "update norm" in e.detail and "above 3 x the round's median" in e.detail for e in events
    )
    for record in finished.history[1:]:
        assert list(record["rejected_per_site"]) == [str(site.node_id)]
        assert (record["sites_ok"], record["sites_failed"]) == (2, 1)
        assert math.isfinite(record["loss"])
