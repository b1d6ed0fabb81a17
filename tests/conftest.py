"""Shared fixtures: a small, fast federation config."""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

import pytest
import torch

from hydrafl.config import RunConfig

torch.set_num_threads(1)


@pytest.fixture
def small_run(tmp_path) -> RunConfig:
    """Three sites, tiny cohort, a few rounds: a real federation that runs in a few seconds."""
    return RunConfig(
        task="tabular",
        sites=3,
        samples_per_site=60,
        rounds=3,
        local_steps=3,
        batch_size=16,
        lr=3e-3,
        run_dir=str(tmp_path / "run"),
    )
