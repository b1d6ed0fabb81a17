"""Hydra end to end on the in-process grid: site scores, tiered subnetworks, partial updates, masked merge."""

from __future__ import annotations

import json
import math

import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict
from helpers import (
    TIER_OF_NODE,
    TIERED_RUN,
    assert_resume_matches_a_straight_run,
    reply_layout,
    sent_specs,
    site_read_slices,
)

from hydrafl.arrays import from_record, record_nbytes, to_record
from hydrafl.client import site_app, site_model
from hydrafl.lora_pairs import lora_pairs
from hydrafl.models import build_model, task_loss
from hydrafl.server import server_app
from hydrafl.simulation.compare import compare_strategies
from hydrafl.simulation.grid import FIRST_NODE_ID, InProcessGrid
from hydrafl.simulation_config import SimulationConfig
from hydrafl.strategies import Hydra, build_strategy
from hydrafl.subnet.apply import trainable_slices
from hydrafl.subnet.planning import COST_FIELDS, LayerCost, plan_budget
from hydrafl.subnet.scoring import head_importance, layer_importance
from hydrafl.subnet.slices import coordinate_masks, extract, layout_slices, merge
from hydrafl.subnet.spec import SubnetSpec

CFG = TIERED_RUN.replace(strategy="hydra")


def _query(cfg, grid, node, arrays) -> Message:
    """The scoring query Hydra sends `node` before round 1 (`configure_query`, on the run's config)."""
    queries = build_strategy(cfg).configure_query(1, arrays, ConfigRecord(cfg.to_flower()), grid)
    return next(query for query in queries if query.metadata.dst_node_id == node)


def _ask(grid, message_type, node, arrays, **config):
    """`node`'s reply to a message on `arrays` as the coordinator sends it: a scoring query is Hydra's own, a
    train message carries the run's config; `config` adds per-message keys (the run's settings are the grid's)."""
    sent = (
        _query(CFG, grid, node, arrays).content["config"]
        if message_type == "query.scores"
        else CFG.to_flower()
    )
    content = RecordDict({"arrays": arrays, "config": ConfigRecord({**sent, **config})})
    [reply] = grid.send_and_receive([Message(content, dst_node_id=node, message_type=message_type)])
    assert not reply.has_error(), reply.error.reason
    return reply


class _RecordingGrid(InProcessGrid):
    """The in-process grid, keeping every message the ServerApp sends and every reply it gets."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent: list[Message] = []
        self.replies: list[Message] = []

    def send_and_receive(self, messages, *args, **kwargs):
        messages = list(messages)
        self.sent.extend(messages)
        for reply in super().send_and_receive(messages, *args, **kwargs):
            self.replies.append(reply)
            yield reply

    def count(self, message_type: str) -> int:
        return sum(message.metadata.message_type == message_type for message in self.sent)

    def train_messages(self, server_round: int) -> list[Message]:
        return [
            message
            for message in self.sent
            if message.metadata.message_type == "train"
            and message.content["config"]["server-round"] == server_round
        ]

    def specs(self, server_round: int) -> dict[int, SubnetSpec]:
        """The Hydra-net each train message of `server_round` assigned its site."""
        return sent_specs(self.train_messages(server_round))

    def scores(self) -> list[Message]:
        """The replies to the planning round's scoring queries."""
        return [reply for reply in self.replies if reply.metadata.message_type == "query.scores"]


