"""Secure aggregation over the real transport: a coordinator process and three site processes on loopback.
The protocol's queries and the masked uint32 uploads pass the coordinator's edge checks, and the model is the
plain in-process run's within the quantisation bound (FedAvg: whole updates; Hydra: each site's slices,
expanded to full shapes with a weight per coordinate)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from deployment import run_to_end
from helpers import SMALL_RUN

from hydrafl.client import site_app
from hydrafl.config import RunConfig
from hydrafl.secagg import SecAggParams, quantisation_bound
from hydrafl.server import server_app
from hydrafl.server.aggregation.checkpoint import load_checkpoint
from hydrafl.simulation.grid import InProcessGrid

RUN = SMALL_RUN.replace(rounds=1, secagg=True)
HYDRA = {"strategy": "hydra", "hydra-bypass": True, "hydra-head-mode": "drop", "score-samples": 16}
TIERS = ("small", "medium", "large")


def _deploy(tmp_path: Path, cfg: RunConfig, site_options: list[tuple[str, ...]]):
    store, run_id = run_to_end(tmp_path, cfg, site_options)
    run = store.run(run_id)
    assert run.status == "finished", run.detail
    kinds = [event.kind for event in store.audit_events()]
    assert kinds.count("update-rejected") == 0
    return run, load_checkpoint(tmp_path / "home" / "runs" / str(run_id)).arrays


def _plain(cfg: RunConfig):
    plain = cfg.replace(secagg=False, run_dir="")
    return server_app.run_federation(
        InProcessGrid(site_app.client_app, plain.sites, plain.to_flower()), plain
    ).arrays


def _difference(a, b) -> float:
    return max(float(np.abs(a[name].numpy() - b[name].numpy()).max()) for name in b)


@pytest.mark.slow
def test_three_site_processes_sum_securely_to_the_plain_model(tmp_path):
    run, deployed = _deploy(tmp_path, RUN, [()] * 3)
    [_, record] = run.history
    assert record["sites_ok"] == 3 and record["secagg_bytes"] > 0
    assert 0 < _difference(deployed, _plain(RUN)) <= quantisation_bound(3, SecAggParams()) / 30


@pytest.mark.slow
def test_hydra_sites_sum_their_slices_securely_over_the_wire(tmp_path):
    cfg = RunConfig.from_flower({**RUN.to_flower(), **HYDRA})
    run, deployed = _deploy(tmp_path, cfg, [("--tier", tier) for tier in TIERS])
    assert run.history[1]["sites_ok"] == 3
    plain_cfg = cfg.replace(
        site_tiers=",".join(TIERS), layer_score="magnitude", head_score="magnitude"
    )
    plain = _plain(plain_cfg)  # planned as the secure run plans: from the weights
    assert (
        _difference(deployed, plain) <= 0.7 * quantisation_bound(3, SecAggParams()) / 10
    )  # Hydra's outer_lr 0.7


@pytest.mark.slow
@pytest.mark.parametrize("hydra", [False, True])
def test_a_coordinator_keeping_the_model_on_disk_sums_the_stored_uploads_securely(tmp_path, hydra):
    """`--resident-model-mb 0`: every masked upload stays in the blob store and is added to the masked sum's file
    a chunk at a time, and the mean (Hydra: the per-coordinate sums and weights) is decoded into files; the
    sites (`--exchange-memory-mb 0`) mask into a file of their exchange folder and upload from it. The model is
    the plain run's within the bound."""
    cfg = RunConfig.from_flower({**RUN.to_flower(), **HYDRA}) if hydra else RUN
    site_options = [("--tier", tier) if hydra else () for tier in TIERS]
    store, run_id = run_to_end(
        tmp_path,
        cfg,
        [(*options, "--exchange-memory-mb", "0") for options in site_options],
        server_options=("--resident-model-mb", "0"),
    )
    run = store.run(run_id)
    assert run.status == "finished", run.detail
    assert run.history[1]["sites_ok"] == 3
    folder = tmp_path / "home" / "runs" / str(run_id)
    deployed = load_checkpoint(folder).arrays
    if hydra:  # planned as the secure run plans: from the weights; Hydra's outer_lr 0.7
        plain = _plain(
            cfg.replace(site_tiers=",".join(TIERS), layer_score="magnitude", head_score="magnitude")
        )
        assert _difference(deployed, plain) <= 0.7 * quantisation_bound(3, SecAggParams()) / 10
    else:
        assert 0 < _difference(deployed, _plain(RUN)) <= quantisation_bound(3, SecAggParams()) / 30
    kinds = sorted(path.name.split("-")[2] for path in folder.glob("round-*-*-*.safetensors"))
    assert set(kinds) <= {"model", "momentum"} and "model" in kinds  # the sums' files are gone
