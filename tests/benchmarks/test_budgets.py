"""The budgets benchmark's bookkeeping by hand: processes that split the seeds, gathered into one results
file with Hydra's paired gap, and the memory limits it declares, exact to the byte."""

from __future__ import annotations

import json

import pytest

from hydrafl.benchmarks.budgets import limits_per_process, markdown, megabytes
from hydrafl.benchmarks.heterogeneous import write_results
from hydrafl.config import RunConfig

SCALE = {"sites": 3, "rounds": 3, "local_steps": 4, "seeds": 1}


def _run(seed: int, accuracy: float) -> dict:
    return {
        "seed": seed,
        "accuracy": accuracy,
        "bytes_per_round": 1e6,
        "params": {"small": 10, "medium": 20, "large": 30},
        "peak_memory": {"small": 300e6, "medium": 301e6, "large": 302e6},
    }


def test_processes_that_split_the_seeds_gather_into_one_file_with_the_paired_gap(tmp_path):
    group = "minilm-lora-memory"
    for seed, (hydra, flexlora) in enumerate([(0.70, 0.60), (0.80, 0.80)]):
        out = tmp_path / f"seed{seed}"
        out.mkdir()
        runs = {group: {"hydra": [_run(seed, hydra)], "flexlora": [_run(seed, flexlora)]}}
        write_results(
            out / "budgets.json", runs, {group: SCALE}, False, extra={"limits_per_process": []}
        )
    gathered = write_results(
        tmp_path / "budgets.json",
        {},
        {},
        False,
        (tmp_path / "seed0" / "budgets.json", tmp_path / "seed1" / "budgets.json"),
        {"limits_per_process": [{"lora_step_s": 1.5}]},
    )
    assert [r["seed"] for r in gathered["runs"][group]["hydra"]] == [0, 1]
    assert gathered["scales"][group]["seeds"] == 2
    # differences +10 and 0 points: mean 5, sd 7.071, standard error 7.071 / sqrt(2) = 5
    gap = gathered["paired"][f"{group}: hydra - flexlora"]
    assert (gap["seeds"], gap["mean_points"]) == (2, pytest.approx(5.0))
    assert gap["standard_error_points"] == pytest.approx(5.0)
    assert json.loads((tmp_path / "budgets.json").read_text()) == json.loads(json.dumps(gathered))
    table = markdown(gathered)
    assert "| hydra | 2 | 0.750 ± 0.071 | 1.00 | 10/20/30 | 300.0/301.0/302.0 |" in table
    assert '{"lora_step_s": 1.5}' in table
    assert "+5.00 ± 5.00 points" in table


@pytest.mark.parametrize("limit", [303_476_968, 306_426_088, 304_951_528])
def test_a_declared_memory_limit_reaches_the_site_exact_to_the_byte(limit):
    """What a rank-2 LoRA site needs must still fit it once written as --site-memory-mb."""
    declared = RunConfig(sites=3, site_memory_mb=megabytes(limit, 2 * limit, 0))
    assert [mb * 1e6 for mb in declared.memory_list] == [limit, 2 * limit, 0]


def test_a_hydra_variant_is_paired_with_hydra_and_is_never_the_baseline(tmp_path):
    """A variant run on its own, later, merges into the file that holds Hydra's seeds and is paired with it;
    the best baseline stays the best LoRA baseline even when the variant scores higher."""
    group = "minilm-lora-time"
    first = {
        group: {
            "hydra": [_run(0, 0.50), _run(1, 0.60)],
            "flexlora": [_run(0, 0.40), _run(1, 0.50)],
            "fedit": [_run(0, 0.55), _run(1, 0.45)],
        }
    }
    write_results(
        tmp_path / "budgets.json", first, {group: SCALE}, False, extra={"limits_per_process": []}
    )
    variant = {group: {"hydra-bypass": [_run(0, 0.90), _run(1, 0.65)]}}
    gathered = write_results(
        tmp_path / "budgets.json", variant, {group: SCALE}, False, extra={"limits_per_process": []}
    )
    assert set(gathered["runs"][group]) == {"hydra", "flexlora", "fedit", "hydra-bypass"}
    assert list(gathered["goals"]) == [f"{group}: hydra >= best baseline (flexlora)"]
    # differences +40 and +5 points: mean 22.5, sd 24.749, standard error 17.5
    gap = gathered["paired"][f"{group}: hydra-bypass - hydra"]
    assert (gap["seeds"], gap["mean_points"]) == (2, pytest.approx(22.5))
    assert gap["standard_error_points"] == pytest.approx(17.5)
    assert gathered["paired"][f"{group}: hydra - flexlora"]["mean_points"] == pytest.approx(10.0)
    table = markdown(
        gathered
    )  # at a limit every method is a baseline: FedIT too, -5 and +15 points
    assert f"- {group}: hydra - fedit, paired over 2 seeds: +5.00 ± 10.00 points" in table
    assert table.count(f"{group}: hydra - flexlora") == 1


def test_the_limits_of_every_process_are_kept_once_each(tmp_path):
    """Processes measure the same memory limits but their own deadline: each distinct record stays, and a
    results file written before the list existed still gives its one."""
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps({"limits": {"deadline_s": 11.5}}))
    new.write_text(json.dumps({"limits_per_process": [{"deadline_s": 11.5}, {"deadline_s": 20.3}]}))
    assert limits_per_process({"deadline_s": 9.9}, (old, new, tmp_path / "absent.json")) == [
        {"deadline_s": 9.9},
        {"deadline_s": 11.5},
        {"deadline_s": 20.3},
    ]
    assert limits_per_process({}, ()) == []
