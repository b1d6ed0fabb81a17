"""The ServerApp every hydrafl runtime runs (simulation grid, Ray, the coordinator).

It never builds a model and never imports model code (the coordinator handles named arrays only): the
initial arrays come from a site (`query.init`), DiLoCo's curvature probe from sites (`query.curvature`), the
cross-site duplicates from the sites' keyed signatures (`hydrafl.server.dedup`); then the strategy goes to the
round driver.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy

from hydrafl import protocol
from hydrafl.cohort_stats import CombinedStats, SiteStats, StatsError, combine
from hydrafl.config import RunConfig
from hydrafl.rounds import RoundRecord
from hydrafl.secagg import SecAggParams
from hydrafl.server.aggregation.async_driver import AsyncDriver, VirtualClock, WallClock
from hydrafl.server.aggregation.driver import DriverConfig, RoundDriver, RunResult
from hydrafl.server.aggregation.exchange import query
from hydrafl.server.aggregation.screening import Screening
from hydrafl.server.aggregation.stability import OuterSetup, check_spectrum
from hydrafl.server.dedup import SiteDedup, deduplicate_sites
from hydrafl.strategies import build_strategy
from hydrafl.strategies.hooks import BuffersUpdates

log = logging.getLogger(__name__)

server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    run_federation(grid, RunConfig.from_flower(context.run_config))


def build_server_app(cfg: RunConfig) -> ServerApp:
    """A ServerApp bound to `cfg`, for runtimes that start the ServerApp with an empty run_config."""
    app = ServerApp()

    @app.main()
    def bound_main(grid: Grid, context: Context) -> None:
        run_federation(grid, RunConfig.from_flower({**cfg.to_flower(), **context.run_config}))

    return app


def run_federation(
    grid: Grid,
    cfg: RunConfig,
    *,
    on_round: Callable[[RoundRecord], None] | None = None,
    strategy: Strategy | None = None,
    reference_node: int | None = None,
    virtual_speeds: Mapping[int, float] | None = None,
    on_dedup: Callable[[dict[int, SiteDedup]], None] | None = None,
    resident_model_bytes: int | None = None,
) -> RunResult:
    """One federated run of `cfg.strategy` (or of `strategy`, built from `cfg` by the caller to read its
    state afterwards): initial model from a site, optional stability check, rounds. `reference_node` is a
    full-data site of the grid (simulation) that `cfg.diagnostics` compares the averaged delta with.
    `virtual_speeds` (simulation: per node its relative speed) runs an asynchronous strategy on a virtual clock
    instead of the wall clock. With `cfg.dedup` the sites drop their cross-site duplicates first (on a resume
    too: a restarted site has forgotten its list); `on_dedup` receives each site's outcome. A global model
    larger than `resident_model_bytes` stays on disk in the run folder (`DriverConfig`). A `stats` job trains
    nothing: it gathers the sites' cohort statistics."""
    if cfg.job == "stats":
        wait_for_sites(grid, cfg.available_sites, cfg.site_wait_s)
        run_stats(grid, cfg)
        return RunResult(arrays=ArrayRecord(), history=[])
    strategy = strategy or build_strategy(cfg)
    wait_for_sites(grid, cfg.available_sites, cfg.site_wait_s)
    if cfg.dedup:
        outcome = deduplicate_sites(grid, cfg.dedup_threshold)
        if on_dedup is not None:
            on_dedup(outcome)

    def start() -> ArrayRecord:
        initial = request_initial_arrays(grid, cfg)
        if cfg.options.checks_stability():
            check_outer_stability(grid, cfg, initial)
        return initial

    scheme = cfg.scheme
    wire = scheme.to_config() if scheme.enabled else {}  # the one run setting a reply's check needs
    config = DriverConfig(
        num_rounds=cfg.rounds,
        train_config=wire,
        evaluate_config=wire,
        required_sites=cfg.required_sites,
        seed=cfg.seed,
        timeout_s=cfg.round_deadline_s,
        run_dir=Path(cfg.run_dir) if cfg.run_dir else None,
        run_config=cfg.to_flower(),
        run_config_defaults=RunConfig.flower_defaults(cfg.strategy),
        diagnostics=cfg.diagnostics,
        reference_node=reference_node if cfg.diagnostics else None,
        screening=Screening(norm_factor=cfg.screen_norm, min_cosine=cfg.screen_cosine),
        resident_model_bytes=resident_model_bytes,
        secagg=SecAggParams(
            max_weight=cfg.secagg_max_weight,
            reconstruction_threshold=cfg.secagg_threshold,
            dp_clip=cfg.dp_clip,
            dp_noise_multiplier=cfg.dp_noise_multiplier,
            site_clip=cfg.secagg_clip,
        )
        if cfg.secagg
        else None,
    )
    if isinstance(strategy, BuffersUpdates):
        clock = WallClock(grid) if virtual_speeds is None else VirtualClock(grid, virtual_speeds)
        driver = AsyncDriver(
            grid, strategy, config, clock, evaluate_every=cfg.options.evaluate_every
        )
    else:
        driver = RoundDriver(grid, strategy, config)
    return driver.run(start, resume=cfg.resume, on_round=on_round)


