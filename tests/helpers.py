"""What tests share: the small run every test's run config derives from and its tiered variant, builders for
real Flower messages (a training reply, a scoring reply), a grid of node ids and a round configured through a
strategy's own hooks, a resume check, what a Hydra-net site reads, and a runner for the benchmarks' --quick
modes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

from hydrafl import protocol
from hydrafl.client import site_app
from hydrafl.config import RunConfig
from hydrafl.identity import claim_server_identity
from hydrafl.models import build_model
from hydrafl.server import server_app
from hydrafl.server.config import CoordinatorConfig
from hydrafl.server.coordinator import Coordinator
from hydrafl.server.transport.grid import CoordinatorGrid
from hydrafl.simulation.grid import FIRST_NODE_ID, InProcessGrid
from hydrafl.strategies.hooks import QueriesSites
from hydrafl.subnet.apply import trainable_slices
from hydrafl.subnet.planning import COST_FIELDS, LayerCost
from hydrafl.subnet.slices import Slice, read_slices
from hydrafl.subnet.spec import SubnetSpec

SMALL_RUN = RunConfig(
    task="tabular", sites=3, samples_per_site=60, rounds=3, local_steps=3, batch_size=16, lr=3e-3
)
"""Three small tabular sites, a few rounds of a few steps: a real federation that runs in a few seconds. The
tests' run configs derive from it (`SMALL_RUN.replace(...)` names what a test sets differently)."""
TIERED_RUN = SMALL_RUN.replace(
    strategy="hydra", rounds=2, site_tiers="small,medium,large", score_samples=16
)
"""Three small tabular sites, one per resource tier, under Hydra: the shared setting of the subnetwork
strategies' tests (`TIERED_RUN.replace(strategy=...)` keeps the budget knobs the strategies share)."""
ASYNC_SITES: dict[str, Any] = dict(
    task="tabular",
    sites=4,
    samples_per_site=32,
    local_steps=2,
    batch_size=8,
    site_speeds="1,1,1,0.1",
)
"""Four small tabular sites for the asynchronous driver's virtual clock, the fourth ten times slower."""
TIER_OF_NODE = {FIRST_NODE_ID + i: tier for i, tier in enumerate(TIERED_RUN.tier_list)}


def _reply(content: RecordDict, node_id: int, message_type: str) -> Message:
    """`content` as node `node_id`'s reply to a `message_type` message."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1
    request = Message(RecordDict(), dst_node_id=node_id, message_type=message_type)
    request.metadata.__dict__["_message_id"] = f"request-{node_id}"
    return Message(content, reply_to=request)


def make_reply(arrays: dict[str, np.ndarray], num_examples: float, node_id: int = 1) -> Message:
    """A site's training reply as the strategy sees it (one ArrayRecord, one MetricRecord)."""
    content = RecordDict(
        {
            "arrays": ArrayRecord(
                {k: Array(np.asarray(v, dtype=np.float32)) for k, v in arrays.items()}
            ),
            "metrics": MetricRecord({"num-examples": num_examples}),
        }
    )
    return _reply(content, node_id, "train")


def make_scores_reply(
    node_id: int,
    layout: Mapping[str, tuple[int, int, int]],
    *,
    layers: Sequence[float],
    heads: Sequence[Sequence[float]],
    tier: str = "",
    num_examples: float = 1.0,
    cost: LayerCost | None = None,
    memory_bytes: float | None = None,
) -> Message:
    """A site's reply to the planning round's scoring query (`strategies.planner.read_scores`): metrics
    `layer-L` and `head-L-G` (one row of head-group scores per layer), `num-examples`, the step cost it measured
    (`cost.*`: the `COST_FIELDS`; a site sends no head fraction) and the memory it declares when given;
    ConfigRecord `site` with its tier and its slice layout
    (per federated array: layer or -1, head axis or -1, indices one head group owns along it)."""
    metrics = {
        f"{protocol.LAYER_PREFIX}{layer}": float(score) for layer, score in enumerate(layers)
    }
    for layer, row in enumerate(heads):
        metrics.update(
            {f"{protocol.HEAD_PREFIX}{layer}-{g}": float(score) for g, score in enumerate(row)}
        )
    metrics[protocol.WEIGHT] = float(num_examples)
    if cost is not None:
        metrics.update(
            {
                f"{protocol.COST_PREFIX}{f.replace('_', '-')}": float(getattr(cost, f))
                for f in COST_FIELDS
            }
        )
    if memory_bytes is not None:
        metrics[protocol.MEMORY_BYTES] = float(memory_bytes)
    names = list(layout)
    site = ConfigRecord(
        {
            protocol.TIER: tier,
            protocol.LAYOUT_NAMES: names,
            protocol.LAYOUT_LAYERS: [layout[name][0] for name in names],
            protocol.LAYOUT_AXES: [layout[name][1] for name in names],
            protocol.LAYOUT_UNITS: [layout[name][2] for name in names],
        }
    )
    content = RecordDict({"metrics": MetricRecord(metrics), protocol.SITE_RECORD: site})
    return _reply(content, node_id, protocol.QUERY_SCORES)