def test_site_scores_and_partial_train_reply():
    grid = InProcessGrid(site_app.client_app, CFG.sites, CFG.to_flower())
    initial = server_app.request_initial_arrays(grid, CFG)
    scores = _ask(grid, "query.scores", FIRST_NODE_ID, initial)
    metrics, site = scores.content["metrics"], scores.content["site"]
    assert {"layer-0", "layer-1", "head-0-0", "head-1-3", "num-examples"} <= set(metrics)
    assert all(metrics[key] >= 0 for key in metrics)
    assert site["tier"] == "small" and sorted(site["layout.names"]) == sorted(initial)

    spec = SubnetSpec(layers=(1,), heads=((0, 2),))
    reply = _ask(grid, "train", FIRST_NODE_ID, initial, **spec.to_config(), **{"server-round": 1})
    delta = from_record(reply.content["arrays"])
    model = build_model(site_app.run_cohort(CFG).task, seed=CFG.seed)
    slices = trainable_slices(model, spec)
    shapes = {name: tuple(array.shape) for name, array in initial.items()}
    assert set(delta) == set(slices) and len(delta) < len(initial)  # layer 0's tensors are not sent
    assert {name: tuple(t.shape) for name, t in delta.items()} == {
        n: sl.taken_shape(shapes[n]) for n, sl in slices.items()
    }
    sent = sum(t.numel() * t.element_size() for t in delta.values())
    assert sent == 4 * sum(
        sl.numel(shapes[name]) for name, sl in slices.items()
    )  # bytes = the slices, nothing else
    assert sent < 0.5 * sum(
        4 * math.prod(shape) for shape in shapes.values()
    )  # one layer of two, half its heads
    assert reply.content["metrics"]["trainable-params"] == sent // 4
    query = delta[
        "net.encoder.encoder.layer.1.attention.self.query.weight"
    ]  # heads 0 and 2 of 4, 16 rows each
    assert (
        query.shape[0] == 32
        and float(query[:16].abs().sum()) > 0
        and float(query[16:].abs().sum()) > 0
    )
    start = from_record(initial)
    merged = merge(
        start, slices, {name: sl.take(start[name]) - delta[name] for name, sl in slices.items()}
    )
    for name, mask in coordinate_masks(
        slices, start
    ).items():  # merging back touches exactly the slices
        torch.testing.assert_close(merged[name][~mask], start[name][~mask], rtol=0, atol=0)
        torch.testing.assert_close(
            slices[name].take(merged[name]), slices[name].take(start[name]) - delta[name]
        )


def test_hydra_two_rounds_changes_only_trained_coordinates_and_small_sites_send_less():
    cfg = CFG.replace(site_tiers="small,medium,small")  # a head of the second layer stays untrained
    tier_of_node = {FIRST_NODE_ID + i: tier for i, tier in enumerate(cfg.tier_list)}
    strategy = build_strategy(cfg)
    grid = _RecordingGrid(site_app.client_app, cfg.sites, cfg.to_flower())
    initial = from_record(server_app.request_initial_arrays(grid, cfg))
    result = server_app.run_federation(grid, cfg, strategy=strategy)
    final = from_record(result.arrays)

    assert isinstance(strategy, Hydra)
    scores = grid.scores()
    assert sorted(
        reply.metadata.src_node_id for reply in scores if not reply.has_error()
    ) == sorted(tier_of_node)
    specs = grid.specs(1)
    assert grid.specs(2) == specs  # scored once: the same subnetworks in both rounds
    trained = {name: torch.zeros(t.shape, dtype=torch.bool) for name, t in initial.items()}
    for spec in specs.values():
        for name, mask in coordinate_masks(
            layout_slices(reply_layout(scores[0]), spec), initial
        ).items():
            trained[name] |= mask
    assert not all(mask.all() for mask in trained.values())  # some coordinates nobody trained
    for name, mask in trained.items():
        torch.testing.assert_close(final[name][~mask], initial[name][~mask], rtol=0, atol=0)
    assert sum(int((final[name] != initial[name]).sum()) for name in initial) > 0

    sizes = {node: (len(spec.layers), [len(h) for h in spec.heads]) for node, spec in specs.items()}
    assert sizes == {
        FIRST_NODE_ID: (1, [2]),
        FIRST_NODE_ID + 1: (2, [3, 3]),
        FIRST_NODE_ID + 2: (1, [2]),
    }
    for record in result.history[1:]:
        up = {int(node): n for node, n in record["bytes_up_per_site"].items()}
        params = {int(node): n for node, n in strategy.trainable_params[record["round"]].items()}
        assert up[FIRST_NODE_ID] == up[FIRST_NODE_ID + 2] < up[FIRST_NODE_ID + 1]
        assert params[FIRST_NODE_ID] == params[FIRST_NODE_ID + 2] < params[FIRST_NODE_ID + 1]
        reported = {int(node): n for node, n in record["trainable_params_per_site"].items()}
        assert reported == params  # what each site trained is exactly what it was assigned
        assert all(n > 0 for n in record["peak_memory_per_site"].values())