def wait_for_sites(grid: Grid, required: int, timeout_s: float) -> list[int]:
    """Sites register asynchronously on real and Ray runtimes; wait for enough of them, with a deadline."""
    deadline = time.monotonic() + timeout_s
    while len(nodes := sorted(grid.get_node_ids())) < required:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"only {len(nodes)} of the {required} required sites connected within {timeout_s:g} s"
            )
        time.sleep(0.2)
    return nodes


def request_initial_arrays(grid: Grid, cfg: RunConfig) -> ArrayRecord:
    """The initial model from the first site, in node-id order, that builds it. A site whose data does not fit
    the run (e.g. a wrong label column) declines and the next one is asked, so one misconfigured site cannot
    fail the run; it fails only when every site declined, with each one's reason."""
    declines = []
    for node in sorted(grid.get_node_ids()):
        asked = query(
            node, protocol.QUERY_INIT, {protocol.LORA_BASES: cfg.options.lora_bases_travel}
        )
        [reply] = grid.send_and_receive([asked])
        if not reply.has_error():
            return next(iter(reply.content.array_records.values()))
        log.warning("site %d declined to build the initial model: %s", node, reply.error.reason)
        declines.append(f"site {node}: {reply.error.reason}")
    raise RuntimeError(
        f"every site declined to build the initial model: {'; '.join(declines) or 'no site connected'}"
    )


def run_stats(grid: Grid, cfg: RunConfig) -> CombinedStats:
    """The `stats` job: every connected site's released statistics, added up and written to the run folder
    (`hydrafl.cohort_stats_report`). A site that declines or sends an unreadable report is listed, not
    counted; the job fails only when no site reports."""
    nodes = sorted(grid.get_node_ids())
    replies = grid.send_and_receive(
        [query(node, protocol.QUERY_STATS) for node in nodes], timeout=cfg.round_deadline_s
    )
    reports, declined = {}, {}
    for reply in replies:
        node = str(reply.metadata.src_node_id)
        try:
            if reply.has_error():
                raise StatsError(reply.error.reason)
            record = reply.content.config_records[protocol.STATS_RECORD]
            reports[node] = SiteStats.from_json(str(record[protocol.STATS_REPORT]))
        except (KeyError, StatsError) as error:
            declined[node] = str(error)[:300]
            log.warning("site %s sent no statistics: %s", node, declined[node])
    if not reports:
        raise RuntimeError(f"no site reported statistics: {declined or 'no site answered'}")
    combined = combine(dict(sorted(reports.items(), key=lambda item: int(item[0]))))
    if cfg.run_dir:
        from hydrafl.cohort_stats_report import write_stats  # matplotlib: only for a stats job

        write_stats(Path(cfg.run_dir), combined, declined)
    log.info("statistics of %d sites: %d records", len(reports), combined.records)
    return combined


def check_outer_stability(grid: Grid, cfg: RunConfig, arrays: ArrayRecord) -> None:
    """Probe each site's curvature and warn before training when the outer optimizer is predicted unstable
    (exact mean-square criterion on the quadratic model; exact for SGD inner steps, indicative otherwise)."""
    messages = [
        query(node, protocol.QUERY_CURVATURE, arrays=arrays) for node in sorted(grid.get_node_ids())
    ]
    probes = [
        reply.content["metrics"]
        for reply in grid.send_and_receive(messages)
        if not reply.has_error()
    ]
    if not probes:
        log.warning("diloco: no site answered the curvature probe; stability not checked")
        return
    setups = [
        OuterSetup(
            inner_lr=cfg.lr,
            curvature=max(float(probe["curvature"]), 1e-12),
            curvature_var=max(float(probe["curvature-var"]), 0.0),
            batch_size=cfg.batch_size,
            local_steps=cfg.local_steps,
            sites=cfg.sites,
            outer_lr=cfg.options.outer_lr,
            momentum=cfg.options.outer_momentum,
            nesterov=cfg.options.outer_nesterov,
        )
        for probe in probes
    ]
    verdict = check_spectrum(setups)
    if cfg.run_dir:
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.run_dir) / "stability.json").write_text(json.dumps(verdict.to_dict(), indent=1))
    if not verdict.stable:
        log.warning(
            "diloco: outer lr %.3g with momentum %.2g is predicted UNSTABLE on the probed curvature "
            "(largest stable outer lr %.3g); lower --outer-lr or --lr, or add sites",
            cfg.options.outer_lr,
            cfg.options.outer_momentum,
            verdict.max_stable_outer_lr,
        )
