"""`hydrafl simulate`: the same federation, run once per strategy, on the in-process grid or on Ray."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from flwr.serverapp.strategy import Strategy
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from hydrafl.client.site_app import client_app, run_cohort
from hydrafl.client.site_pipeline import PipelineApp
from hydrafl.client.site_policy import PolicyError, SitePolicy, load_policy
from hydrafl.config import RUN_WIDE_KEYS, RunConfig
from hydrafl.rounds import RoundRecord
from hydrafl.run_folders import claim
from hydrafl.server.aggregation.async_driver import simulated_speeds
from hydrafl.server.dedup import SiteDedup
from hydrafl.server.server_app import build_server_app, run_federation
from hydrafl.simulation.attacks import Attack, AttackedGrid
from hydrafl.simulation.grid import FIRST_NODE_ID, InProcessGrid
from hydrafl.simulation.report import write_report
from hydrafl.simulation_config import SimulationConfig
from hydrafl.strategies import build_strategy
from hydrafl.strategies.hooks import PlansSubnetworks
from hydrafl.tracking import Tracker, TrackTarget
from hydrafl.trust import trust_summary
from hydrafl.validation import ConfigError

OnRound = Callable[[RoundRecord], None]


def compare_strategies(config: SimulationConfig, *, show_progress: bool = True) -> dict[str, Any]:
    """Run every strategy of `config`, write results.json, report.md, plots and rounds.tsv to `config.out`."""
    out = Path(config.out)
    policy = _site_policy(config.site_policy)
    run_cohort(config.run)  # bad data fails here, once, with the file's own error message
    claim(out, config.run.resume)
    results: dict[str, Any] = {
        "config": {
            **{key: value for key, value in config.run.flat().items() if key in RUN_WIDE_KEYS},
            "strategies": list(config.strategies),
            "knobs": dict(config.knobs),
            "backend": config.backend,
            "attack": config.attack,
            "attackers": config.attackers,
            "site_policy": config.site_policy,
        },
        "strategies": {},
    }
    attack = (
        Attack(name=config.attack, fraction=config.attackers, seed=config.run.seed)
        if config.attack
        else None
    )
    columns = (
        TextColumn("{task.description:<14}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
    )
    stats = _cohort_stats(config, policy) if config.stats else []
    trackers: list[Tracker] = []
    with (
        Progress(*columns, TimeElapsedColumn(), disable=not show_progress) as progress,
        ExitStack() as closing,
    ):
        for strategy in config.strategies:
            run_cfg = config.run_config(strategy)
            task = progress.add_task(strategy, total=run_cfg.rounds, status="")
            tracker = _open_tracker(config, strategy, run_cfg)
            if tracker is not None:
                trackers.append(tracker)
                closing.callback(tracker.close)

            def on_round(
                record: RoundRecord,
                task: Any = task,
                strategy: str = strategy,
                total: int = run_cfg.rounds,
                tracker: Tracker | None = tracker,
            ) -> None:
                if tracker is not None:
                    tracker.log_round(record)
                status = (
                    f"loss {record.loss:.3f} acc {record.accuracy:.3f}"
                    if record.loss is not None
                    else ""
                )
                progress.update(task, completed=record.round, status=status)
                if (
                    show_progress and not progress.console.is_terminal
                ):  # a log file gets a line per round
                    progress.console.print(
                        f"{strategy} round {record.round}/{total}: {status or 'no evaluation'}, "
                        f"{record.sites_ok} sites, {record.seconds:.1f} s",
                        highlight=False,
                    )

            started = time.perf_counter()
            built = build_strategy(run_cfg) if config.backend == "inprocess" else None
            dedup: dict[int, SiteDedup] = {}
            history = run_strategy(
                run_cfg,
                config.backend,
                on_round=on_round,
                strategy=built,
                attack=attack,
                policy=policy,
                workers=config.workers,
                on_dedup=dedup.update,
            )
            if config.backend == "ray" and tracker is not None:  # Flower's engine calls no on_round
                for entry in history:
                    tracker.log_round(RoundRecord(**entry))
            results["strategies"][strategy] = {
                "seconds": time.perf_counter() - started,
                "lora_rank": run_cfg.lora_rank,
                "rounds": history,
                "trust": trust_summary(history, run_cfg.flat()),
                **({"dedup": _dedup_summary(dedup)} if dedup else {}),
            }
            if isinstance(
                built, PlansSubnetworks
            ):  # per round, per site; bytes per site are in the round records
                results["strategies"][strategy]["trainable_params_per_site"] = (
                    built.trainable_params
                )
        written = write_report(out, results) + stats
        for tracker in trackers:
            tracker.log_artifacts(written)
    return results


def _cohort_stats(config: SimulationConfig, policy: SitePolicy) -> list[Path]:
    """`--stats`: the `stats` job on the in-process grid, before any training, into OUT/stats; the files."""
    folder = Path(config.out) / "stats"
    cfg = config.run_config(config.strategies[0]).replace(job="stats", run_dir=str(folder))
    run_strategy(cfg, "inprocess", policy=policy)
    return sorted(folder.glob("stats*"))


def _open_tracker(config: SimulationConfig, strategy: str, run_cfg: RunConfig) -> Tracker | None:
    """`--track`'s tracker for one strategy's run, named OUT/STRATEGY, its parameters the run's keys."""
    if not config.track:
        return None
    name = f"{Path(config.out).name}/{strategy}"
    return TrackTarget.parse(config.track).open(name, run_cfg.to_flower())


