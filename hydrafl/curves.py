"""Loss and accuracy curves, by round or by bytes communicated, as a PNG: the simulation's report draws every
compared strategy's, a tracked coordinator run its own."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def plot_curves(path: Path, runs: Mapping[str, list[dict[str, Any]]], *, by_bytes: bool) -> None:
    """One line per run of `runs` (name: its round records) in a loss and an accuracy panel."""
    figure, (loss_axis, accuracy_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rounds in runs.items():
        if by_bytes:
            total, xs = 0, []
            for record in rounds:
                total += record["bytes_up"] + record["bytes_down"]
                xs.append(total / 1e6)
        else:
            xs = [record["round"] for record in rounds]
        loss_axis.plot(xs, [r["loss"] for r in rounds], marker=".", label=name)
        accuracy_axis.plot(xs, [r["accuracy"] for r in rounds], marker=".", label=name)
    xlabel = "MB communicated (up + down)" if by_bytes else "round"
    loss_axis.set(xlabel=xlabel, ylabel="federated test loss", title="Loss")
    accuracy_axis.set(xlabel=xlabel, ylabel="federated test accuracy", title="Accuracy")
    for axis in (loss_axis, accuracy_axis):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
