"""Many site agents against one coordinator over loopback: rounds complete, errors, round times, coordinator RSS.

    python -m hydrafl.benchmarks.many_sites [--out DIR] [--quick] [--sites N] [--rounds R]

The coordinator is `hydrafl server`'s own loop (`Coordinator.serve_forever`, the gRPC service, SQLite and blobs
in a temp folder) in a fresh process whose RSS and CPU time are sampled every 50 ms. The sites are real
`SiteAgent`s, each with its own token, Context and channel, but as threads of this one process: a process that
imports torch, Flower and hydrafl already holds hundreds of MB (measured below as `site_process_mb`), so 100
site processes would not fit in this machine's memory. Consequences of the threads, not of hydrafl: the
ClientApp calls are serialised by a lock (hydrafl's ClientApp keeps one working model per process, which
concurrent threads would overwrite under each other), gRPC channels of one process share one TCP connection,
and one GIL serves all sites, so round times here are an upper bound on what 100 separate hospitals would see.

The run is a small model (task tabular, 40 samples per site, 2 local steps, fedavg); every site must answer
every round (min_sites 0). Errors are the run's status and detail, `sites_failed` of each round in the run's
history in the store, agents that stopped, and warnings logged on either side.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import psutil
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from rich.console import Console
from rich.table import Table

from hydrafl.benchmarks._common import benchmark_parser
from hydrafl.benchmarks._wire_server import RssSampler, ServerProcess
from hydrafl.config import RunConfig
from hydrafl.server.store import Store

NAME = "many_sites"
MB = 1e6
POLL_S = 0.25


@dataclass(frozen=True, kw_only=True, slots=True)
class Scale:
    sites: int
    rounds: int
    timeout_s: float
    poll_window_s: float
    """After the run: how long to measure the coordinator's CPU while the idle sites only poll."""


FULL = Scale(sites=100, rounds=5, timeout_s=1800, poll_window_s=5.0)
QUICK = Scale(sites=10, rounds=2, timeout_s=240, poll_window_s=1.0)


def workload(scale: Scale) -> RunConfig:
    return RunConfig(
        task="tabular",
        sites=scale.sites,
        samples_per_site=40,
        local_steps=2,
        strategy="fedavg",
        rounds=scale.rounds,
    )


class SerialClientApp(ClientApp):
    """A ClientApp that runs one message at a time: hydrafl's app reloads one per-process model before every
    use, so two agent threads training at once would train each other's weights. Counts the seconds spent
    inside the app, to tell the sites' compute from the coordinator's and the wire's time."""

    def __init__(self, app: ClientApp) -> None:
        super().__init__()
        self.app = app
        self.lock = threading.Lock()
        self.busy_s = 0.0

    def __call__(self, message: Message, context: Context) -> Message:
        with self.lock:
            started = time.perf_counter()
            try:
                return self.app(message=message, context=context)
            finally:
                self.busy_s += time.perf_counter() - started


