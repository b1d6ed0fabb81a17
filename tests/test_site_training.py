"""A site's training through the kernels, seen from the ClientApp and the coordinator: nproc-independent
deltas, the per-round data hash in replies and round records, and the pseudo-gradient diagnostics."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg
from helpers import SMALL_RUN, site_read_slices
from typer.testing import CliRunner

from hydrafl.arrays import from_record, sliced_record, to_record
from hydrafl.cli import app
from hydrafl.client import site_app, site_model
from hydrafl.client.training import train_flops_per_sample
from hydrafl.config import ConfigError, RunConfig
from hydrafl.kernels.elastic_loader import hash_global_batches, round_order
from hydrafl.models import build_model
from hydrafl.rounds import RoundRecord
from hydrafl.server import server_app
from hydrafl.server.aggregation.driver import DriverConfig, RoundDriver
from hydrafl.server.aggregation.pseudo_gradients import cosine_to_reference, noise_scale
from hydrafl.simulation.compare import run_strategy
from hydrafl.simulation.grid import POOLED_NODE_ID, InProcessGrid
from hydrafl.subnet.apply import apply_spec
from hydrafl.subnet.counts import forward_flops
from hydrafl.subnet.slices import Slice
from hydrafl.subnet.spec import SubnetSpec

CFG = SMALL_RUN.replace(sites=2, samples_per_site=50, rounds=15, local_steps=6, batch_size=8)


def _train_reply(
    nproc: int,
    cfg: RunConfig = CFG,
    node_index: int = 1,
    read: dict[str, Slice] | None = None,
    **extra: object,
) -> Message:
    """A site's train reply from the initial model, sent whole or, with `read`, cut to those slices."""
    cfg = cfg.replace(nproc=nproc)  # the run's settings reach the site once, with its grid
    grid = InProcessGrid(site_app.client_app, cfg.sites, cfg.to_flower())
    node = sorted(grid.get_node_ids())[node_index]
    initial = server_app.request_initial_arrays(grid, cfg)
    if read is not None:
        initial = sliced_record(initial, read)
    config = ConfigRecord({"server-round": 2, **extra})
    message = Message(
        RecordDict({"arrays": initial, "config": config}), dst_node_id=node, message_type="train"
    )
    [reply] = grid.send_and_receive([message])
    assert not reply.has_error(), reply.error.reason
    return reply


def _flat(record: ArrayRecord) -> torch.Tensor:
    return torch.cat([t.double().reshape(-1) for _, t in sorted(from_record(record).items())])


@pytest.fixture(scope="module")
def replies() -> dict[int, Message]:
    """The train reply of node 1 on one and on two processes; each made once, when a test first asks for it (the
    two-process one spawns its ranks: slow)."""

    class Replies(dict):
        def __missing__(self, nproc: int) -> Message:
            self[nproc] = _train_reply(nproc)
            return self[nproc]

    return Replies()


