"""What every benchmark's command line and verdicts share."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)


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
