"""Prometheus metrics of a coordinator, computed from its database when scraped.

A collector that reads the store, rather than counters the coordinator bumps, stays right across coordinator
restarts and lease takeovers: the counters are the database's, so they never reset. Labels are the run id and a
refusal reason only, never a site token or message id, so the number of series grows with runs, not rounds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from hydrafl.server.dashboard_data import accepted_per_run, refused_per_run, trained_records
from hydrafl.server.store import Store
from hydrafl.server.tables import Run
from hydrafl.server.transport.service import CoordinatorService
from hydrafl.trust import trust_summary

ROUND_BUCKETS_S = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
AGGREGATION_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONNECTED_WITHIN_S = 30.0
"""A site counts as connected when it called within this many seconds (as the round driver counts it)."""


class StoreCollector(Collector):
    """Every `hydrafl_*` metric, read from the store (and, for connected sites, the live service) per scrape."""

    def __init__(self, store: Store, service: CoordinatorService | None = None) -> None:
        self.store = store
        self.service = service

    def collect(self) -> Iterator[Metric]:
        runs = self.store.runs()
        yield self._runs_by_status(runs)
        rounds = CounterMetricFamily(
            "hydrafl_rounds_completed", "Rounds a run has completed.", labels=["run"]
        )
        received = CounterMetricFamily(
            "hydrafl_received_bytes", "Update bytes received from sites.", labels=["run"]
        )
        sent = CounterMetricFamily(
            "hydrafl_sent_bytes", "Model bytes sent to sites.", labels=["run"]
        )
        round_s = HistogramMetricFamily(
            "hydrafl_round_seconds", "Wall time of a training round.", labels=["run"]
        )
        aggregation_s = HistogramMetricFamily(
            "hydrafl_aggregation_seconds",
            "Time the strategy spent aggregating a round.",
            labels=["run"],
        )
        epsilon = GaugeMetricFamily(
            "hydrafl_dp_epsilon",
            "Central DP epsilon a DP run has spent (Renyi DP).",
            labels=["run"],
        )
        exact = GaugeMetricFamily(
            "hydrafl_dp_epsilon_exact",
            "Central DP epsilon a DP run has spent (exact, PLD).",
            labels=["run"],
        )
        for run in runs:
            label = [str(run.id)]
            records = trained_records(run)
            rounds.add_metric(label, run.rounds_done)
            received.add_metric(
                label, sum(record.get("bytes_up") or 0 for record in run.history or [])
            )
            sent.add_metric(
                label, sum(record.get("bytes_down") or 0 for record in run.history or [])
            )
            round_s.add_metric(
                label, *_histogram([record.get("seconds") for record in records], ROUND_BUCKETS_S)
            )
            aggregation_s.add_metric(
                label,
                *_histogram(
                    [record.get("aggregation_s") for record in records], AGGREGATION_BUCKETS_S
                ),
            )
            dp = (
                trust_summary(run.history or [], {} if run.server_app else run.config).get("dp")
                or {}
            )
            for family, spent in ((epsilon, dp.get("epsilon")), (exact, dp.get("epsilon_exact"))):
                if spent is not None:
                    family.add_metric(label, spent)
        yield from (rounds, received, sent, round_s, aggregation_s, epsilon, exact)
        yield from self._updates(runs)
        yield from self._sites()

    def _runs_by_status(self, runs: list[Run]) -> GaugeMetricFamily:
        by_status = Counter(run.status for run in runs)
        gauge = GaugeMetricFamily(
            "hydrafl_runs", "Runs in the database by status.", labels=["status"]
        )
        for status in ("pending", "running", "finished", "failed", "stopped"):
            gauge.add_metric([status], by_status[status])
        return gauge

    def _updates(self, runs: list[Run]) -> Iterator[Metric]:
        accepted = CounterMetricFamily(
            "hydrafl_updates_accepted", "Site replies accepted.", labels=["run"]
        )
        for run_id, count in sorted(accepted_per_run(self.store).items()):
            accepted.add_metric([str(run_id)], count)
        refused = CounterMetricFamily(
            "hydrafl_updates_refused",
            "Site replies refused: by the coordinator (reason = gRPC code) or by the strategy's screening.",
            labels=["run", "reason"],
        )
        for (run_label, reason), count in sorted(refused_per_run(self.store, runs).items()):
            refused.add_metric([run_label, reason], count)
        yield from (accepted, refused)

    def _sites(self) -> Iterator[Metric]:
        sites = self.store.sites()
        enrolled = GaugeMetricFamily(
            "hydrafl_sites_enrolled", "Enrolled sites by status.", labels=["status"]
        )
        enrolled.add_metric(["active"], sum(not site.revoked for site in sites))
        enrolled.add_metric(["revoked"], sum(site.revoked for site in sites))
        yield enrolled
        if self.service is not None:
            connected = len(self.service.connected_nodes(CONNECTED_WITHIN_S))
            help_text = f"Enrolled sites that called within {CONNECTED_WITHIN_S:g} s."
            yield GaugeMetricFamily("hydrafl_sites_connected", help_text, value=connected)


def metrics_text(store: Store, service: CoordinatorService | None = None) -> bytes:
    """The Prometheus text exposition of the coordinator's metrics, built on a registry of its own (not the
    process-wide default one, so tests and two dashboards never see each other's series)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store, service))
    return generate_latest(registry)


def _histogram(
    values: Sequence[float | None], bounds: Sequence[float]
) -> tuple[list[tuple[str, float]], float]:
    """Cumulative buckets (ending in +Inf) and the sum of the values given, as HistogramMetricFamily takes them."""
    observed = [float(value) for value in values if value is not None]
    buckets = [
        (floatToGoString(bound), float(sum(value <= bound for value in observed)))
        for bound in bounds
    ]
    buckets.append(("+Inf", float(len(observed))))
    return buckets, sum(observed)