@pytest.mark.slow
def test_a_two_process_site_sends_the_one_process_delta(replies):
    one, two = (replies[n] for n in (1, 2))
    d1, d2 = _flat(one.content["arrays"]), _flat(two.content["arrays"])
    assert float(d1.norm()) > 1e-3  # it trained
    assert float((d1 - d2).norm() / d1.norm()) <= 1e-4
    assert one.content["metrics"]["train_loss"] == pytest.approx(
        two.content["metrics"]["train_loss"], rel=1e-5
    )
    assert one.content["metrics"]["num-examples"] == two.content["metrics"]["num-examples"] == 40
    # Attention key biases get only rounding noise (their true gradient is 0): never stepped, exactly 0 sent.
    for reply in (one, two):
        deltas = from_record(reply.content["arrays"])
        keys = [name for name in deltas if name.endswith("attention.self.key.bias")]
        assert len(keys) == 2 and all(float(deltas[name].abs().max()) == 0.0 for name in keys)


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_every_train_reply_carries_the_data_hash_and_throughput(replies, nproc):
    reply = replies[nproc]
    # Site 1 of 2, 40 training rows, global batch 8: 5 batches per pass, 6 steps read one batch of pass 1.
    seed = CFG.seed * 1_000_003 + 1
    passes = [round_order(40, seed, 2, epoch) for epoch in (0, 1)]
    batches = [passes[0][k * 8 : (k + 1) * 8] for k in range(5)] + [passes[1][:8]]
    assert reply.content["train-info"]["data-hash"] == hash_global_batches(
        batches
    )  # the same for any nproc
    metrics = reply.content["metrics"]
    assert metrics["samples-per-s"] > 0 and math.isfinite(metrics["samples-per-s"])
    assert "mfu" not in metrics  # CPU: its peak FLOP/s is unknown, throughput only


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "spec",
    [
        SubnetSpec(layers=(1,), heads=((0,),), bypass=True),
        SubnetSpec(layers=(1,), heads=((0,),), freeze_heads=True),
    ],
    ids=["bypass", "frozen-heads"],
)
def test_a_hydra_subnetwork_on_any_nproc_sends_the_one_process_delta(spec, nproc):
    """Each spawned process applies the subnetwork spec itself (head masks or gradient hooks): same delta, same
    tensors sent, also when the site was sent only what its Hydra-net reads (a bypassed layer 0 is not even
    downloaded). On one process too: a site sent only what its Hydra-net reads trains as one sent the whole model."""
    read = site_read_slices(CFG, spec)
    assert any(".layer.0." in name for name in read) != spec.bypass
    one, two = (
        _train_reply(1, strategy="hydra", **spec.to_config()),
        _train_reply(nproc, read=read, strategy="hydra", **spec.to_config()),
    )
    d1, d2 = from_record(one.content["arrays"]), from_record(two.content["arrays"])
    assert sorted(d1) == sorted(d2) and not any(
        ".layer.0." in name for name in d1
    )  # layer 0 not trained
    f1, f2 = _flat(one.content["arrays"]), _flat(two.content["arrays"])
    assert float(f1.norm()) > 1e-3 and float((f1 - f2).norm() / f1.norm()) <= 1e-4
    # what the spawned processes were handed were copies: the site's own model (its bypassed layer 0 included)
    # stays private, never in shared memory that simulation workers forked later would all write to
    working = site_model._working_model(
        site_app.run_cohort(CFG).task, CFG.model, CFG.seed, None, False
    )
    assert not [name for name, p in working.named_parameters() if p.is_shared()]


@pytest.mark.slow
def test_a_two_process_lora_site_sends_the_one_process_delta():
    """The spawned processes rebuild the LoRA-wrapped model: the LoRA factors and head train identically."""
    cfg = CFG.replace(lora_rank=4)
    one, two = (_train_reply(nproc, cfg) for nproc in (1, 2))
    assert any("lora_" in name for name in one.content["arrays"])
    f1, f2 = _flat(one.content["arrays"]), _flat(two.content["arrays"])
    assert float(f1.norm()) > 1e-4 and float((f1 - f2).norm() / f1.norm()) <= 1e-4


def test_sites_with_equal_data_sizes_read_different_orders():
    assert (
        _train_reply(1, node_index=0).content["train-info"]["data-hash"]
        != _train_reply(1, node_index=1).content["train-info"]["data-hash"]
    )


def test_nproc_must_divide_the_batch():
    with pytest.raises(ConfigError, match="batch-size=9.*multiple of nproc=2"):
        RunConfig(batch_size=9, nproc=2)
    with pytest.raises(ConfigError, match="nproc=0"):
        RunConfig(nproc=0)


def test_training_flops_per_sample_are_three_forwards_at_the_models_token_count():
    cohort = site_app.run_cohort(CFG)
    model = build_model(cohort.task)
    tokens = cohort.task.num_features + 1  # one token per feature and a CLS token
    assert train_flops_per_sample(model, cohort.sites[0].train_x) == 3 * forward_flops(
        model, tokens
    )


def test_round_records_keep_each_sites_data_hash(tmp_path):
    cfg = CFG.replace(rounds=2, local_steps=2, run_dir=str(tmp_path / "run"))
    grid = InProcessGrid(site_app.client_app, cfg.sites, cfg.to_flower())
    history = server_app.run_federation(grid, cfg).history
    for record in history[1:]:
        assert sorted(record["data_hash_per_site"]) == ["1001", "1002"]
        for site, digest in record["data_hash_per_site"].items():
            order = round_order(40, cfg.seed * 1_000_003 + int(site) - 1001, record["round"])
            assert digest == hash_global_batches([order[:8], order[8:16]])
    assert history[0]["data_hash_per_site"] == {}  # round 0 only evaluates
    saved = json.loads((tmp_path / "run" / "history.json").read_text())
    assert saved[2]["data_hash_per_site"] == history[2]["data_hash_per_site"]
    assert (
        history[1]["noise_scale"] is None and history[1]["full_data_cosine"] is None
    )  # diagnostics are opt-in


# --- diagnostics: exact numbers from sites whose deltas are known ---------------------------------------------

