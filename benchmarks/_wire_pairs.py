"""Hydrafl against the raw gRPC stream, run by run: the pairing and the rates both wire measurements share."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import numpy as np

from hydrafl.benchmarks._wire_report import GIB
from hydrafl.proto.envelope import CHUNK_BYTES


def mark(arrays: list[np.ndarray], value: float) -> None:
    """Write `value` (negative: never a data value) at the start of every chunk, so no chunk is already stored."""
    for array in arrays:
        array[:: CHUNK_BYTES // 4] = value


def paired_runs(
    reps: int, arrays: list[np.ndarray], hydrafl: Callable[[int], dict], raw: Callable[[], dict]
) -> dict[str, list[dict]]:
    """`reps` runs of each in alternating order (drift in the machine's state hits both alike), the arrays
    marked anew every repetition, so nothing is already stored or cached."""
    runs: dict[str, list[dict]] = {"hydrafl": [], "raw": []}
    for rep in range(reps):
        mark(arrays, -(rep + 1.0))
        for name in ("hydrafl", "raw") if rep % 2 == 0 else ("raw", "hydrafl"):
            runs[name].append(hydrafl(rep) if name == "hydrafl" else raw())
    return runs


def rates(
    runs: dict[str, list[dict]], update_bytes: int
) -> tuple[dict[str, float], dict[str, float], float]:
    """Median seconds and GiB/s of each, and hydrafl's GiB/s over the raw stream's."""
    median = {
        name: statistics.median(run["seconds"] for run in done) for name, done in runs.items()
    }
    gib_per_s = {name: update_bytes / seconds / GIB for name, seconds in median.items()}
    return median, gib_per_s, gib_per_s["hydrafl"] / gib_per_s["raw"]
