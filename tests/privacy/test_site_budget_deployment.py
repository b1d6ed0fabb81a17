"""A real coordinator and real site processes on loopback: a site whose policy sets max-epsilon trains while
the run's spending stays within it, then refuses, says why in its log, and the coordinator audits the refusal."""

from __future__ import annotations

import pytest
from deployment import run_to_end
from helpers import SMALL_RUN

from hydrafl.privacy.accountant import RoundSample, epsilon

RUN = SMALL_RUN.replace(strategy="diloco", min_sites=2, dp_noise_multiplier=2.0, dp_clip=0.5)


@pytest.mark.slow
def test_a_site_at_its_privacy_budget_declines_and_the_coordinator_audits_it(tmp_path):
    spent = [
        epsilon(2.0, RoundSample(3, 3), delta=1e-5, repeat=r) for r in (1, 2, 3)
    ]  # 4.73, 7.08, 9.01
    policy = tmp_path / "policy.toml"
    policy.write_text(f"max-epsilon = {(spent[0] + spent[1]) / 2}\n")
    site_options = [("--policy", str(policy)), (), ()]
    store, run_id = run_to_end(tmp_path, RUN, site_options, timeout_s=240)
    run = store.run(run_id)
    assert run.status == "finished", run.detail
    rounds = run.history[1:]
    assert [r["dp_epsilon"] for r in rounds] == [pytest.approx(e, rel=1e-12) for e in spent]
    assert [(r["sites_ok"], r["sites_failed"]) for r in rounds] == [(3, 0), (2, 1), (2, 1)]
    declines = [e for e in store.audit_events("site-declined") if e.site_name == "hospital-0"]
    assert [e.detail.split(":")[0] for e in declines] == ["round 2 train", "round 3 train"]
    assert (
        f"this round would bring the site's epsilon to {spent[1]:.4g}, over its max-epsilon"
        in declines[0].detail
    )
    assert "privacy budget" in (tmp_path / "site-0.log").read_text()