SITE_DELTAS = {0: [1.0, 0.0, 2.0], 1: [0.0, 1.0, 2.0], 2: [2.0, 1.0, -1.0]}
SITE_WEIGHTS = {0: 10, 1: 30, 2: 20}
POOLED_DELTA = [1.0, 1.0, 1.0]


def _scripted_app() -> ClientApp:
    """Sites reply with fixed deltas; the pooled reference site (partition-id = number of sites) with another."""
    scripted = ClientApp()

    @scripted.train()
    def train(message: Message, context: Context) -> Message:
        site = int(context.node_config["partition-id"])
        delta = POOLED_DELTA if context.node_config.get("pooled") else SITE_DELTAS[site]
        metrics = MetricRecord({"num-examples": SITE_WEIGHTS.get(site, 60)})
        info = ConfigRecord({"data-hash": f"hash-{site}"})
        arrays = to_record({"w": torch.tensor(delta)})
        return Message(
            RecordDict({"arrays": arrays, "metrics": metrics, "train-info": info}), reply_to=message
        )

    @scripted.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        return Message(
            RecordDict({"metrics": MetricRecord({"num-examples": 1, "loss": 1.0})}),
            reply_to=message,
        )

    return scripted


def test_diagnostics_stream_the_noise_scale_and_compare_with_the_full_data_delta():
    grid = InProcessGrid(_scripted_app(), 3, pooled_site=True)
    assert grid.reference_node == POOLED_NODE_ID and POOLED_NODE_ID not in grid.get_node_ids()
    config = DriverConfig(
        num_rounds=1, required_sites=3, diagnostics=True, reference_node=grid.reference_node
    )
    history = (
        RoundDriver(grid, FedAvg(), config).run(lambda: to_record({"w": torch.zeros(3)})).history
    )
    deltas = [{"w": torch.tensor(SITE_DELTAS[i], dtype=torch.float64)} for i in range(3)]
    weights = [SITE_WEIGHTS[i] for i in range(3)]
    average = {"w": sum(w * d["w"] for w, d in zip(weights, deltas, strict=True)) / sum(weights)}
    assert history[1]["noise_scale"] == pytest.approx(noise_scale(deltas, weights), rel=1e-12)
    expected_cosine = cosine_to_reference(average, {"w": torch.tensor(POOLED_DELTA)})
    assert history[1]["full_data_cosine"] == pytest.approx(expected_cosine, rel=1e-12)
    # by hand: average (10 (1, 0, 2) + 30 (0, 1, 2) + 20 (2, 1, -1)) / 60 = (5/6, 5/6, 1) against (1, 1, 1)
    assert expected_cosine == pytest.approx(
        (5 / 3 + 1) / (math.sqrt(2 * 25 / 36 + 1) * math.sqrt(3))
    )
    assert history[1]["data_hash_per_site"] == {
        "1001": "hash-0",
        "1002": "hash-1",
        "1003": "hash-2",
    }
    assert RoundRecord(**history[1]).noise_scale == history[1]["noise_scale"]


@pytest.mark.slow
def test_simulation_diagnostics_on_the_real_app_and_in_the_report(tmp_path):
    cfg = CFG.replace(sites=3, rounds=2, local_steps=3, diagnostics=True, run_dir="")
    history = run_strategy(cfg, "inprocess")
    for record in history[1:]:
        assert 0 < record["noise_scale"] < math.inf
        assert -1.0 <= record["full_data_cosine"] <= 1.0 and record["full_data_cosine"] > 0.3
    plain = run_strategy(cfg.replace(diagnostics=False), "inprocess")
    assert [r["loss"] for r in plain] == [
        r["loss"] for r in history
    ]  # the extra run changes no numbers


def _simulate_args(out: Path) -> list[str]:
    return [
        "simulate",
        "--task",
        "tabular",
        "--sites",
        "2",
        "--samples-per-site",
        "40",
        "--rounds",
        "1",
        "--local-steps",
        "2",
        "--batch-size",
        "8",
        "--strategies",
        "fedavg",
        "--out",
        str(out),
        "--no-progress",
    ]


def _simulate_with_diagnostics(out: Path) -> list[dict]:
    """`hydrafl simulate --diagnostics` of one small FedAvg round: its round records, checked for the
    diagnostics and the data hashes in the results and the report."""
    result = CliRunner().invoke(app, [*_simulate_args(out), "--diagnostics"])
    assert result.exit_code == 0, result.output
    rounds = json.loads((out / "results.json").read_text())["strategies"]["fedavg"]["rounds"]
    assert rounds[1]["noise_scale"] > 0 and len(rounds[1]["data_hash_per_site"]) == 2
    assert "Pseudo-gradient diagnostics" in (out / "report.md").read_text()
    return rounds