def reply_layout(reply: Message) -> dict[str, tuple[int, int, int]]:
    """The slice layout a site reported in its scoring reply, per array name."""
    site = reply.content[protocol.SITE_RECORD]
    keys = (
        protocol.LAYOUT_NAMES,
        protocol.LAYOUT_LAYERS,
        protocol.LAYOUT_AXES,
        protocol.LAYOUT_UNITS,
    )
    names, layers, axes, units = (list(site[key]) for key in keys)
    return dict(zip(names, zip(layers, axes, units, strict=True), strict=True))


class FakeGrid:
    """What a strategy's configure_* hooks ask of a Flower Grid: the ids of the connected nodes. Like a
    server-side runtime it owns the task identity Flower builds new messages from."""

    def __init__(self, node_ids: Iterable[int]) -> None:
        claim_server_identity(1)
        self.node_ids = list(node_ids)

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)


def configure_round(
    strategy: Any,
    server_round: int,
    arrays: ArrayRecord,
    scores: Mapping[int, Message],
    config: Mapping[str, Any] | None = None,
) -> dict[int, Message]:
    """One round set up through `strategy`'s own hooks on a grid of the nodes `scores` has a key for, as the round
    driver does: a strategy that queries sites gets its planning queries, when it asks any, answered with
    `scores[node]` (`aggregate_query`); then its train messages (`configure_train`), by destination node."""
    grid, config = FakeGrid(sorted(scores)), dict(config or {})
    if isinstance(strategy, QueriesSites):
        queries = list(strategy.configure_query(server_round, arrays, ConfigRecord(config), grid))
        if queries:
            strategy.aggregate_query(
                server_round, [scores[query.metadata.dst_node_id] for query in queries]
            )
    messages = strategy.configure_train(server_round, arrays, ConfigRecord(config), grid)
    return {message.metadata.dst_node_id: message for message in messages}


def sent_specs(messages: Mapping[int, Message] | Iterable[Message]) -> dict[int, SubnetSpec]:
    """The SubnetSpec each train message assigns its node."""
    messages = messages.values() if isinstance(messages, Mapping) else messages
    return {
        m.metadata.dst_node_id: SubnetSpec.from_config(dict(m.content["config"])) for m in messages
    }


