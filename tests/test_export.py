"""A run's final model, exported, loads with transformers, PEFT or safetensors alone and gives the outputs
hydrafl's own model gives with the run's final arrays."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from hydrafl.config import RunConfig
from hydrafl.export import ExportError, export_model, final_model, run_task
from hydrafl.models import SmallCNN, TabularTransformer, build_model, federated_state

SEED = 3


def _trained_arrays(cfg: RunConfig) -> dict[str, torch.Tensor]:
    """Arrays unlike the seeded start: those of the same model built from another seed (a stand-in for
    training that changes every federated tensor)."""
    model = build_model(run_task(cfg), model=cfg.model, seed=cfg.seed + 1)
    return {name: t.clone() for name, t in federated_state(model).items()}


def _lora_arrays(cfg: RunConfig) -> dict[str, torch.Tensor]:
    """The federated LoRA factors and head, each moved off its start (B starts at zero)."""
    from hydrafl.backbones import LoraSpec

    lora = LoraSpec(rank=cfg.lora_rank, alpha=cfg.lora_alpha)
    model = build_model(run_task(cfg), model=cfg.model, seed=cfg.seed, lora=lora)
    generator = torch.Generator().manual_seed(7)
    return {
        name: t + 0.05 * torch.randn(t.shape, generator=generator)
        for name, t in federated_state(model).items()
    }


@pytest.mark.parametrize(
    ("task", "model", "auto"),
    [
        ("clinical-text", "tiny", "AutoModelForSequenceClassification"),
        ("chest-xray", "vit", "AutoModelForImageClassification"),
    ],
)
def test_a_transformer_classifier_loads_with_transformers_alone(tmp_path, task, model, auto):
    import transformers

    cfg = RunConfig(task=task, model=model, seed=SEED)
    arrays = _trained_arrays(cfg)
    hydrafl_model = final_model(cfg, arrays, run_task(cfg))
    exported = export_model(hydrafl_model, cfg, tmp_path / "model")
    assert exported.kind == "transformers"
    assert {"config.json", "model.safetensors"} <= {p.name for p in exported.path.iterdir()}
    loaded = getattr(transformers, auto).from_pretrained(exported.path).eval()
    x = _batch(cfg)
    with torch.no_grad():
        expected = hydrafl_model(x)
        inputs = (
            {"input_ids": x, "attention_mask": (x != 0).long()}
            if task == "clinical-text"
            else {"pixel_values": x}
        )
        got = loaded(**inputs).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    seeded = build_model(run_task(cfg), model=model, seed=SEED)
    assert (
        float((seeded(x) - expected).abs().max()) > 1e-3
    )  # the final arrays, not the seeded start


def test_a_lora_run_loads_as_a_peft_adapter_on_its_base(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    cfg = RunConfig(task="clinical-text", lora_rank=4, seed=SEED)
    hydrafl_model = final_model(cfg, _lora_arrays(cfg), run_task(cfg))
    exported = export_model(hydrafl_model, cfg, tmp_path / "model")
    assert exported.kind == "peft"
    adapter = exported.path / "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in adapter.iterdir()
    }
    base = AutoModelForSequenceClassification.from_pretrained(exported.path / "base")
    loaded = PeftModel.from_pretrained(base, adapter).eval()
    x = _batch(cfg)
    with torch.no_grad():
        got = loaded(input_ids=x, attention_mask=(x != 0).long()).logits
        torch.testing.assert_close(got, hydrafl_model(x), rtol=0, atol=1e-6)


def test_the_next_token_lm_loads_as_a_causal_lm(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = RunConfig(task="clinical-notes-lm", seed=SEED)
    arrays = _trained_arrays(cfg)
    hydrafl_model = final_model(cfg, arrays, run_task(cfg))
    exported = export_model(hydrafl_model, cfg, tmp_path / "model")
    loaded = AutoModelForCausalLM.from_pretrained(exported.path).eval()
    x = _batch(cfg)[:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=x).logits, hydrafl_model.net(input_ids=x).logits, rtol=0, atol=1e-6
        )


@pytest.mark.parametrize(("task", "model"), [("tabular", "tiny"), ("chest-xray", "cnn")])
def test_hydrafls_small_models_load_with_safetensors_and_their_architecture(tmp_path, task, model):
    cfg = RunConfig(task=task, model=model, seed=SEED)
    hydrafl_model = final_model(cfg, _trained_arrays(cfg), run_task(cfg))
    exported = export_model(hydrafl_model, cfg, tmp_path / "model")
    assert exported.kind == "safetensors"
    architecture = json.loads((exported.path / "architecture.json").read_text())
    weights = load_file(exported.path / "model.safetensors")
    arguments = {k: v for k, v in architecture.items() if k != "class"}
    if architecture["class"] == "hydrafl.models.SmallCNN":
        rebuilt = SmallCNN(arguments.pop("channels"), arguments.pop("num_classes"), **arguments)
    else:
        from hydrafl.backbones import TinyShape

        shape = TinyShape(**arguments["shape"])
        rebuilt = TabularTransformer(arguments["num_features"], arguments["num_classes"], shape)
    rebuilt.load_state_dict(weights)
    x = _batch(cfg)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt.eval()(x), hydrafl_model(x), rtol=0, atol=1e-6)


def test_arrays_of_another_model_are_refused_with_the_fix(tmp_path):
    cfg = RunConfig(task="clinical-text", seed=SEED)
    arrays = _trained_arrays(RunConfig(task="tabular", seed=SEED))
    with pytest.raises(ExportError, match="pass a sample of their data"):
        final_model(cfg, arrays, run_task(cfg))


@pytest.mark.slow
def test_simulate_export_and_admin_run_export_write_the_runs_final_model(tmp_path):
    """The two commands README shows, on a real one-round simulation: both write the same model, whose
    outputs are those of hydrafl's model holding the run's final checkpoint."""
    from transformers import AutoModelForSequenceClassification

    from hydrafl.arrays import from_record
    from hydrafl.server.aggregation.checkpoint import load_checkpoint

    out = tmp_path / "sim"
    argv = [*HYDRAFL, "simulate", "--strategies", "fedavg", "--rounds", "1", "--sites", "2"]
    argv += ["--samples-per-site", "32", "--local-steps", "2", "--out", str(out), "--export"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "transformers model in" in done.stdout
    checkpoint = load_checkpoint(out / "fedavg")
    cfg = RunConfig.from_flower(checkpoint.run_config)
    reference = final_model(cfg, from_record(checkpoint.arrays), run_task(cfg))
    x = _batch(cfg)
    for folder in (out / "fedavg" / "model", tmp_path / "admin"):
        if folder.name == "admin":  # the coordinator's command on the same run folder
            db, run_id = _database_with_runs(tmp_path, 1)
            runs = tmp_path / "runs"
            runs.mkdir()
            (runs / str(run_id)).symlink_to(out / "fedavg")
            admin = [*HYDRAFL, "admin", "run", "export", str(run_id), str(folder), "--db", db]
            done = subprocess.run(
                [*admin, "--runs", str(runs)], capture_output=True, text=True, timeout=300
            )
            assert done.returncode == 0, done.stderr[-2000:]
        loaded = AutoModelForSequenceClassification.from_pretrained(folder).eval()
        with torch.no_grad():
            got = loaded(input_ids=x, attention_mask=(x != 0).long()).logits
            torch.testing.assert_close(got, reference(x), rtol=0, atol=1e-6)


def test_admin_run_export_of_a_run_without_a_checkpoint_fails_in_one_line(tmp_path):
    db, _ = _database_with_runs(tmp_path, 3)
    (tmp_path / "runs" / "3").mkdir(parents=True)
    argv = [*HYDRAFL, "admin", "run", "export", "3", str(tmp_path / "out"), "--db", db]
    done = subprocess.run([*argv, "--runs", str(tmp_path / "runs")], capture_output=True, text=True)
    assert done.returncode == 2
    assert "run 3:" in done.stderr and "holds no checkpoint" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


HYDRAFL = [sys.executable, "-m", "hydrafl"]


def _database_with_runs(tmp_path, count: int) -> tuple[str, int]:
    """A coordinator database that knows `count` runs (an export is of a run the coordinator knows): its URL
    and the last run's id."""
    from hydrafl.server.store import Store

    db = f"sqlite:///{tmp_path / 'c.db'}"
    store = Store(db)
    return db, [store.create_run({"strategy": "fedavg"}) for _ in range(count)][-1].id


def _batch(cfg: RunConfig) -> torch.Tensor:
    from hydrafl.data import load_cohort

    cohort = load_cohort(cfg.task, num_sites=1, seed=cfg.seed, samples_per_site=16)
    return cohort.sites[0].train_x[:4]
