"""`--backend ray` runs the same app through Flower's simulation engine and gives the same numbers."""

from __future__ import annotations


import pytest

from hydrafl.simulation.compare import run_strategy

pytest.importorskip("ray")


@pytest.mark.slow
@pytest.mark.ray
def test_ray_backend_matches_inprocess(small_run, tmp_path):
    for strategy in ("fedavg", "diloco"):
        cfg = small_run.replace(strategy=strategy, rounds=2)
        inprocess = run_strategy(cfg.replace(run_dir=str(tmp_path / f"{strategy}-inprocess")), "inprocess")
        on_ray = run_strategy(cfg.replace(run_dir=str(tmp_path / f"{strategy}-ray")), "ray")
        assert len(on_ray) == len(inprocess) == 3
        for a, b in zip(inprocess, on_ray):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
            assert b["accuracy"] == pytest.approx(a["accuracy"], abs=1e-9)
            assert (b["bytes_up"], b["bytes_down"]) == (a["bytes_up"], a["bytes_down"])