def test_simulate_cli_diagnostics_and_an_nproc_that_does_not_divide_the_batch(tmp_path):
    _simulate_with_diagnostics(tmp_path / "o")
    bad = CliRunner().invoke(app, [*_simulate_args(tmp_path / "bad"), "--nproc", "3"])
    assert bad.exit_code == 2 and "multiple of nproc=3" in " ".join(bad.output.split())


@pytest.mark.slow
def test_simulate_cli_nproc_and_diagnostics_end_to_end(tmp_path):
    rounds = _simulate_with_diagnostics(tmp_path / "o")
    two = (
        tmp_path / "two"
    )  # every simulated site on two processes: the same batches, the same round
    result = CliRunner().invoke(app, [*_simulate_args(two), "--nproc", "2"])
    assert result.exit_code == 0, result.output
    on_two = json.loads((two / "results.json").read_text())["strategies"]["fedavg"]["rounds"]
    assert on_two[1]["data_hash_per_site"] == rounds[1]["data_hash_per_site"]
    assert on_two[1]["loss"] == pytest.approx(rounds[1]["loss"], rel=1e-4)


def test_site_cli_puts_nproc_in_the_node_config(monkeypatch):
    import hydrafl.client.agent as agent

    seen = {}

    class FakeAgent:
        def __init__(self, coordinator, token, client_app, node_config, **kwargs):
            seen.update(node_config)

        def run(self):
            return None

    monkeypatch.setattr(agent, "SiteAgent", FakeAgent)
    result = CliRunner().invoke(app, ["site", "--token", "t", "--nproc", "4"])
    assert result.exit_code == 0, result.output
    assert seen == {"nproc": 4}
    seen.clear()
    result = CliRunner().invoke(
        app, ["site", "--token", "t", "--nproc", "2", "--max-restarts", "3"]
    )
    assert result.exit_code == 0, result.output
    assert seen == {"nproc": 2, "max-restarts": 3}


def test_the_coordinator_keeps_data_hashes_in_the_run_history(tmp_path, monkeypatch):
    from hydrafl.server import coordinator as coordinator_module
    from hydrafl.server.config import CoordinatorConfig

    db = f"sqlite:///{tmp_path / 'c.db'}"
    coordinator = coordinator_module.Coordinator(
        CoordinatorConfig(
            listen="127.0.0.1:0", db_url=db, blob_dir=tmp_path / "blobs", runs_dir=tmp_path / "runs"
        )
    )

    def fake_federation(grid, cfg, *, on_round, resident_model_bytes):
        on_round(RoundRecord(round=1, data_hash_per_site={"7": "ab" * 32, "8": "cd" * 32}))

    monkeypatch.setattr(coordinator_module, "run_federation", fake_federation)
    run = coordinator.store.create_run({**RunConfig(rounds=1).to_flower()})
    coordinator.drive(run)
    status = CliRunner().invoke(app, ["admin", "run", "status", str(run.id), "--json", "--db", db])
    history = json.loads(status.output)["history"]
    assert history[0]["data_hash_per_site"] == {"7": "ab" * 32, "8": "cd" * 32}


def test_bf16_autocast_trains_close_to_fp32_but_not_identically(replies):
    fp32 = _flat(replies[1].content["arrays"])
    bf16 = _flat(_train_reply(1, CFG.replace(bf16=True)).content["arrays"])
    relative = float((bf16 - fp32).norm() / fp32.norm())
    assert (
        0.0 < relative < 0.5
    )  # bfloat16 matmuls round (8-bit mantissa), yet the update points the same way
    assert float(torch.nn.functional.cosine_similarity(bf16, fp32, dim=0)) > 0.9


def test_training_flops_of_a_bypassing_subnetwork_count_only_the_layers_it_runs():
    """A Hydra-net that skips layer 0 still finds its token count (at its first executed layer) and is charged
    only for what it runs."""
    cohort = site_app.run_cohort(CFG)
    model = build_model(cohort.task)
    spec = SubnetSpec(layers=(1,), bypass=True)
    tokens = cohort.task.num_features + 1
    with apply_spec(model, spec):
        flops = train_flops_per_sample(model, cohort.sites[0].train_x, spec)
    assert flops == 3 * forward_flops(model, tokens, spec) < 3 * forward_flops(model, tokens)
