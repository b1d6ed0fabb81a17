"""Configuration is validated once, at the edge, with errors that name the key and the valid choices."""

from __future__ import annotations

import pytest

from hydrafl.config import ConfigError, RunConfig
from hydrafl.configfile import load_toml
from hydrafl.simulation_config import build_simulation_config


def test_flags_and_toml_keys_build_one_frozen_config(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        'local-steps = 7\nlr = 1\nstrategies = ["fedavg", "krum"]\npartition = "dirichlet:0.3"\n'
    )
    config = build_simulation_config({**load_toml(path), "seed": 3}, source=str(path))
    assert config.run.local_steps == 7 and config.run.lr == 1.0 and config.run.seed == 3
    assert config.strategies == ("fedavg", "krum")
    run = config.run_config("krum")
    assert run.strategy == "krum" and run.run_dir.endswith("krum")
    assert RunConfig.from_flower(run.to_flower()) == run


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"roundz": 3}, "unknown key 'roundz'"),
        ({"rounds": "3"}, "key 'rounds' in options must be int"),
        ({"rounds": 0}, "invalid --rounds=0"),
        ({"inner-optimizer": "lion"}, "adamw, sgd, muon"),
        ({"backend": "spark"}, "inprocess, ray"),
        ({"sites": 2, "min-sites": 3}, "invalid --min-sites=3"),
        ({"outer-momentum": 1.0}, "outer-momentum"),
        ({"strategies": "fedavg,fedavg"}, "no repeats"),
        (
            {"hydra-lora": "stacked", "strategies": "hydra"},
            "invalid --hydra-lora='stacked'.*products, factors",
        ),
        (
            {"hydra-lora": "products"},
            "unknown key 'hydra-lora' in options; it is a knob of hydra, not of fedavg",
        ),
        (
            {"outer-lr": 0.5, "strategies": "fedavg,fedprox"},
            "it is a knob of diloco, fedbuff, hydra, fedbuff-hydra, not of fedavg, fedprox",
        ),
        (
            {"strategies": "fedavg,fedsgdx"},
            "--strategies: unknown strategy 'fedsgdx'; choose one of .*fedprox.*fedavg",
        ),
        (
            {"inner-optimizer": "lm-dual", "task": "clinical-notes-lm"},
            "a classification task, nproc 1",
        ),
        ({"inner-optimizer": "lm-dual", "nproc": 2}, "a classification task, nproc 1"),
        (
            {"stream-layers": True, "nproc": 2, "batch-size": 32},
            "--stream-layers=True: expected false",
        ),
        ({"stream-layers": True, "model": "cnn", "task": "chest-xray"}, "the CNN has none"),
        ({"window": 0}, "--window=0: expected an integer >= 1"),
        ({"inner-optimizer": "lm-dual", "strategies": "fedavg,fedprox"}, "without a proximal term"),
    ],
)
def test_invalid_values_name_the_key(values, message):
    with pytest.raises(ConfigError, match=message):
        build_simulation_config(values)


def test_toml_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_toml(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("rounds = = 3")
    with pytest.raises(ConfigError, match="broken.toml"):
        load_toml(broken)
    nested = tmp_path / "nested.toml"
    nested.write_text("[train]\nlr = 1\n")
    with pytest.raises(ConfigError, match="'train'"):
        load_toml(nested)


def test_unknown_strategy_lists_the_registry():
    from hydrafl.strategies import strategy_names

    with pytest.raises(ConfigError, match="choose one of .*fedprox.*fedavg, fedavgm"):
        RunConfig(strategy="fedsgdx")
    assert {
        "fedavg",
        "fedprox",
        "fedavgm",
        "fedadam",
        "fedyogi",
        "fedadagrad",
        "fedmedian",
        "fedtrimmedavg",
        "krum",
        "diloco",
    } <= set(strategy_names())


def test_the_small_cnn_refuses_what_slices_or_adapts_transformer_layers_before_any_run():
    """On an image folder `tiny` is the small CNN: the Hydra-net strategies and the LoRA baselines (and LoRA at
    all) need the tiny ViT, and say so by name; every other strategy runs on the CNN. Nothing opens the folder."""
    from hydrafl.strategies.registry import config_class, strategy_names

    for strategy in strategy_names():
        options = config_class(strategy)
        values = {
            "data": "scans",
            "strategy": strategy,
            "lora_rank": 4 if options.federates_lora else 0,
        }
        if options.slices_transformer:
            with pytest.raises(
                ConfigError, match=f"--model vit with strategy {strategy}: it slices or adapts"
            ):
                RunConfig.build(**values)
            assert RunConfig.build(**values, model="vit").model == "vit"
        else:
            assert RunConfig.build(**values).model == "tiny"
    with pytest.raises(ConfigError, match="--model vit with lora-rank 4"):
        RunConfig(data="scans", lora_rank=4)
    with pytest.raises(ConfigError, match="--model vit with strategy flora"):
        build_simulation_config({"data": "scans", "strategies": "fedavg,flora"})
    assert (
        RunConfig(task="chest-xray", strategy="hydra").model == "tiny"
    )  # the synthetic x-rays keep the ViT
    assert RunConfig(data="notes.csv", lora_rank=4).lora_rank == 4
    for values in ({"task": "tabular", "model": "vit"}, {"data": "notes.csv", "model": "cnn"}):
        with pytest.raises(ConfigError, match="vit and cnn need images"):
            RunConfig(**values)


@pytest.mark.parametrize("knob", [{"expert_select": "routed"}, {"hydra_experts": 0.5}])
def test_expert_selection_knobs_need_a_model_with_experts(knob):
    with pytest.raises(ConfigError, match="tiny has no experts to select"):
        RunConfig.build(strategy="hydra", task="clinical-notes-lm", model="tiny", **knob)
    moe = RunConfig.build(strategy="hydra", task="clinical-notes-lm", model="tiny-moe", **knob)
    assert moe.model == "tiny-moe"
    # a local checkpoint lives on the sites' machines: the coordinator cannot tell, and lets it through
    assert RunConfig.build(strategy="hydra", task="clinical-notes-lm", model="mixtral-ckpt", **knob)
