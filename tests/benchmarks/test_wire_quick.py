"""The wire and many-sites benchmarks' --quick modes run end to end and their correctness checks pass (no speed
or memory goal is asserted: those are measurements, reported as they come out)."""

from __future__ import annotations

import pytest
from helpers import run_quick


@pytest.mark.slow
def test_wire_quick(tmp_path):
    result = run_quick("wire", tmp_path, timeout_s=180)
    assert result["quick"] is True
    throughput = result["throughput"]
    assert set(throughput["median_s"]) == set(throughput["gib_per_s"]) == {"hydrafl", "raw"}
    assert throughput["ratio_hydrafl_over_raw"] > 0 and "goal_met" in throughput
    assert set(throughput["hydrafl_phases_median_s"]) == {"ask_s", "put_s", "push_s"}
    assert (
        len(throughput["runs"]["hydrafl"]) == len(throughput["runs"]["raw"]) == throughput["reps"]
    )
    checks = throughput["checks"]
    assert checks["accepted"] and checks["all_chunks_stored"] and checks["raw_bytes_received"], (
        checks
    )
    assert checks["byte_exact"], (
        "the coordinator did not reassemble the pushed update byte for byte"
    )
    components = result["components"]
    expected = {
        "upload_digest_s",
        "content_digest_s",
        "blob_put_s",
        "blob_put_no_sync_s",
        "sync_s",
        "push_reply_work_s",
        "sqlite_per_push_s",
    }
    assert expected <= set(components["median_s"])
    assert components["push_reply_peak_updates"] > 0
    download = result["download"]
    assert (
        set(download["gib_per_s"]) == {"hydrafl", "raw"} and download["ratio_hydrafl_over_raw"] > 0
    )
    assert download["checks"]["passed"], download["checks"]
    beside = result["raw_beside_floor"]["runs"]
    assert len(beside["both"]) == len(beside["raw"]) == len(beside["floor"]) == throughput["reps"]
    assert all(
        both >= max(raw, floor)
        for both, raw, floor in zip(beside["both"], beside["raw"], beside["floor"], strict=True)
    )
    tmpfs = result["throughput_tmpfs"]
    if tmpfs is not None:  # reported beside the disk-backed goal, never judged against it
        assert tmpfs["checks"]["passed"] and "goal_met" not in tmpfs, tmpfs["checks"]
    memory = result["memory"]
    assert memory["idle_mb"] > 0 and memory["peak_mb"] >= memory["idle_mb"]
    assert {"peak_extra_mb", "peak_extra_updates", "vmhwm_mb", "goal_met", "max_concurrent"} <= set(
        memory
    )
    assert memory["checks"]["passed"], memory["checks"]
    assert (
        memory["accepted_in_store"] == memory["sites"] == len(memory["pushes"])
        and not memory["failures"]
    )


@pytest.mark.slow
def test_many_sites_quick(tmp_path):
    result = run_quick("many_sites", tmp_path, timeout_s=180)
    assert result["quick"] is True
    assert result["checks"]["passed"], (result["checks"], result["run"], result["errors"])
    assert (
        result["run"]["status"] == "finished"
        and result["run"]["rounds_done"] == result["workload"]["rounds"]
    )
    rounds = result["rounds"]
    assert [entry["round"] for entry in rounds] == list(range(1, result["workload"]["rounds"] + 1))
    assert all(
        entry["sites_failed"] == 0 and entry["sites_ok"] == result["workload"]["sites"]
        for entry in rounds
    )
    assert not result["errors"]["agent_errors"]
    coordinator = result["coordinator"]
    assert (
        coordinator["idle_mb"] > 0
        and coordinator["peak_mb"] >= coordinator["idle_mb"]
        and coordinator["rss_trace"]
    )
