"""A real coordinator, two honest site processes and one hostile site process that rewrites every reply it
sends (tests/hostile_site.py): the run finishes with exactly the honest sites' result, as simulated with the
third site failing every message; nothing the hostile site sent is stored or counted; everyone keeps serving."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from deployment import enrol, queue_run, start_hydrafl, wait_joined, wait_serving, wait_until
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from helpers import SMALL_RUN
from hostile_site import EVALUATE_ATTACKS, TRAIN_ATTACKS

from hydrafl.client import site_app
from hydrafl.server import server_app
from hydrafl.simulation.grid import InProcessGrid

RUN = SMALL_RUN.replace(
    strategy="fedavg", rounds=len(TRAIN_ATTACKS), min_sites=2, round_timeout_s=60
)
HOSTILE = 2
"""The hostile site is the third enrolled (demo share 2), never the one asked for the initial model."""


def _failing_third_site() -> ClientApp:
    """The simulation's reference: the site app, with the third site failing every train and evaluate message."""
    app = ClientApp()

    def fail_third(handler):
        def wrapped(message: Message, context: Context) -> Message:
            if context.node_config["partition-id"] == HOSTILE:
                raise RuntimeError("refused")
            return handler(message, context)

        return wrapped

    app.train()(fail_third(site_app.train))
    app.evaluate()(fail_third(site_app.evaluate_site))
    app.query("init")(site_app.initial_model)
    return app


@pytest.mark.slow
def test_a_hostile_site_changes_nothing_but_its_own_share(tmp_path):
    env, db, store, tokens, address = enrol(tmp_path, RUN)
    attacks = tmp_path / "attacks.jsonl"
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
        for i, token in enumerate(tokens[:HOSTILE]):
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
        with (tmp_path / "hostile.log").open("w") as log:
            hostile = subprocess.Popen(
                [
                    sys.executable,
                    str(Path(__file__).parents[1] / "hostile_site.py"),
                    address,
                    tokens[HOSTILE],
                    str(attacks),
                ],
                env=env,
                stdout=log,
                stderr=log,
            )
        processes.append(hostile)
        logs = [tmp_path / f"site-{i}.log" for i in range(HOSTILE)] + [tmp_path / "hostile.log"]
        wait_joined(logs)
        run_id = queue_run(
            store, RUN
        )  # with min-sites 2, a run queued earlier could start before the third joined
        wait_until(
            lambda: store.run(run_id).status in ("finished", "failed"),
            200,
            "the run did not finish",
        )
        finished = store.run(run_id)
        assert finished.status == "finished", finished.detail
        wait_serving(address, timeout_s=5)  # the health check answers
        assert (
            hostile.poll() is None
        )  # the hostile agent keeps serving too: its refusals never crashed it
    finally:
        for process in processes:
            process.kill()
            process.wait()

    outcomes = [json.loads(line) for line in attacks.read_text().splitlines()]
    tried = {outcome["attack"] for outcome in outcomes}
    assert tried == set(TRAIN_ATTACKS) | set(EVALUATE_ATTACKS)
    for outcome in outcomes:
        expected = (
            "PERMISSION_DENIED" if outcome["attack"] == "forge-another-site" else "INVALID_ARGUMENT"
        )
        assert outcome["code"] == expected, outcome
        assert outcome["seconds"] < 2.0, outcome
    print(
        "\n"
        + "\n".join(f"{o['attack']}: {o['code']} in {o['seconds'] * 1e3:.1f} ms" for o in outcomes)
    )

    hostile = store.sites()[HOSTILE]
    hostile_node = hostile.node_id
    # The ended run's replies are swept (retention); its audit trail stays: every reply of the hostile site was
    # refused and audited, none accepted.
    assert not [e for e in store.audit_events("update-accepted") if e.site_name == hostile.name]
    refused = [e for e in store.audit_events("update-rejected") if e.site_name == hostile.name]
    assert sum(event.count for event in refused) >= len(
        outcomes
    )  # a round's refusals share a row (`count`)
    assert not list(
        (tmp_path / "blobs" / "sites" / str(hostile_node)).glob("*/*")
    )  # nothing it uploaded is kept

    simulated = server_app.run_federation(
        InProcessGrid(_failing_third_site(), RUN.sites, RUN.to_flower()), RUN
    ).history
    for deployed, local in zip(finished.history, simulated, strict=True):
        assert deployed["round"] == local["round"]
        assert (
            deployed["sites_ok"]
            == local["sites_ok"]
            == (HOSTILE if deployed["round"] else deployed["sites_ok"])
        )
        assert deployed["loss"] == pytest.approx(local["loss"], rel=1e-5)
        assert deployed["accuracy"] == pytest.approx(local["accuracy"], abs=1e-9)
