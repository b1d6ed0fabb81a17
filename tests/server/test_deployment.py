"""A real coordinator process and real site processes on loopback, against the in-process simulation.

The coordinator streams each reply to DiLoCo and Hydra as it arrives, in whatever order the sites finish; the
simulation's order is node order. Float sums in a different order may differ in their last bits, and so may the
numbers after them: losses compare with a relative tolerance, not bit for bit."""

from __future__ import annotations

import signal
import subprocess

import numpy as np
import pytest
from deployment import enrol, queue_run, start_hydrafl, wait_serving, wait_until
from flwr.app import ConfigRecord
from helpers import SMALL_RUN

from hydrafl.client import site_app
from hydrafl.config import RunConfig
from hydrafl.lora_pairs import lora_pairs
from hydrafl.server import server_app
from hydrafl.server.aggregation.checkpoint import load_checkpoint
from hydrafl.server.tables import Run as StoredRun
from hydrafl.simulation.compare import run_strategy
from hydrafl.simulation.grid import FIRST_NODE_ID, InProcessGrid
from hydrafl.strategies import build_strategy

RUN = SMALL_RUN.replace(strategy="diloco", outer_lr=0.5)


@pytest.fixture
def deployment(tmp_path):
    env, db, store, tokens, address = enrol(tmp_path, RUN)
    run_id = queue_run(store, RUN)
    server_args = ("server", "--listen", address, "--db", db, "--blobs", str(tmp_path / "blobs"))
    processes: list[subprocess.Popen] = []

    def start_server() -> subprocess.Popen:
        process = start_hydrafl(*server_args, env=env, log=tmp_path / "coordinator.log")
        processes.append(process)
        wait_serving(address)
        return process

    def start_site(token: str, *options: str) -> subprocess.Popen:
        log = tmp_path / f"site-{tokens.index(token)}.log"
        process = start_hydrafl(
            "site", "--coordinator", address, "--token", token, *options, env=env, log=log
        )
        processes.append(process)
        return process

    yield store, run_id, address, tokens, start_server, start_site
    for process in processes:
        process.kill()
        process.wait()


def _set_run_config(deployment, options: dict) -> None:
    """The queued run with these options on top of RUN (before the coordinator starts)."""
    store, run_id = deployment[:2]
    with store.session() as session, session.begin():
        run = session.get(StoredRun, run_id)
        run.config = {**run.config, **options}


def _finished_run(deployment, site_options: list[tuple[str, ...]] | None = None) -> StoredRun:
    """Start the coordinator and one site per token (each with its options), and wait for the run to finish."""
    store, run_id, _, tokens, start_server, start_site = deployment
    start_server()
    for index, token in enumerate(tokens):
        start_site(token, *(site_options[index] if site_options else ()))
    wait_until(
        lambda: store.run(run_id).status in ("finished", "failed"), 240, "the run did not finish"
    )
    run = store.run(run_id)
    assert run.status == "finished", run.detail
    return run


def _tiered_run_matches_the_simulation(deployment, tmp_path, options: dict) -> list[dict]:
    """RUN with `options` over the wire, each site declaring its tier (`hydrafl site --tier`), against the
    simulation with the same tiers from the run: bytes per site in site order and the losses. Returns the
    simulation's history."""
    _set_run_config(deployment, options)
    run = _finished_run(deployment, [("--tier", tier) for tier in ("small", "medium", "large")])
    cfg = RunConfig.from_flower(
        {
            **RUN.to_flower(),
            **options,
            "site-tiers": "small,medium,large",
            "run-dir": str(tmp_path / "sim"),
        },
        other_knobs=True,  # the base run's DiLoCo-only knobs, which the coordinator also passes over
    )
    simulated = run_strategy(cfg, "inprocess")
    for deployed, local in zip(run.history, simulated, strict=True):
        for key in ("bytes_up_per_site", "bytes_down_per_site"):  # node ids differ: site order
            assert [n for _, n in sorted(deployed[key].items())] == [
                n for _, n in sorted(local[key].items())
            ]
        assert deployed["loss"] == pytest.approx(local["loss"], rel=1e-5)
    return simulated


