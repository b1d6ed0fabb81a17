"""The FedBuff benchmark's --quick mode end to end: both parts' curves on the virtual clock, the goal's ratio
computed from them, the cap binding only where it should, and the plot."""

from __future__ import annotations

import pytest
from helpers import run_quick


@pytest.mark.slow
def test_fedbuff_quick(tmp_path):
    result = run_quick("fedbuff", tmp_path, timeout_s=600)
    assert result["quick"] is True and result["seeds"] == 1 and result["buffer_size"] == 3
    [slow] = result["slow_site"]
    assert slow["fedavg_virtual_s"] == 2 * 10.0 and slow["fedavg"]["virtual_s"] == [0.0, 10.0, 20.0]
    assert slow["fedbuff"]["virtual_s"][-1] == pytest.approx(
        20.0
    )  # as long as FedAvg ran, one step a second
    if slow["fedbuff_reached_s"] is not None:
        index = slow["fedbuff"]["virtual_s"].index(slow["fedbuff_reached_s"])
        assert slow["fedbuff"]["loss"][index] <= slow["fedavg_final_loss"]
        assert all(loss > slow["fedavg_final_loss"] for loss in slow["fedbuff"]["loss"][:index])
        assert slow["time_ratio"] == pytest.approx(slow["fedbuff_reached_s"] / 20.0)
    assert result["goal"]["met"] == (slow["time_ratio"] is not None and slow["time_ratio"] <= 0.5)
    [stale] = result["stale_site"]
    assert stale["train_sizes"][stale["slow_site"]] == max(stale["train_sizes"])
    assert stale["capped"]["max_weight"] <= 1.0 < stale["uncapped"]["max_weight"]
    assert (
        stale["uncapped"]["max_staleness"] >= 15
    )  # the 20x slower site's update came back that many versions late
