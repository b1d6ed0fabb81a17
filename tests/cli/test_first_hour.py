"""What a new user meets first: `simulate --help` lists every strategy and every key with its default, the
key tables keep their text (no markup eaten), `hydrafl --version` answers, and configuration errors name the
flag to fix, in one line, before any work."""

from __future__ import annotations

from importlib.metadata import version

from typer.testing import CliRunner

from hydrafl.cli import app
from hydrafl.config import RunConfig
from hydrafl.strategies.registry import strategy_names

WIDE = {"COLUMNS": "200"}


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_simulate_help_lists_every_strategy_and_each_key_with_its_default():
    shown = _flat(CliRunner().invoke(app, ["simulate", "--help"], env=WIDE).output)
    assert all(name in shown for name in strategy_names())
    assert f"--rounds (default {RunConfig().rounds!r})" in shown
    assert f"--task (default {RunConfig().task!r})" in shown
    assert (
        "--backend (default 'inprocess'): inprocess (default) or ray (needs hydrafl[ray])." in shown
    )
    assert (
        "--lora-targets (default ''): Comma-separated module-name suffixes LoRA adapts (e.g. query,value)"
        in shown
    )


def test_the_keys_table_keeps_square_brackets():
    shown = _flat(CliRunner().invoke(app, ["keys"], env=WIDE).output)
    assert "ray (needs hydrafl[ray])" in shown and "needs hydrafl)" not in shown


def test_version():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output == f"hydrafl {version('hydrafl')}\n"


def test_a_misspelled_strategy_names_the_flag_and_the_choices_before_any_training(tmp_path):
    result = CliRunner().invoke(
        app, ["simulate", "--strategies", "fedavg,fedavgg", "--out", str(tmp_path / "o")], env=WIDE
    )
    assert result.exit_code == 2
    assert _flat(result.output).startswith(
        "error: --strategies: unknown strategy 'fedavgg'; choose one of "
    )
    assert "fedprox" in result.output and not (tmp_path / "o").exists()


def test_a_bad_value_names_its_flag(tmp_path):
    result = CliRunner().invoke(
        app, ["simulate", "--rounds", "0", "--out", str(tmp_path / "o")], env=WIDE
    )
    assert result.exit_code == 2 and "invalid --rounds=0: expected" in _flat(result.output)


def test_simulate_into_a_file_prints_a_line_per_round(tmp_path):
    result = CliRunner().invoke(
        app,
        [
            "simulate",
            "--task",
            "tabular",
            "--sites",
            "2",
            "--samples-per-site",
            "40",
            "--rounds",
            "2",
            "--local-steps",
            "1",
            "--strategies",
            "fedavg",
            "--out",
            str(tmp_path / "o"),
        ],
    )
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("fedavg round")]
    assert [line.split(":")[0] for line in lines] == [
        "fedavg round 0/2",
        "fedavg round 1/2",
        "fedavg round 2/2",
    ]
    assert all(", 2 sites, " in line and "loss " in line for line in lines)
    assert "INFO" not in result.output  # the rounds' log records are -v only in simulate


def test_missing_data_names_the_flag(tmp_path):
    result = CliRunner().invoke(
        app,
        ["simulate", "--data", str(tmp_path / "nope.csv"), "--out", str(tmp_path / "o")],
        env=WIDE,
    )
    assert result.exit_code == 2
    assert f"{tmp_path / 'nope.csv'}: no such file or folder; check --data" in _flat(result.output)


def test_an_unknown_task_names_the_flag_for_own_data(tmp_path):
    result = CliRunner().invoke(
        app, ["simulate", "--task", "xray", "--out", str(tmp_path / "o")], env=WIDE
    )
    assert (
        result.exit_code == 2
        and "unknown task 'xray'" in result.output
        and "--data" in result.output
    )


def test_the_report_names_the_partition_the_run_used(tmp_path):
    args = [
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
        "1",
        "--strategies",
        "fedavg",
        "--no-progress",
    ]
    assert CliRunner().invoke(app, [*args, "--out", str(tmp_path / "synthetic")]).exit_code == 0
    assert "partition `natural`" in (tmp_path / "synthetic" / "report.md").read_text()
    assert (
        CliRunner()
        .invoke(app, [*args, "--partition", "iid", "--out", str(tmp_path / "iid")])
        .exit_code
        == 0
    )
    assert "partition `iid`" in (tmp_path / "iid" / "report.md").read_text()
