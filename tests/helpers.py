"""What tests share: builders for real Flower messages, a tiered run, a resume check, what a Hydra-net site
reads, and a runner for the benchmarks' --quick modes."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

from hydrafl import server_app, site_app
from hydrafl.config import RunConfig
from hydrafl.hydranet import Slice, SubnetSpec, read_slices, trainable_slices
from hydrafl.models import build_model
from hydrafl.simulation.grid import FIRST_NODE_ID, InProcessGrid

TIERED_RUN = RunConfig(
    task="tabular",
    sites=3,
    samples_per_site=60,
    rounds=2,
    local_steps=3,
    batch_size=16,
    lr=3e-3,
    site_tiers="small,medium,large",
    score_samples=16,
)
"""Three small tabular sites, one per resource tier: the shared setting of the subnetwork strategies' tests."""
TIER_OF_NODE = {FIRST_NODE_ID + i: tier for i, tier in enumerate(TIERED_RUN.tier_list)}


def make_reply(arrays: dict[str, np.ndarray], num_examples: float, node_id: int = 1) -> Message:
    """A site's training reply as the strategy sees it (one ArrayRecord, one MetricRecord)."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1
    request = Message(RecordDict(), dst_node_id=node_id, message_type="train")
    request.metadata.__dict__["_message_id"] = f"request-{node_id}"
    content = RecordDict(
        {
            "arrays": ArrayRecord({k: Array(np.asarray(v, dtype=np.float32)) for k, v in arrays.items()}),
            "metrics": MetricRecord({"num-examples": num_examples}),
        }
    )
    return Message(content, reply_to=request)


def run_quick(name: str, out: Path, timeout_s: float) -> dict[str, Any]:
    command = [sys.executable, "-m", f"hydrafl.benchmarks.{name}", "--quick", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert (out / f"{name}.png").stat().st_size > 0
    return json.loads((out / f"{name}.json").read_text())


def assert_resume_matches_a_straight_run(cfg: RunConfig, tmp_path: Path) -> None:
    """Stopped after rounds - 1 and resumed, a run ends with exactly the arrays of an uninterrupted one."""
    def run(cfg: RunConfig):
        return server_app.run_federation(InProcessGrid(site_app.client_app, cfg.sites, cfg.to_flower()), cfg)

    straight = run(dataclasses.replace(cfg, run_dir=str(tmp_path / "straight")))
    run(dataclasses.replace(cfg, run_dir=str(tmp_path / "resumed"), rounds=cfg.rounds - 1))
    resumed = run(dataclasses.replace(cfg, run_dir=str(tmp_path / "resumed"), resume=True))
    for name, array in straight.arrays.items():
        np.testing.assert_array_equal(array.numpy(), resumed.arrays[name].numpy())


def site_read_slices(cfg: RunConfig, spec: SubnetSpec) -> dict[str, Slice]:
    """What a site's forward pass reads under `spec` (`hydranet.read_slices`), from a live model as the site
    computes it: all a Hydra-net site is sent."""
    model = build_model(site_app.run_cohort(cfg).task, model=cfg.model, seed=cfg.seed, lora=site_app.lora_spec(cfg))
    layout = site_app.slice_layout(model)
    return read_slices(trainable_slices(model, spec), dict(zip(layout["layout.names"], layout["layout.layers"])), spec)
