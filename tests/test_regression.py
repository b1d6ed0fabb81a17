"""Fixed numbers: `hydrafl simulate` with the default strategies, and a tiered run of Hydra, the width baselines
and the LoRA baselines, at fixed seeds. A refactoring must leave every loss, accuracy and final weight as it was.

`python tests/test_regression.py` rewrites the baseline; do that only for a change meant to alter the numbers.
Round 1's bytes down of the tiered strategies include their planning round's queries (the driver counts every
exchange); every loss, accuracy and weight is as the strategies computed them before they were composed.

Float kernels differ between CPUs (vector widths, and so the order of sums), and training carries the difference
along: on two hosts of this machine kind, losses agreed to 5e-7 relative, a final array's sum to 9e-5 of its
norm and its squared norm to 2e-5 relative (a sum of weights near zero cancels, so its own relative error says
nothing). So losses and accuracies are held to 1e-5, an array's sum to 1e-3 of its norm and its squared norm
to 1e-4: far inside what any change to the arithmetic moves them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from hydrafl.config import RunConfig
from hydrafl.simulation.compare import compare_strategies
from hydrafl.simulation_config import SimulationConfig

BASELINE = Path(__file__).parent / "assets" / "regression.json"

DEFAULT_RUN = RunConfig(
    task="tabular", sites=3, samples_per_site=60, rounds=3, local_steps=3, batch_size=16, lr=3e-3
)
TIERED_RUN = RunConfig(
    task="tabular",
    sites=3,
    samples_per_site=60,
    rounds=2,
    local_steps=3,
    batch_size=16,
    lr=1e-2,
    site_tiers="small,medium,large",
    lora_rank=4,
)
TIERED_STRATEGIES = (
    "hydra",
    "heterofl",
    "fjord",
    "fedrolex",
    "fedit",
    "flora",
    "hetlora",
    "flexlora",
)
TIERED_KNOBS = {"score_samples": 16, "outer": "nesterov", "outer_lr": 0.7}
CASES = {
    "default": (DEFAULT_RUN, None, {}),
    "tiered": (TIERED_RUN, TIERED_STRATEGIES, TIERED_KNOBS),
}


def numbers(case: str, out: Path) -> dict[str, Any]:
    """Per strategy: each round's loss, accuracy, train loss and bytes, and per final array its sum and norm."""
    run, strategies, knobs = CASES[case]
    config = SimulationConfig(
        run=run, out=str(out), knobs=knobs, **({"strategies": strategies} if strategies else {})
    )
    results = compare_strategies(config, show_progress=False)
    from hydrafl.server.aggregation.checkpoint import load_checkpoint

    summary = {}
    for strategy, result in results["strategies"].items():
        arrays = load_checkpoint(out / strategy).arrays
        summary[strategy] = {
            "rounds": [
                {
                    key: record[key]
                    for key in ("loss", "accuracy", "train_loss", "bytes_up", "bytes_down")
                }
                for record in result["rounds"]
            ],
            "arrays": {
                name: [
                    float(array.numpy().astype("float64").sum()),
                    float((array.numpy().astype("float64") ** 2).sum()),
                ]
                for name, array in arrays.items()
            },
        }
    return summary


def _close_array(expected: list[float], actual: list[float], where: str) -> None:
    """[sum, squared norm] of a final array."""
    (total, squares), (got_total, got_squares) = expected, actual
    norm = math.sqrt(squares)
    assert abs(got_total - total) <= 1e-3 * norm + 1e-9, (
        f"{where}: sum {got_total} != {total} (norm {norm:.4g})"
    )
    assert math.isclose(got_squares, squares, rel_tol=1e-4, abs_tol=1e-12), (
        f"{where}: {got_squares} != {squares}"
    )


def _close(expected: Any, actual: Any, where: str) -> None:
    if where.endswith(".arrays") and isinstance(expected, dict):
        assert set(actual) == set(expected), f"{where}: keys {sorted(actual)} != {sorted(expected)}"
        for key in expected:
            _close_array(expected[key], actual[key], f"{where}.{key}")
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), f"{where}: keys {sorted(actual)} != {sorted(expected)}"
        for key in expected:
            _close(expected[key], actual[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert len(actual) == len(expected), (
            f"{where}: {len(actual)} entries, expected {len(expected)}"
        )
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            _close(e, a, f"{where}[{i}]")
    elif isinstance(expected, float):
        assert math.isclose(actual, expected, rel_tol=1e-5, abs_tol=1e-7), (
            f"{where}: {actual} != {expected}"
        )
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_numbers_are_unchanged(case, tmp_path):
    expected = json.loads(BASELINE.read_text())[case]
    _close(expected, numbers(case, tmp_path), case)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        BASELINE.parent.mkdir(exist_ok=True)
        BASELINE.write_text(
            json.dumps({case: numbers(case, Path(tmp) / case) for case in CASES}, indent=1) + "\n"
        )