def _history_numbers(history):
    return [(r["round"], r["loss"], r["accuracy"], r["sites_ok"], r["bytes_up"]) for r in history]


@pytest.mark.slow
def test_coordinator_and_three_sites_match_the_simulation(deployment, tmp_path):
    store, run_id = deployment[:2]
    run = _finished_run(deployment)
    simulated = run_strategy(
        RunConfig.from_flower({**RUN.to_flower(), "run-dir": str(tmp_path / "sim")}), "inprocess"
    )
    for (r1, loss1, acc1, ok1, up1), (r2, loss2, acc2, ok2, up2) in zip(
        _history_numbers(run.history), _history_numbers(simulated), strict=True
    ):
        assert (r1, ok1, up1) == (r2, ok2, up2)
        assert loss1 == pytest.approx(loss2, rel=1e-5) and acc1 == pytest.approx(acc2, abs=1e-9)
    kinds = [event.kind for event in store.audit_events()]
    # train + evaluate each round, the round-0 evaluation, one init query, one curvature probe per site
    assert kinds.count("update-accepted") == RUN.rounds * RUN.sites * 2 + RUN.sites + 1 + RUN.sites
    assert "run-finished" in kinds
    run_dir = tmp_path / "home" / "runs" / str(run_id)
    assert (
        (run_dir / "rounds.tsv")
        .read_text()
        .splitlines()[0]
        .startswith("round\tduration_s\taggregation_s\tgap_s")
    )
    latency = [
        line.split("\t") for line in (run_dir / "push_latency.tsv").read_text().splitlines()[1:]
    ]
    assert {row[0] for row in latency} == {f"hospital-{i}" for i in range(RUN.sites)}
    assert all(float(row[3]) <= float(row[4]) for row in latency)  # P50 <= P99


@pytest.mark.slow
def test_hydra_nets_over_the_wire_match_the_simulation(deployment, tmp_path):
    """Compact downloads and uploads (each site only its Hydra-net's slices) through the real transport; each
    site declares its own tier (`hydrafl site --tier`), the simulation gets the same tiers from the run."""
    hydra = {
        "strategy": "hydra",
        "hydra-bypass": True,
        "hydra-head-mode": "drop",
        "score-samples": 16,
        "outer-lr": 0.7,
    }  # the run's diloco outer-lr back at its default: hydra's default outer step ignores it
    simulated = _tiered_run_matches_the_simulation(deployment, tmp_path, hydra)
    down = sorted(simulated[1]["bytes_down_per_site"].values())
    assert (
        down[0] < down[1] < down[2]
    )  # small, medium and large Hydra-nets: three different downloads


@pytest.mark.slow
def test_compressed_downloads_over_the_wire_match_the_simulation(deployment, tmp_path):
    """Error-feedback downloads through the real transport: each site holds the reference the coordinator built
    its message on, and the bytes each site downloads and the losses are those of the in-process simulation."""
    compressed = {"compress": "int8", "compress-downloads": True}
    _set_run_config(deployment, compressed)
    run = _finished_run(deployment)
    plain = run_strategy(
        RunConfig.from_flower({**RUN.to_flower(), "run-dir": str(tmp_path / "plain")}), "inprocess"
    )
    simulated = run_strategy(
        RunConfig.from_flower({**RUN.to_flower(), **compressed, "run-dir": str(tmp_path / "sim")}),
        "inprocess",
    )
    for deployed, local in zip(run.history, simulated, strict=True):
        assert sorted(deployed["bytes_down_per_site"].values()) == sorted(
            local["bytes_down_per_site"].values()
        )
        assert deployed["loss"] == pytest.approx(local["loss"], rel=1e-5)
    middle = len(plain) // 2  # after first contact, before the final evaluation's whole model
    compressed_down, plain_down = (
        sum(h[middle]["bytes_down_per_site"].values()) for h in (run.history, plain)
    )
    assert compressed_down < plain_down / 3


