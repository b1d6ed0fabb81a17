"""Round overhead: the same run over the gRPC coordinator with site processes and on the in-process grid.

    python -m hydrafl.benchmarks.round_overhead [--out DIR] [--quick] [--rounds R]

A tabular run (3 demo sites, fedavg) is driven twice: by `hydrafl server` on loopback with three `hydrafl site`
processes (SQLite store, blobs on disk), and by the in-process grid in this process. A round's seconds are the
driver's own (`rounds.tsv`'s duration: sending, the sites' training, replies, aggregation, evaluation), so the
difference of the medians is what the coordinator's runtime adds to a round: message dispatch, the sites'
polls, transfers and commits. Sites long-poll (`server.mailbox`): a stored message answers their waiting poll
at once, and a stored reply wakes the round driver.

Goal: median coordinator round minus median in-process round < 0.2 s.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from hydrafl.benchmarks._common import benchmark_parser, verdict  # noqa: E402
from hydrafl.config import RunConfig  # noqa: E402
from hydrafl.server.store import Store  # noqa: E402
from hydrafl.server_app import run_federation  # noqa: E402
from hydrafl.simulation.grid import InProcessGrid  # noqa: E402
from hydrafl.site_app import client_app  # noqa: E402

NAME = "round_overhead"
GOAL_S = 0.2


def run_config(rounds: int) -> RunConfig:
    return RunConfig.build(task="tabular", strategy="fedavg", sites=3, samples_per_site=60, rounds=rounds,
                           local_steps=3, batch_size=16, lr=3e-3)


def in_process(cfg: RunConfig) -> list[float]:
    """The driver's seconds of each training round on the in-process grid."""
    torch.set_num_threads(1)
    history = run_federation(InProcessGrid(client_app, cfg.sites, cfg.to_flower()), cfg).history
    return [record["seconds"] for record in history[1:]]


def over_grpc(cfg: RunConfig, work: Path) -> list[float]:
    """The driver's seconds of each training round on `hydrafl server` with a `hydrafl site` process per site."""
    env = {**os.environ, "HYDRAFL_HOME": str(work / "home")}
    store = Store(f"sqlite:///{work / 'coordinator.db'}")
    tokens = [store.add_site(f"hospital-{i}")[1] for i in range(cfg.sites)]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    hydrafl = [sys.executable, "-m", "hydrafl"]
    log = (work / "processes.log").open("w")
    processes = [subprocess.Popen([*hydrafl, "server", "--listen", address, "--db", f"sqlite:///{work / 'coordinator.db'}",
                                   "--blobs", str(work / "blobs")], env=env, stdout=log, stderr=log)]
    processes += [subprocess.Popen([*hydrafl, "site", "--coordinator", address],
                                   env={**env, "HYDRAFL_SITE_TOKEN": token, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=log) for token in tokens]
    try:
        run_id = store.create_run({k: v for k, v in cfg.to_flower().items() if k not in ("run-dir", "resume")}).id
        deadline = time.monotonic() + 600
        while (run := store.run(run_id)).status not in ("finished", "failed"):
            if time.monotonic() > deadline:
                raise TimeoutError("the coordinator's run did not finish in 600 s")
            time.sleep(0.5)
        if run.status != "finished":
            raise RuntimeError(f"the coordinator's run failed: {run.detail}")
        return [record["seconds"] for record in run.history[1:]]
    finally:
        for process in processes:
            process.kill()
            process.wait()
        log.close()


def summarise(inprocess: list[float], grpc: list[float]) -> dict[str, Any]:
    overhead = statistics.median(grpc) - statistics.median(inprocess)
    return {"benchmark": NAME, "inprocess_s": inprocess, "grpc_s": grpc,
            "median_inprocess_s": statistics.median(inprocess), "median_grpc_s": statistics.median(grpc),
            "overhead_s": overhead, "goal_s": GOAL_S, "goal_met": overhead < GOAL_S}


def plot(summary: dict[str, Any], path: Path) -> None:
    fig, axis = plt.subplots(figsize=(7, 4))
    for key, label in (("inprocess_s", "in-process grid"), ("grpc_s", "gRPC coordinator + 3 site processes")):
        axis.plot(range(1, len(summary[key]) + 1), summary[key], marker="o", label=label)
    axis.set_xlabel("round")
    axis.set_ylabel("round seconds (driver)")
    axis.set_title(f"overhead {summary['overhead_s']:.3f} s per round (goal < {GOAL_S} s)")
    axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = benchmark_parser(__doc__, "3 rounds")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    cfg = run_config(3 if args.quick else args.rounds)
    console = Console()
    with console.status("in-process run"):
        inprocess = in_process(cfg)
    with tempfile.TemporaryDirectory() as work, console.status("coordinator run (server + 3 site processes)"):
        grpc = over_grpc(cfg, Path(work))
    summary = {**summarise(inprocess, grpc), "rounds": cfg.rounds, "quick": args.quick}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{NAME}.json").write_text(json.dumps(summary, indent=1))
    plot(summary, args.out / f"{NAME}.png")
    table = Table(title=f"median round seconds, {cfg.rounds} rounds of a 3-site tabular fedavg run")
    for column in ("in-process", "gRPC coordinator", "overhead", "goal"):
        table.add_column(column, justify="right")
    table.add_row(f"{summary['median_inprocess_s']:.3f}", f"{summary['median_grpc_s']:.3f}",
                  f"{summary['overhead_s']:.3f}", verdict(summary["goal_met"], f"< {GOAL_S} s: met", f"BELOW GOAL (< {GOAL_S} s)"))
    console.print(table)


if __name__ == "__main__":
    main()