def run_strategy(
    cfg: RunConfig,
    backend: str,
    *,
    on_round: OnRound | None = None,
    strategy: Strategy | None = None,
    attack: Attack | None = None,
    policy: SitePolicy = SitePolicy(),
    workers: int = 1,
    on_dedup: Callable[[dict[int, SiteDedup]], None] | None = None,
) -> list[dict[str, Any]]:
    """One strategy's run; returns its per-round history (round 0 is the initial model's evaluation).
    `strategy` (in-process only) is the caller's own instance of `cfg.strategy`, to read its state after;
    `attack` (in-process only): some sites send forged updates (`simulation.attacks`); `policy`: every site's
    site policy; `workers` (in-process only): the grid's worker processes (0: one per core), the same results
    whatever their number; `on_dedup` (in-process only) receives the deduplication's outcome per site."""
    torch.set_num_threads(
        1
    )  # tiny per-site models: one thread is faster and never oversubscribes a small box
    if backend == "inprocess":
        # a site training on several processes (--nproc) is parallel already, and a forked worker may not start them
        sites = {
            "pooled_site": cfg.diagnostics,
            "policy": policy,
            "workers": 1 if cfg.nproc > 1 else workers,
        }
        grid = (
            AttackedGrid(client_app, cfg.sites, cfg.to_flower(), attack=attack, **sites)
            if attack
            else InProcessGrid(client_app, cfg.sites, cfg.to_flower(), **sites)
        )
        with grid:  # ends its worker processes
            return run_federation(
                grid,
                cfg,
                on_round=on_round,
                strategy=strategy,
                reference_node=grid.reference_node,
                virtual_speeds=simulated_speeds(grid.contexts, cfg.speed_list),
                on_dedup=on_dedup,
            ).history
    if strategy is not None or attack is not None:
        raise ValueError(
            "a strategy instance or an attack can only be passed to the inprocess backend"
        )
    if cfg.dedup:
        raise ConfigError(
            "--dedup runs on the inprocess backend, whose sites hold the simulated consortium's key"
        )
    if backend == "ray":
        return _run_on_ray(cfg, policy)
    raise ValueError(f"unknown backend {backend!r}; choose inprocess or ray")


def _dedup_summary(outcome: dict[int, SiteDedup]) -> dict[str, dict[str, int]]:
    """Per simulated site (its partition), its training records and how many deduplication dropped."""
    return {
        str(node - FIRST_NODE_ID): {"records": site.records, "dropped": site.dropped}
        for node, site in sorted(outcome.items())
    }


def _site_policy(path: str) -> SitePolicy:
    """The simulated sites' policy: the file's, or none; a bad file is a configuration error that names it."""
    try:
        return load_policy(path) if path else SitePolicy()
    except PolicyError as error:
        raise ConfigError(f"site-policy: {error}") from None


def _run_on_ray(cfg: RunConfig, policy: SitePolicy = SitePolicy()) -> list[dict[str, Any]]:
    """The same ServerApp and ClientApp through Flower's simulation engine (needs `hydrafl[ray]`); each site
    answers through the site pipeline (`PipelineApp`: its `policy`, secure aggregation), as on the in-process grid."""
    try:
        import ray  # noqa: F401  (only to fail early with an actionable message)
        from flwr.simulation import run_simulation

        from hydrafl.simulation.ray_start import start_ray
    except ImportError as error:
        raise RuntimeError(
            "--backend ray needs the ray extra: pip install 'hydrafl[ray]'"
        ) from error
    if not cfg.run_dir:
        raise ValueError(
            "the ray backend reads the run's history back from its run_dir; set run_dir"
        )
    history_file = Path(cfg.run_dir) / "history.json"
    if not cfg.resume:
        history_file.unlink(
            missing_ok=True
        )  # never mistake an earlier run's history for this one's
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    start_ray(os.cpu_count() or 1)
    run_simulation(
        server_app=build_server_app(cfg),
        client_app=PipelineApp(client_app, policy, cfg.to_flower()),
        num_supernodes=cfg.sites,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0}
        },  # Ray itself: start_ray
    )
    history = json.loads(history_file.read_text()) if history_file.exists() else []
    if len(history) != cfg.rounds + 1:
        raise RuntimeError(
            f"the Ray run of {cfg.strategy} stopped after {max(len(history) - 1, 0)} of {cfg.rounds} rounds; "
            "see the log above for the ServerApp's error"
        )
    return history