@pytest.mark.slow
def test_simulate_hydra_and_fedavg_writes_per_site_counts(tmp_path):
    config = SimulationConfig(
        run=CFG.replace(rounds=1), strategies=("hydra", "fedavg"), out=str(tmp_path)
    )
    compare_strategies(config, show_progress=False)
    results = json.loads((tmp_path / "results.json").read_text())
    hydra = results["strategies"]["hydra"]
    params = {
        TIER_OF_NODE[int(node)]: n for node, n in hydra["trainable_params_per_site"]["1"].items()
    }
    assert params["small"] < params["medium"] < params["large"]
    fedavg = results["strategies"]["fedavg"]["rounds"][1]["bytes_up_per_site"]
    up = {TIER_OF_NODE[int(node)]: n for node, n in hydra["rounds"][1]["bytes_up_per_site"].items()}
    assert (
        up["small"] < up["medium"] <= up["large"] == max(fedavg.values())
    )  # large trains every coordinate
    assert "trainable_params_per_site" not in results["strategies"]["fedavg"]


@pytest.mark.slow
def test_resume_with_outer_nesterov_ends_with_the_same_numbers(tmp_path):
    cfg = CFG.replace(outer="nesterov", outer_lr=0.7, outer_momentum=0.9, rescore_every=2, rounds=3)
    assert_resume_matches_a_straight_run(cfg, tmp_path)


def test_unknown_site_tier_is_refused():
    with pytest.raises(ValueError, match="site-tiers"):
        CFG.replace(site_tiers="small,huge,large")


def test_a_site_that_declares_little_memory_gets_a_hydra_net_that_fits_it():
    cfg = CFG.replace(site_tiers="", rounds=1)
    grid = InProcessGrid(site_app.client_app, cfg.sites, cfg.to_flower())
    initial = server_app.request_initial_arrays(grid, cfg)
    undeclared = _ask(grid, "query.scores", FIRST_NODE_ID, initial).content["metrics"]
    assert (
        undeclared["memory-bytes"] == 0 and "cost.fixed-bytes" not in undeclared
    )  # nothing to size against
    timed = cfg.replace(round_timeout_s=3600.0)  # the run's settings reach a site once per run
    timed_grid = InProcessGrid(site_app.client_app, timed.sites, timed.to_flower())
    metrics = _ask(timed_grid, "query.scores", FIRST_NODE_ID, initial).content["metrics"]
    fixed, per_layer = metrics["cost.fixed-bytes"], metrics["cost.per-layer-bytes"]
    assert (
        fixed > 0 and per_layer > 0 and metrics["memory-bytes"] == 0
    )  # measured for the deadline; no memory
    limit_mb = (fixed + 1.2 * per_layer) / 1e6  # room for one trained layer, not two
    cfg = cfg.replace(site_memory_mb=f"{limit_mb},0,0")
    grid = _RecordingGrid(site_app.client_app, cfg.sites, cfg.to_flower())
    result = server_app.run_federation(grid, cfg, strategy=build_strategy(cfg))
    layers = {node: len(spec.layers) for node, spec in grid.specs(1).items()}
    assert layers == {FIRST_NODE_ID: 1, FIRST_NODE_ID + 1: 2, FIRST_NODE_ID + 2: 2}
    peak = result.history[1]["peak_memory_per_site"]
    assert (
        peak[str(FIRST_NODE_ID)] <= limit_mb * 1e6 < peak[str(FIRST_NODE_ID + 1)]
    )  # measured while training


