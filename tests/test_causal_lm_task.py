"""The causal-LM next-token task: chunked loss == full-logits loss, distillation, token accuracy, LoRA, Hydra,
and a short federated run on it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, Message, RecordDict
from helpers import SMALL_RUN, TIERED_RUN

from hydrafl.backbones import TinyShape, build_causal_lm
from hydrafl.causal_lm import CausalLM, DistillationError
from hydrafl.client import site_app
from hydrafl.client.training import evaluate, train_site
from hydrafl.config import ConfigError, RunConfig
from hydrafl.data import DataError, load_cohort
from hydrafl.data.notes_lm_cohort import IGNORE_INDEX
from hydrafl.kernels.local_training import LocalTraining
from hydrafl.models import LoraSpec, build_model, federated_state, task_loss, training_loss
from hydrafl.server import server_app
from hydrafl.simulation.compare import compare_strategies
from hydrafl.simulation.grid import FIRST_NODE_ID, InProcessGrid
from hydrafl.simulation_config import SimulationConfig, build_simulation_config
from hydrafl.subnet.scoring import head_importance, layer_importance

TASK = "clinical-notes-lm"


@pytest.fixture(scope="module")
def cohort():
    return load_cohort(TASK, num_sites=2, samples_per_site=40)


@pytest.fixture(scope="module")
def batch(cohort):
    split = cohort.sites[0]
    return split.train_x[:12], split.train_y[:12]


def _full_logits(model: CausalLM, x: torch.Tensor) -> torch.Tensor:
    return model.hidden_states(x) @ model.head_weight.T  # [B, T, V]


def _small_blocks(model: CausalLM) -> CausalLM:
    """The same weights with blocks smaller than the batch and the vocabulary, so several windows and chunks run."""
    return CausalLM(model.net, chunk_size=300, window_size=100)


def test_cohort_targets_are_the_next_tokens_with_padding_ignored(cohort):
    task, split = cohort.task, cohort.sites[0]
    assert task.objective == "next-token" and task.vocab_size == 2048
    assert split.train_x.shape == split.train_y.shape == (32, task.seq_len)
    x, y = split.train_x, split.train_y
    shifted = x[:, 1:]
    real = shifted != 0
    assert torch.equal(y[:, :-1][real], shifted[real]) and bool(
        (y[:, :-1][~real] == IGNORE_INDEX).all()
    )
    # per-site vocabulary shift: the sites' token distributions differ
    counts = [
        torch.bincount(s.train_x.flatten(), minlength=task.vocab_size).float() for s in cohort.sites
    ]
    tv = 0.5 * (counts[0] / counts[0].sum() - counts[1] / counts[1].sum()).abs().sum()
    assert tv > 0.2
    with pytest.raises(DataError, match="natural .* or iid"):
        load_cohort(TASK, num_sites=2, samples_per_site=40, partition="dirichlet:0.5")


def test_training_loss_and_gradient_equal_full_logits_cross_entropy(cohort, batch):
    x, y = batch
    model = _small_blocks(build_model(cohort.task, seed=1)).train()
    loss = task_loss(cohort.task)(model, x, y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    logits = _full_logits(model, x)
    reference = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
    expected = torch.autograd.grad(reference, list(model.parameters()))
    assert abs(loss.item() - reference.item()) <= 1e-5
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)


def test_distillation_loss_equals_cross_entropy_plus_weighted_kl(cohort, batch, tmp_path):
    """A teacher from a local checkpoint with another hidden size; its signal is hidden states + LM head."""
    x, y = batch
    teacher_dir = tmp_path / "teacher"
    narrow = TinyShape(hidden=32, heads=2, kv_heads=1)
    build_causal_lm(cohort.task.vocab_size, shape=narrow, seed=7).save_pretrained(teacher_dir)
    loss_fn = training_loss(cohort.task, distill_teacher=str(teacher_dir), distill_weight=0.3)
    student = build_model(cohort.task, seed=1).train()
    loss = loss_fn(student, x, y)
    grads = torch.autograd.grad(loss, list(student.parameters()))

    teacher = CausalLM(build_causal_lm(cohort.task.vocab_size, shape=narrow, seed=7))
    valid = y.flatten() != IGNORE_INDEX
    s = _full_logits(student, x).flatten(0, 1)[valid]
    with torch.no_grad():
        t = _full_logits(teacher, x).flatten(0, 1)[valid]
    kl = (
        F.kl_div(s.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="none")
        .sum(-1)
        .mean()
    )
    reference = F.cross_entropy(s, y.flatten()[valid]) + 0.3 * kl
    expected = torch.autograd.grad(reference, list(student.parameters()))
    assert kl.item() > 1e-3  # a real teacher signal, not a zero KL
    assert abs(loss.item() - reference.item()) <= 1e-5
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)
    # the seeded initial model as teacher: KL is 0 at the start, so the loss is the plain cross-entropy
    init = training_loss(cohort.task, seed=1, distill_teacher="init", distill_weight=0.3)
    assert init(student, x, y).item() == pytest.approx(
        task_loss(cohort.task)(student, x, y).item(), abs=1e-6
    )


def test_distillation_errors_are_clear(cohort, tmp_path):
    other = tmp_path / "other-vocab"
    build_causal_lm(1000, seed=0).save_pretrained(other)
    with pytest.raises(DistillationError, match="vocabulary of 1000 entries, the student 2048"):
        training_loss(cohort.task, distill_teacher=str(other), distill_weight=0.5)
    with pytest.raises(DistillationError, match="neither 'init' nor a local checkpoint"):
        training_loss(cohort.task, distill_teacher=str(tmp_path / "missing"), distill_weight=0.5)
    with pytest.raises(ConfigError, match="distill-teacher"):
        RunConfig(task="clinical-text", distill_teacher="init")
    with pytest.raises(ConfigError, match="distill-weight"):
        build_simulation_config({"task": TASK, "distill-weight": -1.0})


def test_chunked_token_accuracy_equals_full_argmax(cohort):
    split = cohort.sites[1]
    model = _small_blocks(build_model(cohort.task, seed=2))
    with torch.no_grad():  # a few steps so the predictions are not all one token
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(5):
            with torch.enable_grad():
                optimizer.zero_grad()
                task_loss(cohort.task)(model.train(), split.train_x, split.train_y).backward()
                optimizer.step()
    loss, accuracy = evaluate(model, split.test_x, split.test_y, batch_size=3)
    with torch.no_grad():
        logits = _full_logits(model.eval(), split.test_x).flatten(0, 1)
    target = split.test_y.flatten()
    valid = target != IGNORE_INDEX
    assert accuracy == int((logits.argmax(-1) == target)[valid].sum()) / int(valid.sum())
    assert loss == pytest.approx(
        F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX).item(), abs=1e-5
    )
    assert 0.0 < accuracy < 1.0


def test_lora_federates_exactly_the_lora_tensors_and_trains(cohort):
    model = build_model(cohort.task, seed=0, lora=LoraSpec(rank=4))
    names = list(federated_state(model))
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert (
        len(names) == 2 * 4 * 2
    )  # A and B of q/k/v/o in each of the 2 layers; the LM head stays frozen
    split = cohort.sites[0]
    start = {n: t.clone() for n, t in federated_state(model).items()}
    config = LocalTraining(steps=4, batch_size=8, lr=1e-2)
    loss_fn = task_loss(cohort.task)
    result = train_site(
        model, start, split.train_x, split.train_y, config, device="cpu", loss_fn=loss_fn
    )
    assert set(result.end_state) == set(start)
    assert all(not torch.equal(result.end_state[n], start[n]) for n in names if ".lora_B." in n)


def test_pretrained_local_checkpoint_is_the_student(cohort, tmp_path, batch):
    build_causal_lm(cohort.task.vocab_size, seed=3).save_pretrained(tmp_path / "ckpt")
    model = build_model(cohort.task, model=str(tmp_path / "ckpt"), lora=LoraSpec(rank=2))
    reference = CausalLM(build_causal_lm(cohort.task.vocab_size, seed=3))
    x, y = batch
    assert task_loss(cohort.task)(model, x, y).item() == pytest.approx(
        task_loss(cohort.task)(reference, x, y).item(), abs=1e-6
    )
    with pytest.raises(ValueError, match="'minilm' cannot run next-token task"):
        build_model(cohort.task, model="minilm")


def test_hydra_scores_use_the_task_loss(cohort, batch):
    model = build_model(cohort.task, seed=0)
    loss = task_loss(cohort.task)
    layers = layer_importance(model, [batch], loss, method="fisher", max_samples=4)
    heads = head_importance(model, [batch], loss, method="taylor")
    assert len(layers) == 2 and all(s > 0 for s in layers)
    assert len(heads) == 2 and all(len(row) == 2 and all(s > 0 for s in row) for row in heads)


def test_site_trains_with_distillation_and_reports_the_lm_footprint():
    cfg = SMALL_RUN.replace(
        task=TASK,
        sites=2,
        samples_per_site=30,
        rounds=15,
        local_steps=2,
        batch_size=8,
        lr=2e-3,
        distill_teacher="init",
        lora_rank=2,
    )
    grid = InProcessGrid(site_app.client_app, cfg.sites, cfg.to_flower())
    initial = server_app.request_initial_arrays(grid, cfg)
    assert sorted(initial) == sorted(
        federated_state(build_model(site_app.run_cohort(cfg).task, lora=LoraSpec(rank=2)))
    )
    content = RecordDict(
        {"arrays": initial, "config": ConfigRecord({**cfg.to_flower(), "server-round": 1})}
    )
    [reply] = grid.send_and_receive(
        [Message(content, dst_node_id=FIRST_NODE_ID, message_type="train")]
    )
    assert not reply.has_error(), reply.error.reason
    metrics = reply.content["metrics"]
    assert metrics["peak-memory-bytes"] > 0 and 0 < metrics["train_loss"] < 8.0
    assert sorted(reply.content["arrays"]) == sorted(initial)


@pytest.mark.slow
def test_two_rounds_of_fedavg_and_hydra_lower_the_next_token_loss(tmp_path):
    run = TIERED_RUN.replace(task=TASK, local_steps=6)
    config = SimulationConfig(run=run, strategies=("fedavg", "hydra"), out=str(tmp_path))
    compare_strategies(config, show_progress=False)
    results = json.loads((tmp_path / "results.json").read_text())
    for name in ("fedavg", "hydra"):
        rounds = results["strategies"][name]["rounds"]
        losses = [r["loss"] for r in rounds]
        assert losses[0] == pytest.approx(7.65, abs=0.05)  # ~ log(2048) = 7.62 from the random init
        assert losses[2] < losses[1] < losses[0] - 0.5, (name, losses)
        assert rounds[2]["accuracy"] > rounds[0]["accuracy"] + 0.05
    hydra = results["strategies"]["hydra"]["rounds"][2]["bytes_up_per_site"]
    fedavg = results["strategies"]["fedavg"]["rounds"][2]["bytes_up_per_site"]
    assert min(hydra.values()) < max(fedavg.values())  # the small site sends less than a full model


@pytest.mark.slow
def test_two_process_ddp_delta_equals_one_process(cohort):
    """Ranks hold different numbers of padded positions; the global-count normaliser keeps the mean exact."""
    from functools import partial

    from hydrafl.client.training import build_site_model

    split = cohort.sites[0]
    model = build_model(cohort.task, seed=0)
    start = {n: t.clone() for n, t in federated_state(model).items()}
    rebuild = partial(build_site_model, cohort.task, "tiny", 0, None)
    results = {}
    for nproc in (1, 2):
        config = LocalTraining(steps=3, batch_size=8, lr=0.5, optimizer="sgd", nproc=nproc)
        results[nproc] = train_site(
            build_model(cohort.task, seed=0),
            start,
            split.train_x,
            split.train_y,
            config,
            rebuild=rebuild,
            device="cpu",
            loss_fn=task_loss(cohort.task),
        )
    assert results[1].loss == pytest.approx(results[2].loss, abs=1e-5)
    for name, begin in start.items():
        one, two = (results[n].end_state[name] - begin for n in (1, 2))
        assert one.abs().max() > 1e-4
        torch.testing.assert_close(two, one, atol=1e-6, rtol=1e-4)