@pytest.mark.slow
def test_kill_9_of_the_coordinator_mid_run_then_restart_finishes_with_the_same_model(
    deployment, tmp_path
):
    store, run_id, address, tokens, start_server, start_site = deployment
    server = start_server()
    for token in tokens:
        start_site(token)
    wait_until(lambda: store.run(run_id).rounds_done >= 1, 240, "round 1 never completed")
    server.send_signal(signal.SIGKILL)
    server.wait()
    assert store.run(run_id).status == "running"
    start_server()
    wait_until(
        lambda: store.run(run_id).status in ("finished", "failed"),
        240,
        "the restarted run did not finish",
    )
    run = store.run(run_id)
    assert run.status == "finished", run.detail
    simulated = run_strategy(
        RunConfig.from_flower({**RUN.to_flower(), "run-dir": str(tmp_path / "sim")}), "inprocess"
    )
    assert [r["round"] for r in run.history] == [0, 1, 2, 3]
    assert run.history[-1]["loss"] == pytest.approx(simulated[-1]["loss"], rel=1e-5)
    # every update accepted exactly once, before or after the crash: none lost, none counted twice
    accepted = [event.detail for event in store.audit_events("update-accepted")]
    assert (
        len(accepted)
        == len(set(accepted))
        == RUN.rounds * RUN.sites * 2 + RUN.sites + 1 + RUN.sites
    )


@pytest.mark.slow
def test_a_site_killed_mid_round_is_left_out_at_the_deadline_and_rejoins(deployment, tmp_path):
    store, run_id, address, tokens, start_server, start_site = deployment
    _set_run_config(
        deployment, {"min-sites": 2, "round-timeout-s": 10.0, "strategy": "fedavg", "rounds": 48}
    )
    start_server()
    sites = {token: start_site(token) for token in tokens}
    # two sites suffice to start: a slow third joins later, so wait for a round all three trained in
    wait_until(
        lambda: any(r.get("sites_ok") == 3 for r in store.run(run_id).history[1:]),
        240,
        "no round trained with all three sites",
    )
    victim = sites[tokens[-1]]
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    # the victim may have sent this round's update before it died: wait for the first round it misses
    wait_until(
        lambda: any(r.get("sites_failed") for r in store.run(run_id).history),
        240,
        "no round missed the victim",
    )
    start_site(
        tokens[-1]
    )  # rounds to spare (a few tenths of a second each): a site's process takes seconds to start
    wait_until(
        lambda: store.run(run_id).status in ("finished", "failed"), 300, "the run did not finish"
    )
    run = store.run(run_id)
    assert run.status == "finished", run.detail
    missed = next(i for i, record in enumerate(run.history) if record.get("sites_failed"))
    assert missed >= 2  # a round closed with everyone before the kill
    assert (run.history[missed]["sites_ok"], run.history[missed]["sites_failed"]) == (
        2,
        1,
    )  # closed at the deadline
    assert 3 in [
        record["sites_ok"] for record in run.history[missed + 1 :]
    ]  # the restarted site is back


@pytest.mark.slow
def test_expert_selection_over_the_wire_matches_the_simulation(deployment, tmp_path):
    """tiny-moe on the next-token task: three site processes of different tiers each upload only their experts'
    rows; bytes per site and round and the losses are the simulation's."""
    moe = {
        "strategy": "hydra",
        "task": "clinical-notes-lm",
        "model": "tiny-moe",
        "rounds": 2,
        "score-samples": 16,
        "outer-lr": 0.7,
    }
    simulated = _tiered_run_matches_the_simulation(deployment, tmp_path, moe)
    up = sorted(simulated[1]["bytes_up_per_site"].values())
    assert up[0] < up[1] < up[2]  # 2, 4 and 8 of the 8 experts per layer


def _bytes_per_site(rounds_tsv) -> list[tuple[list[int], list[int]]]:
    """Per round, the (up, down) bytes of each site in node order, as `rounds.tsv` lists them (`node:bytes`)."""
    header, *rows = (line.split("\t") for line in rounds_tsv.read_text().splitlines())

    def in_node_order(cell: str) -> list[int]:
        pairs = [] if cell == "-" else [pair.split(":") for pair in cell.split(",")]
        assert [int(n) for n, _ in pairs] == sorted(int(n) for n, _ in pairs)
        return [int(b) for _, b in pairs]

    columns = [header.index(f"bytes_{way}_per_site") for way in ("up", "down")]
    return [tuple(in_node_order(row[c]) for c in columns) for row in rows]  # type: ignore[misc]


