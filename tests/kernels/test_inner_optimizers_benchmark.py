"""The inner-optimizer benchmark measures what the round records say, for both optimizers at every M."""

from __future__ import annotations

import math

import pytest
from rich.console import Console

from hydrafl.benchmarks.inner_optimizers import Sweep, plot, run, table


@pytest.mark.slow
def test_a_tiny_sweep_reports_b_pg_and_cosine_per_setting(tmp_path) -> None:
    sweep = Sweep(sites=(2, 3), rounds=1, local_steps=2, samples_per_site=40, batch_size=8)
    summary = run(sweep, strategy="fedavg", partition="iid", seed=0, show_progress=False)
    assert [(e["optimizer"], e["sites"]) for e in summary["settings"]] == [
        ("adamw", 2),
        ("adamw", 3),
        ("muon", 2),
        ("muon", 3),
    ]
    for entry in summary["settings"]:
        assert len(entry["noise_scale"]) == len(entry["full_data_cosine"]) == 1
        assert 0 < entry["mean_noise_scale"] < math.inf and -1 <= entry["mean_cosine"] <= 1
    adamw, muon = summary["settings"][0], summary["settings"][2]
    assert adamw["noise_scale"] != muon["noise_scale"]  # the optimizer really changed
    plot(tmp_path / "p.png", summary)
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    console = Console(record=True, width=200)
    console.print(table(summary))
    assert f"{adamw['mean_cosine']:.4f}" in console.export_text()