@pytest.mark.parametrize(
    "spec",
    [
        SubnetSpec(layers=(1,), heads=((0, 2),)),
        SubnetSpec(layers=(1,), heads=((0, 2),), bypass=True),
        SubnetSpec(layers=(0, 1), width_ratio=0.5, train_outside=False),
        SubnetSpec(layers=(1,), heads=((0, 2),), freeze_heads=True),
    ],
    ids=["frozen-layer", "bypassed-layer", "width-frozen-outside", "frozen-heads"],
)
def test_a_site_trains_the_same_from_only_what_its_subnetwork_reads(spec):
    """Whatever the coordinates outside the download hold at the site, even NaN, its delta is the same to the
    bit."""
    grid = InProcessGrid(site_app.client_app, CFG.sites, CFG.to_flower())
    initial = server_app.request_initial_arrays(grid, CFG)
    config = {**spec.to_config(), "server-round": 1}
    whole = from_record(_ask(grid, "train", FIRST_NODE_ID, initial, **config).content["arrays"])
    generator = torch.Generator().manual_seed(0)
    noisy = {
        name: t + torch.randn(t.shape, generator=generator)
        for name, t in from_record(initial).items()
    }
    _ask(
        grid, "train", FIRST_NODE_ID, to_record(noisy), **config
    )  # the site's model now holds other values
    read = site_read_slices(CFG, spec)
    working = site_model._working_model(
        site_app.run_cohort(CFG).task, CFG.model, CFG.seed, None, False
    )
    with (
        torch.no_grad()
    ):  # and NaN wherever its subnetwork does not read (as a diverged round could leave)
        for name, p in working.named_parameters():
            if name not in read:
                p.fill_(float("nan"))
            elif read[name].dim is not None:
                p[~read[name].mask(p.shape)] = float("nan")
    download = extract(from_record(initial), read)
    part = from_record(
        _ask(grid, "train", FIRST_NODE_ID, to_record(download), **config).content["arrays"]
    )
    assert sorted(part) == sorted(whole) and len(whole) > 0
    for name, delta in whole.items():
        torch.testing.assert_close(part[name], delta, rtol=0, atol=0)
    downloaded, everything = (
        sum(t.numel() for t in download.values()),
        sum(math.prod(a.shape) for a in initial.values()),
    )
    assert (
        downloaded == everything if spec.freeze_heads else downloaded < everything
    )  # frozen heads run: read whole
    assert (
        any(".layer.0." in name for name in read) != spec.bypass
    )  # a bypassed layer is not even downloaded


def test_a_site_refuses_a_download_that_lacks_what_its_subnetwork_reads():
    grid = InProcessGrid(site_app.client_app, CFG.sites, CFG.to_flower())
    initial = from_record(server_app.request_initial_arrays(grid, CFG))
    spec = SubnetSpec(layers=(1,), heads=((0, 2),), bypass=True)
    download = extract(initial, site_read_slices(CFG, spec))
    missing = next(name for name in download if ".layer.1." in name)
    del download[missing]
    content = RecordDict(
        {
            "arrays": to_record(download),
            "config": ConfigRecord({**CFG.to_flower(), **spec.to_config()}),
        }
    )
    [reply] = grid.send_and_receive(
        [Message(content, dst_node_id=FIRST_NODE_ID, message_type="train")]
    )
    assert reply.has_error() and missing in reply.error.reason


def test_hydra_sends_each_site_only_what_its_hydra_net_reads():
    cfg = CFG.replace(
        hydra_bypass=True, hydra_head_mode="drop"
    )  # dropped heads are not sent either
    grid = _RecordingGrid(site_app.client_app, cfg.sites, cfg.to_flower())
    initial = server_app.request_initial_arrays(grid, cfg)
    result = server_app.run_federation(grid, cfg, strategy=build_strategy(cfg))
    specs = grid.specs(1)
    assert grid.specs(2) == specs  # scored once: the same Hydra-nets in every round
    expected = {}
    for node, spec in specs.items():
        assert spec.bypass
        read = site_read_slices(CFG, spec)
        shapes = {
            name: sl.taken_shape(a.shape) for name, a in initial.items() if (sl := read.get(name))
        }
        expected[str(node)] = record_nbytes(
            to_record({name: torch.zeros(shape) for name, shape in shapes.items()})
        )
    for server_round in (1, 2):  # what the train messages carry
        messages = grid.train_messages(server_round)
        assert {
            str(m.metadata.dst_node_id): record_nbytes(m.content["arrays"]) for m in messages
        } == expected
    # round 1's download holds the planning query too: the whole model, to every site
    query = record_nbytes(initial)
    assert result.history[1]["bytes_down_per_site"] == {
        node: query + n for node, n in expected.items()
    }
    for record in result.history[2:]:
        assert record["bytes_down_per_site"] == expected
    down = {TIER_OF_NODE[int(node)]: n for node, n in expected.items()}
    assert (
        down["small"] < down["medium"] < down["large"] == record_nbytes(initial)
    )  # large: the whole model


