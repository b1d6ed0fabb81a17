"""The secure-aggregation benchmark's report (`benchmarks/secagg.py`): its markdown tables, console tables and
plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from rich.console import Console
from rich.table import Table

from hydrafl.benchmarks._common import verdict
from hydrafl.benchmarks._secagg_poisoner import SHORT_NAMES

MB = 1e6


def markdown(summary: dict[str, Any]) -> str:
    lines = [
        "| sites | params | plain server s | secure server s | secure site s | plain MB up | secure MB up "
        "| protocol KB | max error of sum w x delta (bound) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary["core"]:
        plain, secure = row["plain"], row["secure"]
        lines.append(
            f"| {row['sites']} | {row['params']:,} | {plain['server_s']:.3f} | {secure['server_s']:.3f} | "
            f"{secure['site_s']:.3f} | {plain['upload_bytes'] / MB:.2f} | {secure['upload_bytes'] / MB:.2f} | "
            f"{secure['protocol_bytes'] / 1e3:.1f} | {row['max_abs_error']:.2e} ({row['bound']:.2e}) |"
        )
    acc = summary["accuracy"]
    lines += [
        "",
        f"Accuracy ({acc['config']['task']}, {acc['config']['sites']} sites, {acc['config']['rounds']} rounds, "
        f"FedAvg, {acc['params']:,} parameters):",
        "",
        "| run | final accuracy | final loss | wall s | protocol KB |",
        "|---|---|---|---|---|",
    ]
    for name, final in acc["final"].items():
        lines.append(
            f"| {name} | {final['accuracy']:.4f} | {final['loss']:.4f} | {final['seconds']:.1f} | "
            f"{final['secagg_bytes'] / 1e3:.1f} |"
        )
    lines += [
        "",
        f"Largest difference between the two final models: {acc['max_model_difference']:.2e}.",
    ]
    if "poisoning" in summary:
        poison = summary["poisoning"]
        conf, norms = poison["config"], poison["honest_norms"]
        lines += [
            "",
            f"Poisoner ({conf['task']}, {conf['sites']} sites, {conf['poisoners']} of them scaling their update "
            f"x{conf['scale']:g} and skipping the honest-site bound, {conf['rounds']} rounds, FedAvg; "
            f"honest-site bound C = {conf['secagg_clip']:g}, "
            f"honest update norms {norms['min']:.2f}..{norms['max']:.2f} "
            f"(median {norms['median']:.2f}); screening: --screen-norm {conf['screen_norm']:g}):",
            "",
            "| run | final accuracy | final loss |",
            "|---|---|---|",
        ]
        for row in poison["runs"]:
            lines.append(f"| {row['run']} | {row['accuracy']:.4f} | {row['loss']:.4f} |")
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], path: Path) -> None:
    sizes = sorted({row["params"] for row in summary["core"]})
    fig, axes = plt.subplots(1, len(sizes) + 2, figsize=(5 * (len(sizes) + 2), 4))
    for axis, size in zip(axes, sizes, strict=False):  # the last two axes: accuracy, poisoning
        rows = [row for row in summary["core"] if row["params"] == size]
        sites = [row["sites"] for row in rows]
        axis.plot(
            sites, [row["plain"]["server_s"] for row in rows], marker="o", label="plain: server"
        )
        axis.plot(
            sites, [row["secure"]["server_s"] for row in rows], marker="o", label="secure: server"
        )
        axis.plot(
            sites, [row["secure"]["site_s"] for row in rows], marker="o", label="secure: per site"
        )
        axis.set_yscale("log")
        axis.set_xlabel("sites")
        axis.set_ylabel("seconds per round")
        axis.set_title(f"{size:,} parameters")
        axis.legend()
    history = summary["accuracy"]["per_round"]
    for name, rows in history.items():
        axes[-2].plot([r[0] for r in rows], [r[1] for r in rows], marker="o", label=name)
    axes[-2].set_xlabel("round")
    axes[-2].set_ylabel("accuracy")
    axes[-2].set_title("tabular FedAvg: plain vs secure aggregation")
    axes[-2].legend()
    runs = summary["poisoning"]["runs"]
    axes[-1].barh(
        [SHORT_NAMES.get(row["run"], row["run"]) for row in runs],
        [row["accuracy"] for row in runs],
        color=["tab:red" if row["poisoned"] else "tab:blue" for row in runs],
    )
    axes[-1].invert_yaxis()
    axes[-1].set_xlabel("final accuracy")
    axes[-1].set_title("2 of 10 sites poison (x100)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_tables(summary: dict[str, Any]) -> None:
    console = Console()
    table = Table(title="one round: plain vs secure aggregation (protocol core, no training)")
    for column in (
        "sites",
        "params",
        "plain server s",
        "secure server s",
        "secure site s",
        "up MB plain/secure",
        "protocol KB",
        "max error",
        "within bound",
    ):
        table.add_column(column, justify="right")
    for row in summary["core"]:
        plain, secure = row["plain"], row["secure"]
        table.add_row(
            str(row["sites"]),
            f"{row['params']:,}",
            f"{plain['server_s']:.3f}",
            f"{secure['server_s']:.3f}",
            f"{secure['site_s']:.3f}",
            f"{plain['upload_bytes'] / MB:.2f}/{secure['upload_bytes'] / MB:.2f}",
            f"{secure['protocol_bytes'] / 1e3:.1f}",
            f"{row['max_abs_error']:.2e}",
            verdict(row["within_bound"], "yes", "NO"),
        )
    console.print(table)
    acc = summary["accuracy"]
    console.print(
        f"final accuracy plain {acc['final']['plain']['accuracy']:.4f}, secure "
        f"{acc['final']['secure']['accuracy']:.4f}; largest model difference {acc['max_model_difference']:.2e}"
    )
    for row in summary["poisoning"]["runs"]:
        console.print(f"poisoner scenario, {row['run']}: final accuracy {row['accuracy']:.4f}")
