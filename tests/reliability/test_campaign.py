"""The reliability campaign, reduced for CI (`hydrafl.benchmarks.reliability` runs it in full): real coordinator
and site processes on loopback, killed, attacked and starved of disk."""

from __future__ import annotations

import pytest
import torch
from rich.progress import Progress

from hydrafl.benchmarks._reliability_cluster import RUN
from hydrafl.benchmarks._reliability_hostile import KINDS
from hydrafl.benchmarks._reliability_site import site_disk_full, site_upload_resume
from hydrafl.benchmarks.reliability import hostile_campaign, kill_campaign


@pytest.mark.slow
def test_three_kill_9s_of_the_coordinator_end_with_the_identical_model(tmp_path):
    with Progress(disable=True) as progress:
        result = kill_campaign(tmp_path, RUN.replace(rounds=3), kills=3, seed=1, progress=progress)
    assert result["kills"] == 3
    for run in result["runs"]:
        assert run["finished"], run["detail"]
        assert run["same_model"] and run["all_sites_every_round"] and run["accepted_once"], run


@pytest.mark.slow
def test_500_hostile_requests_get_the_right_status_store_nothing_and_leave_the_run_alone(tmp_path):
    torch.set_num_threads(1)  # the attacker's own site trains in this process, in both runs alike
    with Progress(disable=True) as progress:
        result = hostile_campaign(tmp_path, requests=500, rounds=10, seed=3, progress=progress)
    assert result["requests"] == 500 and result["crashes"] == 0
    assert result["right_status"], {
        kind: entry["wrong"] for kind, entry in result["kinds"].items() if entry["wrong"]
    }
    assert result["nothing_stored"], result["stored_difference"]
    assert result["run_unaffected"]
    sent = {kind for kind, entry in result["kinds"].items() if entry["sent"]}
    assert sent >= {kind for kind, (_, share) in KINDS.items() if share >= 0.5}


@pytest.mark.slow
def test_a_site_killed_mid_upload_resumes_it_after_a_restart(tmp_path):
    result = site_upload_resume(tmp_path)
    assert result["killed_mid_upload"] and result["chunks_held_after_kill"] > 0
    assert 0 < result["chunks_skipped_on_restart"] < result["chunks_in_reply"]
    assert result["run_status"] == "finished" and result["ok"], result


@pytest.mark.slow
def test_a_site_whose_disk_fills_up_says_so_and_rejoins_once_there_is_space(tmp_path):
    result = site_disk_full(tmp_path, rounds=3)
    assert (
        "disk full (EFBIG)" in result["reply_reason"]
        and "disk full: File too large" in result["site_log_line"]
    )
    assert "/" not in result["reply_reason"]  # the path stays in the site's log
    assert result["rounds_back_with_all_sites"] and result["run_status"] == "finished", result