@pytest.mark.parametrize(
    "task", ["clinical-text", "clinical-notes-lm"]
)  # BERT (q/k/v/o) and Llama (GQA) layouts
def test_hydra_over_lora_steps_the_products_of_trained_layers_and_keeps_the_rest(task):
    cfg = CFG.replace(
        task=task, lora_rank=4, site_tiers="small,small,small", rounds=1
    )  # one layer of two
    grid = _RecordingGrid(site_app.client_app, cfg.sites, cfg.to_flower())
    initial = from_record(server_app.request_initial_arrays(grid, cfg))
    final = from_record(server_app.run_federation(grid, cfg, strategy=build_strategy(cfg)).arrays)

    trained_layers = {layer for spec in grid.specs(1).values() for layer in spec.layers}
    layout = reply_layout(grid.scores()[0])
    pairs = lora_pairs(initial)
    untrained = [pair for pair in pairs if layout[pair.a][0] not in trained_layers]
    assert untrained and len(untrained) < len(pairs)
    for pair in pairs:
        if pair in untrained:  # factors bit for bit
            assert torch.equal(final[pair.a], initial[pair.a]) and torch.equal(
                final[pair.b], initial[pair.b]
            )
        else:  # the averaged product, factored back to rank 4: B = U S, A = V^T
            assert not torch.allclose(
                final[pair.b] @ final[pair.a], initial[pair.b] @ initial[pair.a]
            )
            torch.testing.assert_close(
                final[pair.a] @ final[pair.a].T, torch.eye(4), atol=1e-5, rtol=0
            )


def test_hydra_with_frozen_heads_trains_the_same_slices_and_sends_the_frozen_heads_down():
    runs = {}
    for name in ("drop", "freeze"):
        cfg = CFG.replace(hydra_head_mode=name, rounds=1)
        grid = _RecordingGrid(site_app.client_app, cfg.sites, cfg.to_flower())
        history = server_app.run_federation(grid, cfg, strategy=build_strategy(cfg)).history
        runs[name] = (grid.specs(1), history[1])
    (drop, drop_round), (freeze, freeze_round) = runs["drop"], runs["freeze"]
    assert all(spec.freeze_heads for spec in freeze.values()) and not any(
        spec.freeze_heads for spec in drop.values()
    )
    assert {n: s.layers for n, s in freeze.items()} == {n: s.layers for n, s in drop.items()}
    assert (
        freeze_round["bytes_up_per_site"] == drop_round["bytes_up_per_site"]
    )  # the same trained slices
    small = str(next(node for node, tier in TIER_OF_NODE.items() if tier == "small"))
    assert freeze_round["bytes_down_per_site"][small] > drop_round["bytes_down_per_site"][small]


@pytest.mark.parametrize(
    ("rescore_every", "scoring_rounds"),
    [
        pytest.param(0, 1, marks=pytest.mark.slow),
        (2, 2),
        pytest.param(1, 3, marks=pytest.mark.slow),
    ],
)
def test_rescore_every_asks_the_sites_for_scores_again(rescore_every, scoring_rounds):
    cfg = CFG.replace(rounds=3, local_steps=1, rescore_every=rescore_every)
    grid = _RecordingGrid(site_app.client_app, cfg.sites, cfg.to_flower())
    server_app.run_federation(grid, cfg, strategy=build_strategy(cfg))
    assert grid.count("query.scores") == scoring_rounds * cfg.sites  # rounds 1, 1+N, 1+2N, ... of 3


