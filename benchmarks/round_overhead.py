"""Round overhead: the same run over the gRPC coordinator with site processes and on the in-process grid.

    python -m hydrafl.benchmarks.round_overhead [--out DIR] [--quick] [--rounds R]

A tabular run (3 demo sites, fedavg) is driven twice: by `hydrafl server` on loopback with three `hydrafl site`
processes (SQLite store, blobs on disk), and by the in-process grid in this process. A round's seconds are the
driver's own (`rounds.tsv`'s duration: sending, the sites' training, replies, aggregation, evaluation), so the
difference of the medians is what the coordinator's runtime adds to a round: message dispatch, the sites'
polls, transfers and commits. Sites long-poll (`server.mailbox`): a stored message answers their waiting poll
at once, and a stored reply wakes the round driver.

The same comparison with Flower's own runtime: a stock Flower app (`_stock_app`: NumPy linear model, FedAvg
from `flwr.serverapp.strategy`, 2 sites) runs once on `hydrafl server` with two `hydrafl site --app` processes
and once on a Flower SuperLink with two SuperNodes (`_flower_deployment`), the same number of rounds. Its
ServerApp times each round itself (from FedAvg's `configure_train` to its `aggregate_evaluate`: sending,
training, evaluation, replies, aggregation, the span `rounds.tsv` counts), so both runtimes are measured by the
same code and the sites' start is not counted (the app waits for its two sites before round 1).

The hydrafl app's pair runs twice: on the idle machine, and with two busy background processes (each spinning
one core) started before both runs of the pair and stopped after. Sites start exactly as README tells users to
(no environment of their own): each takes its share of the machine's cores (`client.machine_share`).

Goals: median coordinator round minus median in-process round < 0.2 s idle, < 0.5 s busy.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from rich.console import Console
from rich.table import Table

from hydrafl.benchmarks._common import benchmark_parser, verdict
from hydrafl.benchmarks._flower_deployment import (
    STOCK_CLIENT_APP,
    STOCK_SERVER_APP,
    flower_round_seconds,
    free_port,
)
from hydrafl.benchmarks._stock_app import ROUND_TIMES_KEY
from hydrafl.client.site_app import client_app
from hydrafl.config import RunConfig
from hydrafl.server.server_app import run_federation
from hydrafl.server.store import Store
from hydrafl.server.tables import Run
from hydrafl.simulation.grid import InProcessGrid

NAME = "round_overhead"
GOAL_S = 0.2
BUSY_GOAL_S = 0.5
BUSY_PROCESSES = 2
STOCK_SITES = 2
RUNTIMES = {
    "inprocess_s": "hydrafl app: in-process grid, 3 sites",
    "grpc_s": "hydrafl app: hydrafl coordinator + 3 site processes",
    "busy_inprocess_s": f"busy machine ({BUSY_PROCESSES} spinning processes): in-process grid",
    "busy_grpc_s": f"busy machine ({BUSY_PROCESSES} spinning processes): coordinator + 3 sites",
    "stock_grpc_s": f"stock Flower app: hydrafl coordinator + {STOCK_SITES} site processes",
    "stock_flower_s": f"stock Flower app: Flower SuperLink + {STOCK_SITES} SuperNodes",
}
"""Each series of round seconds in the JSON, and what ran it (table rows, plot lines)."""


def run_config(rounds: int) -> RunConfig:
    return RunConfig.build(
        task="tabular",
        strategy="fedavg",
        sites=3,
        samples_per_site=60,
        rounds=rounds,
        local_steps=3,
        batch_size=16,
        lr=3e-3,
    )


def in_process(cfg: RunConfig) -> list[float]:
    """The driver's seconds of each training round on the in-process grid."""
    torch.set_num_threads(1)
    history = run_federation(InProcessGrid(client_app, cfg.sites, cfg.to_flower()), cfg).history
    return [record["seconds"] for record in history[1:]]


def coordinator_run(
    work: Path,
    sites: int,
    config: dict[str, Any],
    server_app: str | None = None,
    site_args: tuple[str, ...] = (),
) -> Run:
    """One run on `hydrafl server` (SQLite store, blobs on disk) with a `hydrafl site` process per site, to its end."""
    env = {**os.environ, "HYDRAFL_HOME": str(work / "home")}
    db = f"sqlite:///{work / 'coordinator.db'}"
    store = Store(db)
    tokens = [store.add_site(f"hospital-{i}")[1] for i in range(sites)]
    address = f"127.0.0.1:{free_port()}"
    hydrafl = [sys.executable, "-m", "hydrafl"]
    log = (work / "processes.log").open("w")
    processes = [
        subprocess.Popen(
            [*hydrafl, "server", "--listen", address, "--db", db, "--blobs", str(work / "blobs")],
            env=env,
            stdout=log,
            stderr=log,
        )
    ]
    processes += [
        subprocess.Popen(
            [*hydrafl, "site", "--coordinator", address, *site_args],
            env={**env, "HYDRAFL_SITE_TOKEN": token},  # as README's users start a site
            stdout=log,
            stderr=log,
        )
        for token in tokens
    ]
    try:
        run_id = store.create_run(config, server_app=server_app).id
        deadline = time.monotonic() + 600
        while (run := store.run(run_id)).status not in ("finished", "failed"):
            if time.monotonic() > deadline:
                raise TimeoutError("the coordinator's run did not finish in 600 s")
            time.sleep(0.5)
        if run.status != "finished":
            raise RuntimeError(f"the coordinator's run failed: {run.detail}")
        return run
    finally:
        for process in processes:
            process.kill()
            process.wait()
        log.close()