class WarningCounter(logging.Handler):
    """Counts the warnings and errors the site side logs (retries, ClientApp failures), by message."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.counts: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[f"{record.name}: {record.getMessage()[:160]}"] += 1


def run_benchmark(scale: Scale, work: Path) -> dict[str, Any]:
    cfg = workload(scale)
    db_url = f"sqlite:///{work / 'coordinator.db'}"
    store = Store(db_url)
    tokens = [store.add_site(f"hospital-{i:03d}")[1] for i in range(scale.sites)]
    run_id = store.create_run(
        {k: v for k, v in cfg.to_flower().items() if k not in ("run-dir", "resume")}
    ).id
    coordinator = ServerProcess(
        "coordinator",
        "--serve",
        "--db",
        db_url,
        "--blobs",
        str(work / "blobs"),
        "--runs",
        str(work / "runs"),
        log_path=work / "coordinator.log",
    )
    with coordinator:
        # imported while the coordinator process imports the same: the two start in parallel
        import torch

        from hydrafl.client.agent import SiteAgent
        from hydrafl.client.site_app import client_app

        torch.set_num_threads(1)
        site_process = psutil.Process().memory_info().rss
        coordinator.wait_ready()
        sampler = RssSampler(coordinator.pid).start()
        agents_rss = RssSampler(psutil.Process().pid).start()
        time.sleep(0.5)
        idle = sampler.now()
        cpu_start, sites_cpu_start = cpu_seconds(coordinator.pid), cpu_seconds()
        counter, site_log = WarningCounter(), logging.getLogger("hydrafl")
        site_log.setLevel(logging.WARNING)
        site_log.propagate = False  # counted, not printed
        site_log.addHandler(counter)
        app = SerialClientApp(client_app)
        stop, agent_errors = threading.Event(), []

        def serve(agent: SiteAgent) -> None:
            try:
                agent.run(stop)
            except (
                Exception
            ) as error:  # an agent that stops is an error of this benchmark's run, reported
                agent_errors.append(f"{type(error).__name__}: {error}")

        started = time.monotonic()
        threads = [
            threading.Thread(
                target=serve,
                args=(SiteAgent(coordinator.address, token, app, {}, demo=True),),
                name=f"site-{i}",
                daemon=True,
            )
            for i, token in enumerate(tokens)
        ]
        for thread in threads:
            thread.start()
        progress, run = watch(store, run_id, started, started + scale.timeout_s, threads)
        finished = time.monotonic()
        cpu_s, sites_cpu_s = (
            cpu_seconds(coordinator.pid) - cpu_start,
            cpu_seconds() - sites_cpu_start,
        )
        polling_start = cpu_seconds(coordinator.pid)
        time.sleep(
            scale.poll_window_s
        )  # the run is over: the sites only poll for their next message
        polling_share = (cpu_seconds(coordinator.pid) - polling_start) / scale.poll_window_s
        stop.set()
        for thread in threads:
            thread.join(timeout=max(0.1, finished + 30 - time.monotonic()))
        sampler.stop()
        agents_rss.stop()
        site_log.removeHandler(counter)
        coordinator.stop()
        log_lines = coordinator.log_path.read_text(errors="replace").splitlines()
    rounds = [entry for entry in run.history if entry["round"] >= 1]
    coordinator_warnings = [line for line in log_lines if " WARNING " in line or " ERROR " in line]
    checks = {
        "finished": run.status == "finished",
        "all_rounds": run.rounds_done == scale.rounds and len(rounds) == scale.rounds,
        "no_failed_sites": all(entry["sites_failed"] == 0 for entry in rounds),
        "every_site_every_round": all(entry["sites_ok"] == scale.sites for entry in rounds),
        "no_agent_errors": not agent_errors,
        "agents_stopped": not any(thread.is_alive() for thread in threads),
    }
    peak = sampler.peak()
    return {
        "benchmark": NAME,
        "workload": {k: v for k, v in cfg.to_flower().items() if k not in ("run-dir", "resume")},
        "run": {"status": run.status, "detail": run.detail, "rounds_done": run.rounds_done},
        "wall_s": finished - started,
        "startup_s": progress[0][0] if progress else None,
        "rounds": [
            {
                key: entry[key]
                for key in (
                    "round",
                    "seconds",
                    "gap_s",
                    "aggregation_s",
                    "sites_ok",
                    "sites_failed",
                    "loss",
                    "accuracy",
                    "bytes_up",
                    "bytes_down",
                )
            }
            for entry in rounds
        ],
        "round_s_median": statistics.median(entry["seconds"] for entry in rounds)
        if rounds
        else None,
        "errors": {
            "agent_errors": agent_errors,
            "site_warnings": dict(counter.counts.most_common(10)),
            "site_warnings_total": sum(counter.counts.values()),
            "coordinator_warnings_total": len(coordinator_warnings),
            "coordinator_warnings": coordinator_warnings[:10],
        },
        "coordinator": {
            "idle_mb": idle / MB,
            "peak_mb": peak / MB,
            "peak_extra_mb": (peak - idle) / MB,
            "end_mb": sampler.samples[-1][1] / MB if sampler.samples else None,
            "cpu_s": cpu_s,
            "cpu_share_of_one_core": cpu_s / (finished - started),
            "idle_polling_cpu_share_of_one_core": polling_share,
            "rss_trace": [
                (round(at - started, 2), round(rss / MB, 1)) for at, rss in sampler.samples[::4]
            ],
        },
        "sites_process": {
            "site_process_mb": site_process / MB,
            "peak_mb": agents_rss.peak() / MB,
            "cpu_share_of_one_core": sites_cpu_s / (finished - started),
            "client_app_s": app.busy_s,
            "client_app_share_of_wall": app.busy_s / (finished - started),
            "hundred_processes_gb_estimate": 100 * site_process / 1e9,
            "machine_total_gb": psutil.virtual_memory().total / 1e9,
        },
        "progress": progress,
        "checks": {**checks, "passed": all(checks.values())},
    }


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (this one by default)."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def watch(
    store: Store, run_id: int, started: float, deadline: float, threads: list[threading.Thread]
) -> tuple[list[tuple[float, int]], Any]:
    """Poll the run in the store until it ends, the deadline passes or every agent stopped; returns (seconds
    since start at which each rounds_done count was first seen (round 0 = initial evaluation recorded), run)."""
    progress: list[tuple[float, int]] = []
    seen = -1
    while True:
        run = store.run(run_id)
        done = len(run.history) - 1 if run.history else -1
        if done > seen:
            progress.extend(
                (round(time.monotonic() - started, 2), r) for r in range(seen + 1, done + 1)
            )
            seen = done
        if run.status in ("finished", "failed") or time.monotonic() > deadline:
            return progress, run
        if not any(thread.is_alive() for thread in threads):
            return progress, run
        time.sleep(POLL_S)


def print_tables(summary: dict[str, Any]) -> None:
    console = Console()
    work, run, coordinator, errors = (
        summary["workload"],
        summary["run"],
        summary["coordinator"],
        summary["errors"],
    )
    table = Table(
        title=f"{work['sites']} site agents, {work['task']} {work['strategy']}, {work['rounds']} rounds: run "
        f"{run['status']} ({run['rounds_done']} rounds) in {summary['wall_s']:.1f} s "
        f"(start-up to the initial evaluation {summary['startup_s'] or 0:.1f} s)"
    )
    for column in (
        "round",
        "seconds",
        "gap s",
        "aggregation s",
        "sites ok",
        "sites failed",
        "loss",
        "accuracy",
    ):
        table.add_column(column, justify="right")
    for entry in summary["rounds"]:
        table.add_row(
            str(entry["round"]),
            f"{entry['seconds']:.2f}",
            f"{entry['gap_s']:.2f}",
            f"{entry['aggregation_s']:.3f}",
            str(entry["sites_ok"]),
            str(entry["sites_failed"]),
            f"{entry['loss'] or 0:.4f}",
            f"{entry['accuracy'] or 0:.4f}",
        )
    console.print(table)
    console.print(
        f"coordinator RSS: idle {coordinator['idle_mb']:.0f} MB, peak {coordinator['peak_mb']:.0f} MB "
        f"(+{coordinator['peak_extra_mb']:.0f} MB); CPU {coordinator['cpu_s']:.1f} s "
        f"({100 * coordinator['cpu_share_of_one_core']:.0f}% of one core; "
        f"{100 * coordinator['idle_polling_cpu_share_of_one_core']:.0f}% with the run over and the sites only "
        f"polling). Site process: {summary['sites_process']['site_process_mb']:.0f} MB before any agent, peak "
        f"{summary['sites_process']['peak_mb']:.0f} MB with all of them, "
        f"{100 * summary['sites_process']['cpu_share_of_one_core']:.0f}% of one core, "
        f"{summary['sites_process']['client_app_s']:.1f} s inside the ClientApp (serialised)"
    )
    ok = summary["checks"]["passed"]
    console.print(
        f"checks: {'[green]PASS[/]' if ok else '[red]FAIL[/]'} {summary['checks']}; agent errors "
        f"{len(errors['agent_errors'])}, site warnings {errors['site_warnings_total']}, coordinator warnings "
        f"{errors['coordinator_warnings_total']}"
    )
    if run["detail"]:
        console.print(f"run detail: {run['detail']}")


def plot(summary: dict[str, Any], path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    rounds = summary["rounds"]
    numbers = [entry["round"] for entry in rounds]
    left.bar(
        numbers,
        [entry["seconds"] for entry in rounds],
        color="tab:blue",
        label="round (train + evaluate)",
    )
    left.bar(
        numbers,
        [entry["gap_s"] for entry in rounds],
        bottom=[entry["seconds"] for entry in rounds],
        color="tab:gray",
        label="gap before the round",
    )
    left.set_xlabel("round")
    left.set_ylabel("seconds")
    left.set_title(
        f"{summary['workload']['sites']} sites: {summary['run']['status']}, "
        f"{sum(entry['sites_failed'] for entry in rounds)} failed site-rounds"
    )
    left.legend()
    trace = summary["coordinator"]["rss_trace"]
    right.plot(
        [at for at, _ in trace],
        [rss for _, rss in trace],
        color="tab:blue",
        label="coordinator RSS",
    )
    for at, number in summary["progress"]:
        right.axvline(at, color="gray", linestyle=":", linewidth=0.8)
        right.annotate(
            str(number), (at, 0.02), xycoords=("data", "axes fraction"), fontsize="small"
        )
    right.set_xlabel(
        "seconds since the agents started (dotted: round recorded; 0 = initial evaluation)"
    )
    right.set_ylabel("MB")
    right.set_title(
        f"coordinator RSS: idle {summary['coordinator']['idle_mb']:.0f} MB, "
        f"peak {summary['coordinator']['peak_mb']:.0f} MB"
    )
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = benchmark_parser(__doc__, str(QUICK))
    parser.add_argument("--sites", type=int, help="override the number of sites")
    parser.add_argument("--rounds", type=int, help="override the number of rounds")
    args = parser.parse_args()
    scale = QUICK if args.quick else FULL
    scale = dataclasses.replace(
        scale, sites=args.sites or scale.sites, rounds=args.rounds or scale.rounds
    )
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="hydrafl-sites-") as tmp:
        summary = {"quick": args.quick, **run_benchmark(scale, Path(tmp))}
    (args.out / f"{NAME}.json").write_text(json.dumps(summary, indent=1))
    plot(summary, args.out / f"{NAME}.png")
    print_tables(summary)


if __name__ == "__main__":
    main()