@pytest.mark.parametrize(
    ("layer_score", "head_score"), [("fisher", "taylor"), ("taylor", "confidence")]
)
def test_a_site_scores_with_the_runs_methods_on_its_first_training_samples(layer_score, head_score):
    cfg = CFG.replace(
        layer_score=layer_score, head_score=head_score, score_samples=20, batch_size=8
    )
    grid = InProcessGrid(site_app.client_app, cfg.sites, cfg.to_flower())
    initial = server_app.request_initial_arrays(grid, cfg)
    [reply] = grid.send_and_receive([_query(cfg, grid, FIRST_NODE_ID, initial)])
    metrics = reply.content["metrics"]
    cohort = site_app.run_cohort(cfg)
    split = cohort.sites[0]
    model = build_model(cohort.task, seed=cfg.seed)
    model.load_state_dict(from_record(initial), strict=False)
    batches = [
        (split.train_x[i : min(i + 8, 20)], split.train_y[i : min(i + 8, 20)]) for i in (0, 8, 16)
    ]
    layers = layer_importance(model, batches, task_loss(cohort.task), method=layer_score)
    heads = head_importance(model, batches, task_loss(cohort.task), method=head_score)
    assert [metrics[f"layer-{layer}"] for layer in range(len(layers))] == pytest.approx(
        layers, rel=1e-5
    )
    for layer, row in enumerate(heads):
        assert [metrics[f"head-{layer}-{g}"] for g in range(len(row))] == pytest.approx(
            row, rel=1e-5
        )


def test_a_site_that_declares_itself_slow_sits_out_a_deadline_a_fast_site_meets_with_every_layer():
    declared = CFG.replace(site_tiers="", site_speeds="0.02,1,1", round_timeout_s=3600.0)
    grid = InProcessGrid(site_app.client_app, declared.sites, declared.to_flower())  # once per run
    initial = server_app.request_initial_arrays(grid, declared)

    def cost(node: int) -> LayerCost:
        metrics = _ask(grid, "query.scores", node, initial).content["metrics"]
        return LayerCost(
            **{field: float(metrics[f"cost.{field.replace('_', '-')}"]) for field in COST_FIELDS}
        )

    slow, fast = cost(FIRST_NODE_ID), cost(FIRST_NODE_ID + 1)

    def whole_net_s(
        cost: LayerCost,
    ) -> float:  # the measured total; its split into fixed and per layer is noisy
        return cost.fixed_s + 2 * cost.per_layer_s

    assert whole_net_s(slow) > 10 * whole_net_s(fast)  # declared 50x slower
    assert slow.fixed_bytes == pytest.approx(fast.fixed_bytes, rel=0.2)  # speed is time, not memory
    steps = CFG.local_steps
    deadline = 1.5 * steps * whole_net_s(fast)  # every layer and head, with 50% to spare

    def plan(cost: LayerCost):
        return plan_budget(
            cost,
            num_layers=2,
            num_groups=4,
            memory_bytes=math.inf,
            speed=1.0,
            deadline_s=deadline,
            local_steps=steps,
        )

    assert (plan(fast).layers, plan(fast).heads) == (2, 4)
    with pytest.raises(ValueError, match="no Hydra-net fits"):
        plan(slow)


@pytest.mark.slow
def test_hydra_and_heterofl_size_tiered_nets_on_the_chest_xray_vit(tmp_path):
    run = CFG.replace(task="chest-xray", rounds=1, local_steps=1)
    results = compare_strategies(
        SimulationConfig(run=run, strategies=("hydra", "heterofl"), out=str(tmp_path)),
        show_progress=False,
    )
    for name in ("hydra", "heterofl"):
        record = results["strategies"][name]["rounds"][1]
        params = {
            TIER_OF_NODE[int(node)]: n for node, n in record["trainable_params_per_site"].items()
        }
        assert params["small"] < params["medium"] < params["large"]
        up = {TIER_OF_NODE[int(node)]: n for node, n in record["bytes_up_per_site"].items()}
        assert (
            up["small"] < up["large"]
            and math.isfinite(record["loss"])
            and 0 <= record["accuracy"] <= 1
        )