def over_grpc(cfg: RunConfig, work: Path) -> list[float]:
    """The driver's seconds of each training round on `hydrafl server` with a `hydrafl site` process per site."""
    run = coordinator_run(
        work,
        cfg.sites,
        {k: v for k, v in cfg.to_flower().items() if k not in ("run-dir", "resume")},
    )
    return [record["seconds"] for record in run.history[1:]]


def stock_over_grpc(rounds: int, work: Path) -> list[float]:
    """The stock app's rounds on `hydrafl server` with `hydrafl site --app` processes, as its ServerApp timed them."""
    times = work / "stock-round-times.json"
    coordinator_run(
        work,
        STOCK_SITES,
        {"num-server-rounds": rounds, ROUND_TIMES_KEY: str(times)},
        server_app=STOCK_SERVER_APP,
        site_args=("--app", STOCK_CLIENT_APP),
    )
    return [float(seconds) for seconds in json.loads(times.read_text())]


def summarise(
    inprocess: list[float],
    grpc: list[float],
    busy: tuple[list[float], list[float]],
    stock_grpc: list[float],
    stock_flower: list[float],
) -> dict[str, Any]:
    overhead = statistics.median(grpc) - statistics.median(inprocess)
    busy_overhead = statistics.median(busy[1]) - statistics.median(busy[0])
    return {
        "benchmark": NAME,
        "inprocess_s": inprocess,
        "grpc_s": grpc,
        "median_inprocess_s": statistics.median(inprocess),
        "median_grpc_s": statistics.median(grpc),
        "overhead_s": overhead,
        "goal_s": GOAL_S,
        "busy_inprocess_s": busy[0],
        "busy_grpc_s": busy[1],
        "busy_overhead_s": busy_overhead,
        "busy_goal_s": BUSY_GOAL_S,
        "goal_met": overhead < GOAL_S and busy_overhead < BUSY_GOAL_S,
        "stock_sites": STOCK_SITES,
        "stock_grpc_s": stock_grpc,
        "stock_flower_s": stock_flower,
        "median_stock_grpc_s": statistics.median(stock_grpc),
        "median_stock_flower_s": statistics.median(stock_flower),
        "stock_flower_over_grpc": statistics.median(stock_flower) / statistics.median(stock_grpc),
    }


@contextmanager
def busy_machine(processes: int) -> Iterator[None]:
    """`processes` background processes, each spinning one core, for as long as the block lasts."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)
    ]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def hydrafl_pair(cfg: RunConfig, console: Console, label: str) -> tuple[list[float], list[float]]:
    """The hydrafl app's rounds in process, then over the coordinator with site processes."""
    with console.status(f"{label}: in-process run"):
        inprocess = in_process(cfg)
    with (
        tempfile.TemporaryDirectory() as work,
        console.status(f"{label}: coordinator run (server + 3 site processes)"),
    ):
        grpc = over_grpc(cfg, Path(work))
    return inprocess, grpc


def plot(summary: dict[str, Any], path: Path) -> None:
    fig, axis = plt.subplots(figsize=(8, 4.5))
    for key, label in RUNTIMES.items():
        axis.plot(range(1, len(summary[key]) + 1), summary[key], marker="o", label=label)
    axis.set_xlabel("round")
    axis.set_ylabel("round seconds (log scale)")
    axis.set_yscale(
        "log"
    )  # Flower's rounds are seconds, hydrafl's tenths: one linear axis would flatten hydrafl's
    axis.set_title(
        f"hydrafl overhead {summary['overhead_s']:.3f} s idle (goal < {GOAL_S} s), "
        f"{summary['busy_overhead_s']:.3f} s busy (< {BUSY_GOAL_S} s); stock app "
        f"Flower / hydrafl {summary['stock_flower_over_grpc']:.1f}x",
        fontsize=10,
    )
    axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = benchmark_parser(__doc__, "3 rounds")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    cfg = run_config(3 if args.quick else args.rounds)
    console = Console()
    inprocess, grpc = hydrafl_pair(cfg, console, "idle")
    with busy_machine(BUSY_PROCESSES):
        busy = hydrafl_pair(cfg, console, "busy")
    with (
        tempfile.TemporaryDirectory() as work,
        console.status(f"stock app on the coordinator ({STOCK_SITES} sites)"),
    ):
        stock_grpc = stock_over_grpc(cfg.rounds, Path(work))
    with (
        tempfile.TemporaryDirectory() as work,
        console.status(f"stock app on Flower ({STOCK_SITES} SuperNodes)"),
    ):
        stock_flower = flower_round_seconds(cfg.rounds, STOCK_SITES, Path(work))
    summary = {
        **summarise(inprocess, grpc, busy, stock_grpc, stock_flower),
        "rounds": cfg.rounds,
        "quick": args.quick,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{NAME}.json").write_text(json.dumps(summary, indent=1))
    plot(summary, args.out / f"{NAME}.png")
    table = Table(title=f"median round seconds, {cfg.rounds} rounds")
    table.add_column("app: runtime")
    table.add_column("median s", justify="right")
    for key, label in RUNTIMES.items():
        table.add_row(label, f"{statistics.median(summary[key]):.3f}")
    console.print(table)
    for key, goal, label in (
        ("overhead_s", GOAL_S, "idle"),
        ("busy_overhead_s", BUSY_GOAL_S, "busy"),
    ):
        met = summary[key] < goal
        console.print(
            f"hydrafl coordinator overhead, {label}: {summary[key]:.3f} s per round, "
            + verdict(met, f"< {goal} s: met", f"BELOW GOAL (< {goal} s)")
        )
    console.print(
        f"stock app, Flower / hydrafl median round: {summary['stock_flower_over_grpc']:.1f}x"
    )


if __name__ == "__main__":
    main()
