"""What researchers compare: results.json, a Markdown table, PNG curves, and the rounds.tsv timing table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydrafl.curves import plot_curves
from hydrafl.rounds import ROUNDS_TSV_COLUMNS, RoundRecord, megabytes, metric
from hydrafl.trust import trust_lines

SUMMARY_COLUMNS = (
    "strategy",
    "final loss",
    "final accuracy",
    "best accuracy",
    "MB up",
    "MB down",
    "seconds",
)
DIAGNOSTIC_COLUMNS = (
    "strategy",
    "mean B_pg",
    "final B_pg",
    "mean cos(avg, full)",
    "final cos(avg, full)",
)


def summary_rows(results: dict[str, Any]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for strategy, run in results["strategies"].items():
        rounds = run["rounds"]
        last = rounds[-1]
        accuracies = [r["accuracy"] for r in rounds if r["accuracy"] is not None]
        rows.append(
            (
                strategy,
                metric(last["loss"]),
                metric(last["accuracy"]),
                metric(max(accuracies) if accuracies else None),
                megabytes(sum(r["bytes_up"] for r in rounds)),
                megabytes(sum(r["bytes_down"] for r in rounds)),
                f"{run['seconds']:.1f}",
            )
        )
    return rows


def diagnostic_rows(results: dict[str, Any]) -> list[tuple[str, ...]]:
    """Per strategy, the pseudo-gradient noise scale and full-data cosine over the training rounds (only
    strategies whose rounds carry them: runs with `diagnostics`)."""
    rows: list[tuple[str, ...]] = []
    for strategy, run in results["strategies"].items():
        scales = [r["noise_scale"] for r in run["rounds"] if r.get("noise_scale") is not None]
        cosines = [
            r["full_data_cosine"] for r in run["rounds"] if r.get("full_data_cosine") is not None
        ]
        if scales or cosines:
            rows.append(
                (
                    strategy,
                    metric(sum(scales) / len(scales) if scales else None),
                    metric(scales[-1] if scales else None),
                    metric(sum(cosines) / len(cosines) if cosines else None),
                    metric(cosines[-1] if cosines else None),
                )
            )
    return rows


def dedup_lines(results: dict[str, Any]) -> list[str]:
    """Per strategy, the training records each site dropped as cross-site duplicates before round 1."""
    return [
        f"- **{strategy}**: "
        + ", ".join(
            f"site {site} dropped {counts['dropped']} of {counts['records']}"
            for site, counts in run["dedup"].items()
        )
        for strategy, run in results["strategies"].items()
        if "dedup" in run
    ]


def write_report(out: Path, results: dict[str, Any]) -> list[Path]:
    """results.json, report.md, rounds.tsv and the curves in `out`; returns their paths."""
    (out / "results.json").write_text(json.dumps(results, indent=1))
    config = results["config"]
    partition = config["partition"] or ("iid" if config["data"] else "natural")
    lines = [
        "# hydrafl strategy comparison",
        "",
        f"task `{config['data'] or config['task']}`, {config['sites']} sites, {config['rounds']} rounds, "
        f"{config['local_steps']} local steps, partition `{partition}`, seed {config['seed']}",
        "",
        "| " + " | ".join(SUMMARY_COLUMNS) + " |",
        "|" + "---|" * len(SUMMARY_COLUMNS),
        *("| " + " | ".join(row) + " |" for row in summary_rows(results)),
        "",
        "Loss and accuracy are the federated evaluation of the global model on every site's test split "
        "(sample-weighted). MB counts array payloads sent to and from sites, training and evaluation.",
        "",
        "![by round](curves_by_round.png)",
        "![by bytes](curves_by_bytes.png)",
    ]
    diagnostics = diagnostic_rows(results)
    if diagnostics:
        lines += [
            "",
            "## Pseudo-gradient diagnostics",
            "",
            "| " + " | ".join(DIAGNOSTIC_COLUMNS) + " |",
            "|" + "---|" * len(DIAGNOSTIC_COLUMNS),
            *("| " + " | ".join(row) + " |" for row in diagnostics),
            "",
            "B_pg = tr(Cov[delta_site]) / ||mean delta||^2 over each round's site deltas (more sites help while "
            "their number is below B_pg); cos(avg, full) compares the averaged delta with the delta of one site "
            "trained on all sites' pooled data from the same start weights.",
        ]
    dedup = dedup_lines(results)
    if dedup:
        lines += ["", "## Cross-site deduplication", "", *dedup]
    trust = [
        (strategy, trust_lines(run.get("trust", {})))
        for strategy, run in results["strategies"].items()
    ]
    if any(sentences for _, sentences in trust):
        lines += ["", "## Privacy and security", ""]
        lines += [
            f"- **{strategy}**: " + "; ".join(sentences)
            for strategy, sentences in trust
            if sentences
        ]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    rows = [
        f"{strategy}\t{RoundRecord(**record).tsv_row()}"
        for strategy, run in results["strategies"].items()
        for record in run["rounds"]
    ]
    (out / "rounds.tsv").write_text(
        "\n".join(["strategy\t" + "\t".join(ROUNDS_TSV_COLUMNS), *rows]) + "\n"
    )
    runs = {strategy: run["rounds"] for strategy, run in results["strategies"].items()}
    plot_curves(out / "curves_by_round.png", runs, by_bytes=False)
    plot_curves(out / "curves_by_bytes.png", runs, by_bytes=True)
    names = (
        "results.json",
        "report.md",
        "rounds.tsv",
        "curves_by_round.png",
        "curves_by_bytes.png",
    )
    return [out / name for name in names]
