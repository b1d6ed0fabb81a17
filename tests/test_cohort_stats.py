"""Cohort statistics before training: what a site counts, how its policy releases the counts (suppression and
noise, checked by hand), how the coordinator adds them up (quantiles within their bin), and the `stats` job over
the in-process grid and a real coordinator with real sites."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from deployment import run_to_end
from helpers import SMALL_RUN
from typer.testing import CliRunner

from hydrafl.cli import app
from hydrafl.client.site_policy import PolicyError, SitePolicy, load_policy
from hydrafl.client.site_stats import site_stats
from hydrafl.cohort_stats import (
    Histogram,
    SiteStats,
    StatsError,
    combine,
    count_histogram,
    histogram_quantile,
    noise_scale,
    release,
    shared_edges,
)
from hydrafl.config import RunConfig
from hydrafl.data import TaskSpec
from hydrafl.simulation.compare import run_strategy

STATS_RUN = SMALL_RUN.replace(task="tabular", job="stats", sites=3, samples_per_site=50)


def _hand_stats() -> SiteStats:
    return SiteStats(
        modality="tabular",
        records=25,
        categories={"label": {"a": 3, "b": 22, "c": 0}},
        histograms={"feature 0": Histogram(edges=(0.0, 1.0, 2.0), counts=(0, 1, 4, 20))},
        missing={"feature 0": 2},
    )


def test_cells_of_one_to_k_minus_one_are_suppressed_and_zero_is_kept():
    released = release(_hand_stats(), min_cell_count=5)
    assert released.records == 25
    # a alone would be 25 - 22 - 0: b, the smallest other non-zero label, is suppressed with it
    assert released.categories == {"label": {"a": None, "b": None, "c": 0}}
    # 1, 4 and the 2 missing are suppressed together: their sum (7) shows, none of them alone
    assert released.histograms["feature 0"].counts == (0, None, None, 20)
    assert released.missing == {"feature 0": None}
    assert released.release.suppressed == 5 and released.release.min_cell_count == 5
    assert released.release.epsilon == 0.0 and released.release.mechanism == ""


def test_laplace_noise_splits_epsilon_over_the_groups_and_is_drawn_in_report_order():
    # groups: records, the label category, feature 0's histogram with its missing cell -> epsilon 1.5 / 3 = 0.5
    # per group, Laplace scale 1 / 0.5 = 2 for every count
    assert noise_scale("laplace", 1, 0.5, 0.0) == 2.0
    released = release(
        _hand_stats(), mechanism="laplace", epsilon=1.5, rng=np.random.default_rng(7)
    )
    draws = np.random.default_rng(7)
    raw = [25, 3, 22, 0, 0, 1, 4, 20, 2]  # records, labels a b c, 4 histogram cells, missing
    expected = [max(0, round(value + draws.laplace(0.0, 2.0))) for value in raw]
    got = [
        released.records,
        *released.categories["label"].values(),
        *released.histograms["feature 0"].counts,
        released.missing["feature 0"],
    ]
    assert got == expected
    assert released.release.epsilon == 1.5 and released.release.delta == 0.0


def test_the_vocabulary_is_noised_at_its_own_sensitivity():
    stats = SiteStats(modality="text", records=400, vocabulary=900, vocabulary_sensitivity=32)
    released = release(stats, mechanism="laplace", epsilon=2.0, rng=np.random.default_rng(3))
    draws = np.random.default_rng(3)
    # two groups (records, vocabulary): epsilon 1 each; scales 1 and 32
    assert released.records == round(400 + draws.laplace(0.0, 1.0))
    assert released.vocabulary == round(900 + draws.laplace(0.0, 32.0))


def test_gaussian_noise_has_the_classic_mechanisms_std():
    # sigma = sqrt(2 ln(1.25 / delta)) / epsilon = sqrt(2 ln 125000) / 0.5 = 4.8448 / 0.5
    assert noise_scale("gaussian", 1, 0.5, 1e-5) == pytest.approx(9.6896, abs=1e-4)
    rng = np.random.default_rng(0)
    stats = SiteStats(modality="tabular", records=10_000)
    noise = [
        release(stats, mechanism="gaussian", epsilon=0.5, delta=1e-5, rng=rng).records - 10_000
        for _ in range(4000)
    ]
    # rounding adds 1/12 to the variance
    assert np.std(noise) == pytest.approx(math.sqrt(9.6896**2 + 1 / 12), rel=0.05)
    with pytest.raises(StatsError, match="below 1"):
        release(stats, mechanism="gaussian", epsilon=1.0, delta=1e-5)


def _tabular(features: int) -> TaskSpec:
    return TaskSpec(
        name="t",
        modality="tabular",
        num_classes=2,
        class_names=("no", "yes"),
        num_features=features,
    )


def test_combined_quantiles_lie_within_one_bin_of_the_pooled_datas():
    rng = np.random.default_rng(11)
    cfg = RunConfig(stats_bins=20, stats_range="-5:5,0:100")
    sites = {}
    pooled = []
    for site, shift in enumerate((-1.0, 0.0, 1.5)):
        n = 300 + 100 * site
        x = np.stack([rng.normal(shift, 1.0, n), rng.uniform(0, 100, n)], axis=1)
        x[rng.random(n) < 0.1, 0] = np.nan
        y = rng.integers(0, 2, n)
        sites[str(site)] = site_stats(_tabular(2), x, y, cfg)
        pooled.append(x)
    every = np.concatenate(pooled)
    combined = combine(sites)
    assert combined.records == len(every) == 1200
    assert combined.missing["feature 0"] == int(np.isnan(every[:, 0]).sum())
    for column, width in ((0, 0.5), (1, 5.0)):
        histogram = combined.histograms[f"feature {column}"]
        assert histogram.width == pytest.approx(width)
        values = every[:, column][np.isfinite(every[:, column])]
        for q in (0.05, 0.25, 0.5, 0.75, 0.95):
            truth = np.quantile(values, q, method="inverted_cdf")
            assert abs(histogram_quantile(histogram, q) - truth) <= width


def test_a_quantile_in_an_open_bin_says_only_which_side():
    histogram = Histogram(
        edges=shared_edges(0, 1, 2),
        counts=count_histogram(np.array([-5.0, 0.2, 9, 9]), shared_edges(0, 1, 2)),
    )
    assert histogram.counts == (1, 1, 0, 2)
    assert histogram_quantile(histogram, 0.2) == -math.inf
    assert histogram_quantile(histogram, 0.5) == pytest.approx(
        0.5
    )  # the 2nd value: 0.2's bin [0, 0.5), whole
    assert histogram_quantile(histogram, 0.9) == math.inf


def test_texts_report_lengths_and_vocabulary_images_sizes_and_channel_means():
    text = TaskSpec(
        name="t", modality="text", num_classes=2, class_names=("a", "b"), vocab_size=50, seq_len=4
    )
    tokens = np.array([[1, 7, 9, 0], [1, 7, 0, 0], [1, 12, 13, 14]])
    stats = site_stats(text, tokens, np.array([0, 1, 1]), RunConfig(stats_bins=5))
    assert stats.vocabulary == 6  # distinct non-PAD ids: 1 (CLS), 7, 9, 12, 13, 14
    assert stats.vocabulary_sensitivity == 4  # one text holds at most seq_len of them
    assert stats.histograms["text length"].edges == (0.0, 1.0, 2.0, 3.0, 4.0, 5.0)
    assert stats.histograms["text length"].counts == (0, 0, 0, 1, 1, 1, 0)
    image = TaskSpec(
        name="i", modality="image", num_classes=2, class_names=("a", "b"), image_size=2, channels=1
    )
    pixels = np.array([np.full((1, 2, 2), -1.0), np.full((1, 2, 2), 0.5), np.full((1, 2, 2), 3.0)])
    stats = site_stats(
        image, pixels, np.array([0, 0, 1]), RunConfig(stats_bins=4, stats_range="-2:2")
    )
    assert stats.categories == {"label": {"a": 2, "b": 1}, "image size": {"1x2x2": 3}}
    assert stats.histograms["channel 0 mean"].counts == (0, 0, 1, 1, 0, 1)


@pytest.mark.parametrize(
    "report",
    [
        {"records": -1},
        {"records": True},
        {"histograms": {"f": {"edges": [1.0, 0.0], "counts": [0, 0, 0]}}},
        {"histograms": {"f": {"edges": [0.0, 1.0], "counts": [0, 0]}}},
        {
            "release": {
                "mechanism": "magic",
                "min_cell_count": 0,
                "epsilon": 0,
                "delta": 0,
                "suppressed": 0,
            }
        },
        {"categories": {"label": {"x" * 201: 1}}},
    ],
)
def test_a_report_from_a_site_is_checked_before_it_is_added(report):
    valid = json.loads(_hand_stats().to_json())
    with pytest.raises(StatsError):
        SiteStats.from_json(json.dumps({**valid, **report}))


def test_the_policy_keys_load_and_gaussian_needs_epsilon_below_one(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text('min-cell-count = 5\nstats-epsilon = 0.5\nstats-noise = "gaussian"\n')
    assert load_policy(path) == SitePolicy(
        min_cell_count=5, stats_epsilon=0.5, stats_noise="gaussian"
    )
    with pytest.raises(PolicyError, match="stats-epsilon < 1"):
        SitePolicy(stats_epsilon=2.0, stats_noise="gaussian")
    with pytest.raises(PolicyError, match="laplace or gaussian"):
        SitePolicy(stats_noise="uniform")


def _stats_json(
    tmp_path, name: str, policy: SitePolicy = SitePolicy(), cfg: RunConfig = STATS_RUN
) -> dict:
    run_strategy(cfg.replace(run_dir=str(tmp_path / name)), "inprocess", policy=policy)
    return json.loads((tmp_path / name / "stats.json").read_text())


def test_the_stats_job_on_the_in_process_grid_applies_each_sites_policy(tmp_path):
    exact = _stats_json(tmp_path, "exact")
    assert exact["combined"]["records"] == 150
    assert sorted(exact["sites"]) == ["1001", "1002", "1003"]
    labels = exact["combined"]["categories"]["label"]
    assert sum(labels.values()) == 150
    suppressed = _stats_json(tmp_path, "suppressed", SitePolicy(min_cell_count=10))
    small = hidden = 0
    for site, report in exact["sites"].items():
        released = suppressed["sites"][site]
        groups = [
            (histogram["counts"], released["histograms"][name]["counts"])
            for name, histogram in report["histograms"].items()
        ]
        labels = report["categories"]["label"]
        groups.append((list(labels.values()), list(released["categories"]["label"].values())))
        for raw, out in groups:
            for before, after in zip(raw, out, strict=True):
                assert after is None if 0 < before < 10 else after in (before, None)
            assert out.count(None) != 1  # never one alone: the group's sum would give it away
            small += sum(0 < before < 10 for before in raw)
            hidden += out.count(None)
    assert 0 < small <= hidden == suppressed["combined"]["suppressed"]
    assert (tmp_path / "suppressed" / "stats_labels.png").stat().st_size > 0
    markdown = (tmp_path / "suppressed" / "stats.md").read_text()
    assert "<10" in markdown and "![stats_histograms](stats_histograms.png)" in markdown


def test_simulate_stats_writes_them_before_training_and_refuses_the_stats_job(tmp_path):
    quick = (
        "--task tabular --sites 2 --samples-per-site 30 --local-steps 1 --rounds 1 --no-progress"
    )
    result = CliRunner().invoke(app, ["simulate", *quick.split(), "--job", "stats"])
    assert result.exit_code == 2 and "--stats" in result.output
    out = tmp_path / "study"
    result = CliRunner().invoke(
        app, ["simulate", *quick.split(), "--stats", "--strategies", "fedavg", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    stats = json.loads((out / "stats" / "stats.json").read_text())
    assert stats["combined"]["records"] == 60
    assert (out / "results.json").is_file()


def test_admin_run_create_takes_the_stats_job_and_refuses_an_unknown_one(tmp_path):
    db = f"sqlite:///{tmp_path / 'c.db'}"
    result = CliRunner().invoke(
        app, ["admin", "run", "create", "--job", "stats", "--task", "tabular", "--db", db]
    )
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(app, ["admin", "run", "create", "--job", "stat", "--db", db])
    assert result.exit_code == 2 and "train or stats" in result.output


def _hospital_table(path, rows: int = 40) -> np.ndarray:
    """A hospital's own CSV: 12 numeric columns like the tabular cohort's, in raw units (mean 50, sd 10)."""
    x = np.random.default_rng(5).normal(50.0, 10.0, (rows, 12)).round(3)
    labels = ["discharge", "ward", "icu"]
    lines = [",".join([*(f"f{j}" for j in range(12)), "outcome"])]
    lines += [",".join([*map(str, row), labels[i % 3]]) for i, row in enumerate(x)]
    path.write_text("\n".join(lines) + "\n")
    return x


@pytest.mark.slow
def test_the_coordinator_runs_the_stats_job_with_real_sites(tmp_path):
    from mlflow.tracking import MlflowClient

    policy = tmp_path / "policy.toml"
    policy.write_text("min-cell-count = 10\n")
    table = tmp_path / "hospital.csv"
    raw = _hospital_table(table)
    cfg = STATS_RUN.replace(stats_range="0:100")  # the hospital's raw units
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    store, run_id = run_to_end(
        tmp_path,
        cfg,
        [(), ("--policy", str(policy)), ("--data", str(table), "--label-column", "outcome")],
        server_options=("--track", f"mlflow:{uri}"),
    )
    run = store.run(run_id)
    assert run.status == "finished", run.detail
    client = MlflowClient(tracking_uri=uri)
    (tracked,) = client.search_runs([client.get_experiment_by_name("hydrafl").experiment_id])
    artifacts = {a.path for a in client.list_artifacts(tracked.info.run_id)}
    assert {"stats.json", "stats.md", "stats_labels.png", "stats_histograms.png"} <= artifacts
    stats = json.loads((tmp_path / "home" / "runs" / str(run_id) / "stats.json").read_text())
    # the same synthetic cohort, one share per site
    simulated = _stats_json(tmp_path, "simulated", cfg=cfg)
    reports = list(stats["sites"].values())
    own_file = [report for report in reports if report["records"] == 40]
    assert len(own_file) == 1  # its raw values, not the standardised ones it would train on
    edges = shared_edges(0, 100, 10)
    assert own_file[0]["histograms"]["feature 3"]["counts"] == list(
        count_histogram(raw[:, 3], edges)
    )
    assert stats["combined"]["records"] == 50 + 50 + 40
    assert sorted(r["release"]["min_cell_count"] for r in reports) == [0, 0, 10]
    demo = [r for r in reports if r["records"] == 50 and not r["release"]["min_cell_count"]]
    assert len(demo) == 1 and demo[0] in simulated["sites"].values()  # its share, as simulated
