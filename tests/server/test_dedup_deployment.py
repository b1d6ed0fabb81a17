"""Deduplication over the real coordinator and `hydrafl site` processes: before round 1 the coordinator runs the
exchange, the demo sites drop the planted copies and the run trains on what is left, as the simulation does;
a site started without the consortium's key fails the run with its reason."""

from __future__ import annotations

import pytest
from deployment import run_to_end
from helpers import SMALL_RUN

from hydrafl.config import RunConfig
from hydrafl.server.dedup import SiteDedup
from hydrafl.simulation.compare import run_strategy
from hydrafl.simulation.grid import FIRST_NODE_ID, simulated_dedup_key

RUN = SMALL_RUN.replace(rounds=1, samples_per_site=80, duplicates=0.25, dedup=True)


def _key_options(tmp_path, sites: int) -> list[tuple[str, ...]]:
    """The simulation's key, so both runs compute the same signatures and drop the same records."""
    key_file = tmp_path / "consortium.key"
    key_file.write_text(simulated_dedup_key(RUN.seed) + "\n")
    return [("--dedup-key-file", str(key_file))] * sites


@pytest.mark.slow
def test_sites_with_the_key_drop_their_copies_before_round_1_as_in_the_simulation(tmp_path):
    outcome: dict[int, SiteDedup] = {}
    simulated = run_strategy(
        RunConfig.from_flower({**RUN.to_flower(), "run-dir": str(tmp_path / "sim")}),
        "inprocess",
        on_dedup=outcome.update,
    )
    referral = outcome[FIRST_NODE_ID]
    assert referral.records == 96 and referral.dropped >= 0.95 * 32  # 32 copies planted there
    store, run_id = run_to_end(tmp_path, RUN, _key_options(tmp_path, RUN.sites))
    run = store.run(run_id)
    assert run.status == "finished", run.detail
    logs = "".join((tmp_path / f"site-{i}.log").read_text() for i in range(RUN.sites))
    assert logs.count("dedup: dropping 0 of 64 training records") == 2
    assert f"dedup: dropping {referral.dropped} of 96 training records" in logs
    kinds = [event.kind for event in store.audit_events()]
    # the two dedup queries per site besides train + evaluate, the round-0 evaluation and the init query
    assert (
        kinds.count("update-accepted") == 2 * RUN.sites + RUN.rounds * RUN.sites * 2 + RUN.sites + 1
    )
    assert run.history[-1]["loss"] == pytest.approx(simulated[-1]["loss"], rel=1e-5)


@pytest.mark.slow
def test_a_site_without_the_key_fails_the_run_with_its_reason(tmp_path):
    options = _key_options(tmp_path, RUN.sites - 1) + [()]
    store, run_id = run_to_end(tmp_path, RUN, options)
    run = store.run(run_id)
    assert run.status == "failed"
    assert "the dedup step needs every site" in run.detail
    assert "holds no consortium dedup key" in run.detail and "--dedup-key-file" in run.detail