def _in_node_order(counts: dict[str, int]) -> list[int]:
    return [counts[node] for node in sorted(counts, key=int)]


@pytest.mark.slow
def test_hydra_over_lora_bytes_and_budgets_over_the_wire_match_the_simulation(deployment, tmp_path):
    """The bytes benchmark's configuration (Hydra over LoRA, the layers outside a site's net frozen) on the tiny
    BERT: a coordinator and three site processes of tiers small, medium and large write the same bytes per site
    and round in `rounds.tsv` as the simulation (site by site in node order: node ids differ), each tier trains
    the same parameters, and the final model agrees: the plain arrays to 1e-5, each adapted module's B A to 1% of
    its norm. The factors come from a truncated SVD of the mean product, whose kept subspace turns by (difference
    in the sums) / (gap between the R-th and (R+1)-th singular values): float32 sums in the order replies arrive,
    1e-7 apart, have moved one module's B A by 5e-4 of its norm after two rounds (single factor entries by 3e-4).
    A wrong slice or a lost reply moves it by tens of percent."""
    lora = {
        "strategy": "hydra",
        "task": "clinical-text",
        "lora-rank": 4,
        "rounds": 2,
        "score-samples": 16,
        "outer-lr": 0.7,
    }
    simulated = _tiered_run_matches_the_simulation(deployment, tmp_path, lora)
    store, run_id = deployment[:2]
    run = store.run(run_id)
    deployed_dir, simulated_dir = tmp_path / "home" / "runs" / str(run_id), tmp_path / "sim"
    tsv = _bytes_per_site(deployed_dir / "rounds.tsv")
    assert tsv == _bytes_per_site(simulated_dir / "rounds.tsv")
    assert tsv == [
        (_in_node_order(r["bytes_up_per_site"]), _in_node_order(r["bytes_down_per_site"]))
        for r in simulated
    ]
    for deployed, local in zip(run.history, simulated, strict=True):
        assert _in_node_order(deployed["trainable_params_per_site"]) == _in_node_order(
            local["trainable_params_per_site"]
        )
        assert deployed["accuracy"] == pytest.approx(local["accuracy"], abs=1e-9)
    small, medium, large = _in_node_order(simulated[1]["trainable_params_per_site"])
    assert 0 < small < medium < large
    up, down = tsv[1]
    assert up == sorted(up) and len(set(up)) == 3  # each tier uploads what it trained
    assert len(set(down)) == 1  # frozen layers still run: every site downloads every factor
    deployed_model, simulated_model = (
        load_checkpoint(d).arrays for d in (deployed_dir, simulated_dir)
    )
    assert deployed_model.keys() == simulated_model.keys()
    pairs = lora_pairs(deployed_model.keys())
    factors = {name for pair in pairs for name in (pair.a, pair.b)}
    for name in deployed_model.keys() - factors:
        np.testing.assert_allclose(
            deployed_model[name].numpy(), simulated_model[name].numpy(), rtol=0, atol=1e-5
        )
    for pair in pairs:
        deployed, simulated_product = (
            model[pair.b].numpy() @ model[pair.a].numpy()
            for model in (deployed_model, simulated_model)
        )
        distance = np.linalg.norm(deployed - simulated_product) / np.linalg.norm(simulated_product)
        assert distance < 1e-2, pair.module


UNTIERED_HYDRA_LORA = {
    "strategy": "hydra",
    "task": "clinical-text",
    "lora-rank": 4,
    "rounds": 2,
    "score-samples": 16,
    "site-tiers": "",  # what a site declares sizes its net, not a tier
    "min-sites": 2,  # a site nothing fits sits the round out
    "outer": "nesterov",  # the base run's outer-lr, now used
}
"""Hydra over LoRA sized by each site's own limits: the run of the budget tests over the wire."""


