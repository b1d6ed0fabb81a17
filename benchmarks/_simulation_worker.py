"""One backend's run of the simulation benchmark, alone in a fresh process.

`simulation_runtime` starts this module once per (backend, repetition) so that every run pays its own
interpreter start, imports and (for Ray) cluster start, and no run finds another's caches warm. It imports
nothing beyond what the run itself needs, so the process the parent measures is the workload's own.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

STARTED = time.perf_counter()

os.environ["RAY_AUTH_MODE"] = "disabled"

import torch  # noqa: E402  (timed: imports are part of what each backend costs)

from hydrafl.config import RunConfig  # noqa: E402
from hydrafl.simulation.compare import run_strategy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("backend", choices=("inprocess", "ray"))
    parser.add_argument(
        "--config", required=True, help="RunConfig as JSON (Flower run_config form)"
    )
    parser.add_argument(
        "--result", type=Path, required=True, help="where to write the run's history as JSON"
    )
    args = parser.parse_args()
    # hydrafl's own runner (compare_strategies) uses one torch thread, and Ray gives each one-CPU actor
    # OMP_NUM_THREADS=1: the same thread count on both backends keeps their floating-point results comparable.
    torch.set_num_threads(1)
    cfg = RunConfig.from_flower(json.loads(args.config))
    imported = time.perf_counter()
    history = run_strategy(cfg, args.backend)
    finished = time.perf_counter()
    result = {"import_s": imported - STARTED, "run_s": finished - imported, "history": history}
    args.result.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
