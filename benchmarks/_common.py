"""What every benchmark's command line and verdicts share."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def benchmark_parser(doc: str | None, quick_help: str) -> argparse.ArgumentParser:
    """--out (JSON and PNG go there) and --quick (a smoke-test size); callers add their own options."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results"), help="where JSON and PNG go"
    )
    parser.add_argument("--quick", action="store_true", help=f"smoke-test size: {quick_help}")
    return parser


def progress_columns() -> tuple[ProgressColumn, ...]:
    """A benchmark's progress bar: what runs, the bar, runs done of all, time so far."""
    return (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )


def verdict(ok: bool, yes: str = "goal met", no: str = "BELOW GOAL") -> str:
    """A goal's outcome as rich markup, never softened: a missed goal reads BELOW GOAL."""
    return f"[green]{yes}[/]" if ok else f"[red]{no}[/]"


def save_against_model_size(
    figure: Figure, axis: Axes, sizes: list[float], ylabel: str, title: str, path: Path
) -> None:
    """Finish a plot of memory against model size (the model's own size dotted for scale) and save it."""
    import matplotlib.pyplot as plt

    axis.plot(sizes, sizes, ":", color="grey", label="model size")
    axis.set_xlabel("model (float32, GiB)")
    axis.set_ylabel(ylabel)
    axis.set_title(title)
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