def _site_step_bytes(cfg: RunConfig) -> tuple[float, float]:
    """The first site's measured step memory with no trained layer and per trained layer, from its own reply
    to Hydra's scoring query (a deadline makes it measure)."""
    timed = cfg.replace(round_timeout_s=3600.0)
    grid = InProcessGrid(site_app.client_app, timed.sites, timed.to_flower())
    initial = server_app.request_initial_arrays(grid, timed)
    queries = build_strategy(timed).configure_query(
        1, initial, ConfigRecord(timed.to_flower()), grid
    )
    query = next(q for q in queries if q.metadata.dst_node_id == FIRST_NODE_ID)
    [reply] = grid.send_and_receive([query])
    metrics = reply.content["metrics"]
    return metrics["cost.fixed-bytes"], metrics["cost.per-layer-bytes"]


@pytest.mark.slow
def test_hydra_nets_sized_by_each_site_s_declared_memory_match_the_simulation(deployment, tmp_path):
    """The budgets benchmark's tight group over the wire: no tiers; each site process declares its training
    memory (`hydrafl site --memory-mb`: less than one trained layer needs, room for one, no limit), measures its
    own step cost, and the coordinator sizes its Hydra-net from them: the first site sits every round out, the
    second trains one layer, the third both. The nets, the bytes per site and round, and the losses are the
    simulation's given the same limits as `site-memory-mb`; the second site trained within what it declared."""
    options = UNTIERED_HYDRA_LORA
    cfg = RunConfig.from_flower({**RUN.to_flower(), **options}, other_knobs=True)
    fixed, per_layer = _site_step_bytes(cfg)
    limits_mb = [(fixed + layers * per_layer) / 1e6 for layers in (0.8, 1.2)] + [0.0]
    _set_run_config(deployment, options)
    run = _finished_run(deployment, [("--memory-mb", f"{mb:.6f}") for mb in limits_mb])
    simulated = run_strategy(
        cfg.replace(
            site_memory_mb=",".join(f"{mb:.6f}" for mb in limits_mb),
            run_dir=str(tmp_path / "sim"),
        ),
        "inprocess",
    )
    for deployed, local in zip(run.history[1:], simulated[1:], strict=True):
        assert deployed["sites_ok"] == local["sites_ok"] == 2
        for key in ("trainable_params_per_site", "bytes_up_per_site", "peak_memory_per_site"):
            assert sorted(deployed[key].values()) == sorted(local[key].values()), key
        assert deployed["loss"] == pytest.approx(local["loss"], rel=1e-5)
        one_layer, both = sorted(deployed["trainable_params_per_site"].values())
        assert 0 < one_layer < both  # the limits set the nets: no tiers were given
        assert sorted(deployed["peak_memory_per_site"].values())[0] <= limits_mb[1] * 1e6


@pytest.mark.slow
def test_a_site_too_slow_for_the_round_deadline_sits_out_over_the_wire_as_in_the_simulation(
    deployment, tmp_path
):
    """The time budget over the wire: one site process is told it runs a hundred thousand times slower than it
    measures (`--node-config speed=...`, the key the simulation's `site-speeds` sets) and fits no Hydra-net in
    the run's deadline, so it sits every round out; the others fit every layer. The same nets, bytes and losses
    as the simulation's."""
    options = {**UNTIERED_HYDRA_LORA, "round-timeout-s": 120.0}
    speeds = ("0.00001", "1", "1")
    _set_run_config(deployment, options)
    run = _finished_run(deployment, [("--node-config", f"speed={speed}") for speed in speeds])
    cfg = RunConfig.from_flower({**RUN.to_flower(), **options}, other_knobs=True)
    simulated = run_strategy(
        cfg.replace(site_speeds=",".join(speeds), run_dir=str(tmp_path / "sim")), "inprocess"
    )
    for deployed, local in zip(run.history[1:], simulated[1:], strict=True):
        assert deployed["sites_ok"] == local["sites_ok"] == 2
        for key in ("trainable_params_per_site", "bytes_up_per_site"):
            assert sorted(deployed[key].values()) == sorted(local[key].values()), key
        assert len(set(deployed["trainable_params_per_site"].values())) == 1  # both fit every layer
        assert deployed["loss"] == pytest.approx(local["loss"], rel=1e-5)