def run_quick(name: str, out: Path, timeout_s: float) -> dict[str, Any]:
    command = [sys.executable, "-m", f"hydrafl.benchmarks.{name}", "--quick", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert (out / f"{name}.png").stat().st_size > 0
    return json.loads((out / f"{name}.json").read_text())


def assert_resume_matches_a_straight_run(cfg: RunConfig, tmp_path: Path) -> None:
    """Stopped after rounds - 1 and resumed, a run ends with exactly the arrays of an uninterrupted one."""

    def run(cfg: RunConfig):
        return server_app.run_federation(
            InProcessGrid(site_app.client_app, cfg.sites, cfg.to_flower()), cfg
        )

    straight = run(cfg.replace(run_dir=str(tmp_path / "straight")))
    run(cfg.replace(run_dir=str(tmp_path / "resumed"), rounds=cfg.rounds - 1))
    resumed = run(cfg.replace(run_dir=str(tmp_path / "resumed"), resume=True))
    for name, array in straight.arrays.items():
        np.testing.assert_array_equal(array.numpy(), resumed.arrays[name].numpy())


def site_read_slices(cfg: RunConfig, spec: SubnetSpec) -> dict[str, Slice]:
    """What a site's forward pass reads under `spec` (`subnet.slices.read_slices`), from a live model as the site
    computes it: all a Hydra-net site is sent."""
    model = build_model(
        site_app.run_cohort(cfg).task, model=cfg.model, seed=cfg.seed, lora=site_app.lora_spec(cfg)
    )
    layout = site_app.slice_layout(model)
    return read_slices(
        trainable_slices(model, spec),
        dict(zip(layout["layout.names"], layout["layout.layers"], strict=True)),
        spec,
    )


def local_coordinator(tmp_path: Path, **settings: Any) -> Coordinator:
    """A started coordinator on a free loopback port, its SQLite database, blobs and runs in `tmp_path`;
    `settings` are further CoordinatorConfig fields. The caller stops it."""
    coordinator = Coordinator(
        CoordinatorConfig(
            listen="127.0.0.1:0",
            db_url=f"sqlite:///{tmp_path / 'c.db'}",
            blob_dir=tmp_path / "blobs",
            runs_dir=tmp_path / "runs",
            **settings,
        )
    )
    coordinator.start()
    return coordinator


def started_coordinator_run(
    tmp_path: Path, *sites: str
) -> tuple[Coordinator, CoordinatorGrid, list[tuple[Any, str]]]:
    """A coordinator on a free loopback port (SQLite and blobs in `tmp_path`), `sites` enrolled as (site, token),
    and a running run with its grid. The caller stops the coordinator."""
    coordinator = local_coordinator(tmp_path)
    store = coordinator.store
    enrolled = [store.add_site(name) for name in sites]
    run = store.create_run({"rounds": 1})
    store.set_run_status(run.id, "running")
    return (
        coordinator,
        CoordinatorGrid(store, coordinator.blobs, coordinator.service, run.id),
        enrolled,
    )


def site_app_failing(partitions: set[int]) -> ClientApp:
    """hydrafl's ClientApp whose sites in `partitions` crash while training (after any key stages)."""
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        if context.node_config["partition-id"] in partitions:
            raise RuntimeError("site lost power")
        return site_app.train(message, context)

    app.evaluate()(site_app.evaluate_site)
    app.query("init")(site_app.initial_model)
    app.query("scores")(site_app.scores)  # Hydra's planning round
    return app


def assert_same_numbers_over_grpc(tmp_path: Path, cfg: RunConfig) -> None:
    """A real coordinator and real `hydrafl site` processes (the reply checks on the wire, each site's state
    in its agent's Context across rounds) end every round with the in-process grid's numbers."""
    from deployment import run_to_end

    from hydrafl.simulation.compare import run_strategy

    inprocess = run_strategy(cfg.replace(run_dir=str(tmp_path / "in")), "inprocess")
    store, run_id = run_to_end(tmp_path, cfg, [()] * cfg.sites, timeout_s=600)
    run = store.run(run_id)
    assert run.status == "finished", run.detail
    losses = [record["loss"] for record in inprocess]
    assert [record["loss"] for record in run.history] == pytest.approx(losses, rel=1e-5)
    assert [r["bytes_up"] for r in run.history] == [r["bytes_up"] for r in inprocess]
    assert all(record["sites_ok"] == cfg.sites for record in run.history[1:])


def assert_same_numbers_on_ray(tmp_path: Path, cfg: RunConfig) -> None:
    """Flower's Ray engine ends every round with the in-process grid's numbers."""
    from hydrafl.simulation.compare import run_strategy

    pytest.importorskip("ray")
    inprocess = run_strategy(cfg.replace(run_dir=str(tmp_path / "in")), "inprocess")
    on_ray = run_strategy(cfg.replace(run_dir=str(tmp_path / "ray")), "ray")
    losses = [record["loss"] for record in inprocess]
    assert [record["loss"] for record in on_ray] == pytest.approx(losses, rel=1e-5)
    assert [r["bytes_up"] for r in on_ray] == [r["bytes_up"] for r in inprocess]
