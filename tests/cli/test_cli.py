"""The `hydrafl` command end to end: outputs, determinism, resume, and clear errors with exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from hydrafl.cli import app
from hydrafl.client import site_app
from hydrafl.config import RunConfig
from hydrafl.server.aggregation.stability import OuterSetup, check

SMALL = """
task = "tabular"
sites = 3
samples-per-site = 60
rounds = 2
local-steps = 3
batch-size = 16
strategies = "fedavg,diloco"
"""
RECORD_KEYS = {"round", "loss", "accuracy", "bytes_up", "bytes_down", "seconds"}


def _hydrafl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hydrafl", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _numbers(results: dict) -> dict:
    return {
        name: [
            {k: v for k, v in r.items() if k not in {"seconds", "aggregation_s", "gap_s"}}
            for r in run["rounds"]
        ]
        for name, run in results["strategies"].items()
    }


@pytest.mark.slow
def test_simulate_writes_every_output_and_repeats_exactly(tmp_path):
    config = tmp_path / "small.toml"
    config.write_text(SMALL)
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        done = _hydrafl("simulate", "--config", str(config), "--out", str(out), "--no-progress")
        assert done.returncode == 0, done.stderr
        assert "fedavg" in done.stdout and "diloco" in done.stdout  # the summary table
    results = json.loads((outs[0] / "results.json").read_text())
    assert list(results["strategies"]) == ["fedavg", "diloco"]
    for run in results["strategies"].values():
        assert [r["round"] for r in run["rounds"]] == [0, 1, 2]
        assert all(RECORD_KEYS <= set(r) for r in run["rounds"])
        assert all(r["bytes_up"] > 0 and r["bytes_down"] > 0 for r in run["rounds"][1:])
    assert results["config"]["sites"] == 3 and results["config"]["task"] == "tabular"
    assert _numbers(results) == _numbers(json.loads((outs[1] / "results.json").read_text()))
    report = (outs[0] / "report.md").read_text()
    assert "| fedavg |" in report and "| diloco |" in report
    for png in ("curves_by_round.png", "curves_by_bytes.png"):
        assert (outs[0] / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = (outs[0] / "rounds.tsv").read_text().splitlines()
    assert rows[0].split("\t")[:5] == ["strategy", "round", "duration_s", "aggregation_s", "gap_s"]
    assert len(rows) == 1 + 2 * 3
    assert (outs[0] / "diloco" / "stability.json").exists()


@pytest.mark.slow
def test_resume_continues_a_stopped_run(tmp_path):
    runner = CliRunner()
    common = [
        "simulate",
        "--task",
        "tabular",
        "--sites",
        "2",
        "--samples-per-site",
        "40",
        "--local-steps",
        "2",
        "--strategies",
        "diloco",
        "--no-progress",
    ]
    assert (
        runner.invoke(app, [*common, "--rounds", "3", "--out", str(tmp_path / "full")]).exit_code
        == 0
    )
    assert (
        runner.invoke(app, [*common, "--rounds", "1", "--out", str(tmp_path / "split")]).exit_code
        == 0
    )
    resumed = runner.invoke(
        app, [*common, "--rounds", "3", "--resume", "--out", str(tmp_path / "split")]
    )
    assert resumed.exit_code == 0, resumed.output
    full = json.loads((tmp_path / "full" / "results.json").read_text())
    split = json.loads((tmp_path / "split" / "results.json").read_text())
    assert _numbers(full) == _numbers(split)


def test_unknown_config_key_is_an_error_that_names_it(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("rounds = 2\nlocal_stepz = 3\n")
    result = CliRunner().invoke(app, ["simulate", "--config", str(config), "--no-progress"])
    assert result.exit_code == 2
    assert "local_stepz" in result.output and "bad.toml" in result.output


def test_bad_data_file_error_names_file_and_line(tmp_path):
    data = tmp_path / "visits.csv"
    data.write_text("age,lactate,outcome\n61,2.1,ward\n70,high,icu\n55,1.0,home\n")
    result = CliRunner().invoke(
        app,
        [
            "simulate",
            "--data",
            str(data),
            "--label-column",
            "outcome",
            "--out",
            str(tmp_path / "o"),
            "--no-progress",
        ],
    )
    assert result.exit_code == 2
    assert "visits.csv" in result.output and "lactate" in result.output and "3" in result.output


def test_too_few_successful_sites_exits_non_zero_with_the_reason(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("GPU fell off the bus")

    monkeypatch.setattr(site_app, "train_site", broken)
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
            "--strategies",
            "fedavg",
            "--out",
            str(tmp_path / "o"),
            "--no-progress",
        ],
    )
    assert result.exit_code == 1
    assert "only 0 of 2 sites replied without error" in " ".join(result.output.split())


def test_stability_command_json_and_plot(tmp_path):
    args = [
        "--inner-lr",
        "0.1",
        "--curvature",
        "1",
        "--curvature-var",
        "2",
        "--batch-size",
        "1",
        "--local-steps",
        "10",
        "--sites",
        "1",
        "--momentum",
        "0.9",
    ]
    stable = CliRunner().invoke(app, ["stability", *args, "--outer-lr", "1.0", "--json"])
    verdict = json.loads(stable.output)
    expected = check(
        OuterSetup(
            inner_lr=0.1,
            curvature=1,
            curvature_var=2,
            batch_size=1,
            local_steps=10,
            sites=1,
            outer_lr=1.0,
            momentum=0.9,
        )
    )
    assert verdict["stable"] is True
    assert verdict["max_stable_outer_lr"] == pytest.approx(expected.max_stable_outer_lr)
    assert verdict["max_stable_outer_lr"] == pytest.approx(1.8645, abs=1e-3)
    unstable = CliRunner().invoke(
        app, ["stability", *args, "--outer-lr", "2.5", "--json", "--heavy-ball"]
    )
    assert json.loads(unstable.output)["stable"] is False
    plot = tmp_path / "region.png"
    text = CliRunner().invoke(app, ["stability", *args, "--outer-lr", "2.5", "--plot", str(plot)])
    assert "UNSTABLE" in text.output and plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "command",
    [
        [],
        ["simulate"],
        ["stability"],
        ["server"],
        ["site"],
        ["admin"],
        ["admin", "site", "add"],
        ["admin", "site", "list"],
        ["admin", "site", "revoke"],
        ["admin", "run", "create"],
        ["admin", "run", "status"],
        ["admin", "run", "list"],
        ["admin", "run", "logs"],
        ["admin", "run", "stop"],
        ["admin", "run", "resume"],
        ["admin", "run", "export"],
        ["admin", "token", "create"],
        ["admin", "token", "list"],
        ["admin", "token", "revoke"],
    ],
)
def test_every_command_has_help(command):
    result = CliRunner().invoke(app, [*command, "--help"])
    assert result.exit_code == 0 and "Usage" in result.output


@pytest.mark.slow
def test_simulate_on_a_users_csv(tmp_path):
    rng = __import__("numpy").random.default_rng(0)
    rows = ["age,lactate,heart_rate,outcome"]
    for _ in range(90):
        age, lactate, rate = rng.normal(60, 15), rng.gamma(2, 1), rng.normal(85, 15)
        rows.append(
            f"{age:.1f},{lactate:.2f},{rate:.0f},{'icu' if lactate + rate / 50 > 4.5 else 'ward'}"
        )
    data = tmp_path / "visits.csv"
    data.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        [
            "simulate",
            "--data",
            str(data),
            "--label-column",
            "outcome",
            "--sites",
            "3",
            "--rounds",
            "2",
            "--local-steps",
            "3",
            "--strategies",
            "fedavg",
            "--partition",
            "dirichlet:1.0",
            "--out",
            str(out),
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["data"] == str(data)
    assert len(results["strategies"]["fedavg"]["rounds"]) == 3


def test_admin_site_commands(tmp_path):
    db = ["--db", f"sqlite:///{tmp_path / 'c.db'}"]
    runner = CliRunner()
    added = runner.invoke(app, ["admin", "site", "add", "st-marys", *db])
    assert added.exit_code == 0
    token = added.stdout.strip().splitlines()[-1]
    from hydrafl.server.store import Store

    assert Store(f"sqlite:///{tmp_path / 'c.db'}").authenticate(token).name == "st-marys"
    again = runner.invoke(app, ["admin", "site", "add", "st-marys", *db])
    assert again.exit_code == 2 and "already enrolled" in again.output
    assert runner.invoke(app, ["admin", "site", "revoke", "st-marys", *db]).exit_code == 0
    listed = runner.invoke(app, ["admin", "site", "list", *db])
    assert "st-marys" in listed.output and "revoked" in listed.output
    assert runner.invoke(app, ["admin", "site", "revoke", "nobody", *db]).exit_code == 2


def test_admin_token_commands(tmp_path):
    from hydrafl.server.store import Store

    db = ["--db", f"sqlite:///{tmp_path / 'c.db'}"]
    runner = CliRunner(env={"COLUMNS": "200"})
    out = tmp_path / "alice.token"
    created = runner.invoke(app, ["admin", "token", "create", "alice", "--out", str(out), *db])
    assert created.exit_code == 0 and out.stat().st_mode & 0o777 == 0o600
    store = Store(db[1])
    assert store.authenticate_admin(out.read_text().strip()).name == "alice"
    assert store.authenticate(out.read_text().strip()) is None  # an admin's token is no site's
    taken = runner.invoke(app, ["admin", "token", "create", "bob", "--out", str(out), *db])
    assert taken.exit_code == 2 and "the token was revoked" in taken.output
    assert runner.invoke(app, ["admin", "token", "revoke", "alice", *db]).exit_code == 0
    assert store.authenticate_admin(out.read_text().strip()) is None
    listed = runner.invoke(app, ["admin", "token", "list", *db]).output
    rows = [[cell.strip() for cell in line.split("│")[1:3]] for line in listed.splitlines()]
    assert [row for row in rows if "revoked" in row] == [["alice", "revoked"], ["bob", "revoked"]]


def test_a_site_with_an_unknown_tier_is_refused_before_it_connects():
    result = CliRunner().invoke(
        app, ["site", "--token", "t", "--tier", "huge", "--coordinator", "127.0.0.1:1"]
    )
    assert result.exit_code == 2 and "small, medium, large" in result.output


@pytest.mark.slow
def test_simulate_hydra_bypass_sends_small_sites_less(tmp_path):
    args = [
        "simulate",
        "--task",
        "tabular",
        "--strategies",
        "hydra",
        "--hydra-bypass",
        "--hydra-head-mode",
        "drop",
        "--sites",
        "3",
        "--samples-per-site",
        "60",
        "--rounds",
        "1",
        "--local-steps",
        "1",
        "--site-tiers",
        "small,medium,large",
        "--out",
        str(tmp_path),
        "--no-progress",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["knobs"] == {"hydra_bypass": True, "hydra_head_mode": "drop"}
    down = sorted(results["strategies"]["hydra"]["rounds"][1]["bytes_down_per_site"].values())
    assert (
        down[0] < down[1] < down[2]
    )  # a small site's net skips a layer, a medium one drops heads: not sent


@pytest.mark.slow
def test_a_mixed_comparison_runs_with_tiers_cycling_over_the_sites(tmp_path):
    args = [
        "simulate",
        "--task",
        "tabular",
        "--strategies",
        "hydra,heterofl,fjord,fedrolex,flora,fedavg",
        "--site-tiers",
        "small,medium,large",
        "--rounds",
        "1",
        "--local-steps",
        "1",
        "--out",
        str(tmp_path),
        "--no-progress",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["sites"] == 4 and results["config"]["lora_rank"] == 0
    ranks = {name: s["lora_rank"] for name, s in results["strategies"].items()}
    assert ranks == {"hydra": 0, "heterofl": 0, "fjord": 0, "fedrolex": 0, "flora": 8, "fedavg": 0}
    nodes = sorted(results["strategies"]["hydra"]["trainable_params_per_site"]["1"], key=int)
    for name in ("hydra", "heterofl"):
        params = results["strategies"][name]["rounds"][1]["trainable_params_per_site"]
        small, medium, large, fourth = (params[node] for node in nodes)
        assert small < medium < large and fourth == small  # the fourth site cycles back to small


def test_more_tiers_than_sites_is_an_error():
    with pytest.raises(ValueError, match="at most 2 comma-separated names"):
        RunConfig(sites=2, site_tiers="small,medium,large")
