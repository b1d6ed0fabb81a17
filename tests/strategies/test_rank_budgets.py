"""A LoRA baseline's rank sized to the memory and the time a site has: the rank fit by hand, the measured
rank cost against the footprint it predicts, and a run where the same declared memory gives a LoRA site the
rank that fits it and a Hydra site the layers that fit it."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord
from helpers import SMALL_RUN

from hydrafl.client import site_app
from hydrafl.data import TaskSpec
from hydrafl.footprint import training_footprint
from hydrafl.models import LoraSpec, build_model
from hydrafl.server import server_app
from hydrafl.simulation.grid import FIRST_NODE_ID, InProcessGrid
from hydrafl.strategies import build_strategy
from hydrafl.subnet.measure import measure_rank_cost
from hydrafl.subnet.planning import RankCost, fit_rank

COST = RankCost(fixed_s=1.0, per_rank_s=0.5, fixed_bytes=100.0, per_rank_bytes=10.0)


def _fit(memory: float = math.inf, deadline: float = math.inf) -> int:
    return fit_rank(COST, max_rank=8, memory_bytes=memory, deadline_s=deadline, local_steps=2)


def test_the_largest_rank_that_fits_memory_and_deadline_by_hand():
    assert _fit() == 8  # nothing limits it: the run's rank
    assert _fit(memory=135.0) == 3  # 100 + 10 r <= 135: r <= 3.5
    assert _fit(memory=130.0) == 3  # exactly at the limit fits
    assert _fit(deadline=6.0) == 4  # 2 (1 + 0.5 r) <= 6: r <= 4
    assert _fit(memory=135.0, deadline=4.9) == 2  # the deadline binds: r <= 2.9
    with pytest.raises(ValueError, match="no LoRA rank fits: rank 1 needs 3 s .* and 110 bytes"):
        _fit(memory=109.0)


def test_the_measured_rank_cost_predicts_the_footprint_of_every_rank():
    """Factors, their gradients and AdamW moments, and the rank-r activations all grow linearly with r: the
    cost from ranks 1 and 4 gives rank 2 and 3 to the byte."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(1, 40, (6, 8), generator=g), torch.randint(0, 3, (6,), generator=g)
    task = TaskSpec(
        name="text",
        modality="text",
        num_classes=3,
        class_names=("a", "b", "c"),
        vocab_size=40,
        seq_len=8,
    )

    def build(rank: int):
        return build_model(task, seed=0, lora=LoraSpec(rank=rank, alpha=2 * rank))

    def loss(model):
        return F.cross_entropy(model(x), y)

    cost = measure_rank_cost(build, loss, "adamw", max_rank=4, repeats=1)
    assert cost.per_rank_bytes > 0
    for rank in (2, 3):
        model = build(rank)
        peak = training_footprint(model, partial(loss, model), "adamw").peak_bytes
        assert cost.fixed_bytes + rank * cost.per_rank_bytes == pytest.approx(peak, abs=0.5)


def test_a_declared_memory_gives_a_lora_site_the_largest_rank_that_fits_and_hydra_the_layers():
    """The first site declares exactly what rank 2 of 4 needs, as it measured it: FedIT gives it rank 2 and
    the others, without a limit, rank 4, and its training footprint is what it measured. Below what rank 1
    needs no rank fits and it sits the round out, while a Hydra-net of fewer layers fits the same memory."""
    run = SMALL_RUN.replace(
        task="clinical-text",
        lora_rank=4,
        rounds=1,
        local_steps=1,
        site_tiers="",
        min_sites=1,
        strategy="fedit",
    )
    probe = run.replace(
        site_memory_mb="1e6"
    )  # a limit that fits anything: the sites report their cost
    grid = InProcessGrid(site_app.client_app, probe.sites, probe.to_flower())
    arrays = server_app.request_initial_arrays(grid, probe)
    queries = build_strategy(probe).configure_query(
        1, arrays, ConfigRecord(probe.to_flower()), grid
    )
    [reply] = grid.send_and_receive([q for q in queries if q.metadata.dst_node_id == FIRST_NODE_ID])
    metrics = reply.content["metrics"]
    need = {
        r: metrics["rank-cost.fixed-bytes"] + r * metrics["rank-cost.per-rank-bytes"]
        for r in (1, 2)
    }

    def federate(limit: float, strategy_name: str):
        limited = run.replace(site_memory_mb=f"{limit / 1e6:.6f},0,0", strategy=strategy_name)
        strategy = build_strategy(limited)
        grid = InProcessGrid(site_app.client_app, limited.sites, limited.to_flower())
        result = server_app.run_federation(grid, limited, strategy=strategy)
        return strategy, result.history[1]

    fedit, history = federate(need[2], "fedit")
    assert fedit.ranks == {FIRST_NODE_ID: 2, FIRST_NODE_ID + 1: 4, FIRST_NODE_ID + 2: 4}
    assert history["peak_memory_per_site"][str(FIRST_NODE_ID)] == pytest.approx(need[2], rel=1e-6)

    tight = need[1] * 0.9
    fedit, history = federate(tight, "fedit")
    assert set(fedit.ranks) == {FIRST_NODE_ID + 1, FIRST_NODE_ID + 2}  # the first site sat it out
    hydra, history = federate(tight, "hydra")
    trained = history["trainable_params_per_site"]
    assert 0 < trained[str(FIRST_NODE_ID)] < trained[str(FIRST_NODE_ID + 1)]
    assert history["peak_memory_per_site"][str(FIRST_NODE_ID)] <= tight


def test_a_sites_rank_cost_survives_a_checkpoint():
    """The planner's state, with a LoRA site's RankCost in its scores, encodes for a checkpoint and decodes
    to the same scores."""
    from hydrafl.server.aggregation.state_codec import Encoder, decode
    from hydrafl.strategies.planner import SiteScores

    scores = SiteScores(layers=[1.0], heads=[[1.0]], weight=3.0, tier="", rank_cost=COST)
    encoder = Encoder()
    encoded = encoder.encode({"site_scores": {1: scores}}, "strategy_state")
    assert decode(encoded, encoder.tensors)["site_scores"][1] == scores
