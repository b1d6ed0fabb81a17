"""What the dashboard page and `/metrics` read, gathered in one place so both show the same numbers.

Everything comes from the coordinator's database at request time (runs and their round histories, sites, audit
events), so a restarted coordinator shows the same history; only what the database does not keep comes from the
live service: when each site last called, and the push latencies of the run being driven (a finished run's are
in its folder's push_latency.tsv). Audit counts are grouped in SQL, so a database of months of rounds is read in
a few small queries, not row by row.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import InstrumentedAttribute, defer

from hydrafl.bounded import MAX_DETAIL_CHARS, marked
from hydrafl.cohort_stats import CombinedStats, SiteStats, combine
from hydrafl.server.store import Store
from hydrafl.server.tables import AuditEvent, Run
from hydrafl.server.transport.service import CoordinatorService

NO_RUN = "none"
"""The `run` label of refusals that no run can be named for (an upload with nothing to answer)."""
SCREENING = "screening"
"""The refusal reason of replies the strategy's screening rejected (the gRPC code names the others)."""
REASON_CHARS = 32
"""An `update-rejected` detail's reason label is its gRPC code, read from this prefix of the detail."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SiteRow:
    """One enrolled site as the dashboard lists it; bytes and counts summed over every run."""

    name: str
    node_id: int
    revoked: bool
    seen_s_ago: float | None
    """Seconds since its last call to this coordinator process; None when it has not called since the start."""
    last_event_at: datetime | None
    """Its latest audit event (any coordinator process): when it was last heard of across restarts."""
    bytes_up: int
    bytes_down: int
    accepted: int
    refused: int
    """Replies the coordinator refused (an audit `update-rejected`) plus those screening rejected."""
    declined: int
    """Messages the site itself declined or failed (an audit `site-declined`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AuditRow:
    """One audit row as the page shows it, its detail cut to MAX_DETAIL_CHARS when it was read."""

    at: datetime
    last_at: datetime | None
    kind: str
    site_name: str
    run_id: int | None
    server_round: int | None
    count: int
    detail: str


@dataclass(frozen=True, kw_only=True, slots=True)
class LatencyRow:
    """One site's P50/P99 of one call (PutChunks stream or PushReply) over a run."""

    site: str
    call: str
    count: int
    p50_ms: float
    p99_ms: float


def trained_records(run: Run) -> list[dict]:
    """The run's training rounds (round 0 is the initial evaluation), oldest first."""
    return [record for record in run.history or [] if record.get("round", 0) > 0]


def refusal_reason(detail: str) -> str:
    """An `update-rejected` event's reason label from its detail: the gRPC status code, lower case (a handful of
    values, where the free text after it would make a label per message)."""
    code = detail.partition(":")[0].strip()
    return code.lower() if code.isupper() and code.replace("_", "").isalpha() else "other"


def accepted_per_run(store: Store) -> dict[int, int]:
    """Accepted replies (audit `update-accepted`) by run id."""
    return {
        run_id: n
        for run_id, n in _count_by(store, AuditEvent.run_id, "update-accepted")
        if run_id is not None
    }


def refused_per_run(store: Store, runs: list[Run]) -> Counter[tuple[str, str]]:
    """Refused replies by (run label, reason): the coordinator's refusals by gRPC code, and `screening`."""
    refused: Counter[tuple[str, str]] = Counter()
    with store.session() as session:
        reason = func.substr(
            AuditEvent.detail, 1, REASON_CHARS
        )  # never a whole detail: rows may be old and long
        query = (
            select(AuditEvent.run_id, reason, func.sum(AuditEvent.count))
            .where(AuditEvent.kind == "update-rejected")
            .group_by(AuditEvent.run_id, reason)
        )
        for run_id, detail, count in session.execute(query):
            label = NO_RUN if run_id is None else str(run_id)
            refused[label, refusal_reason(detail)] += int(count)
    for run in runs:
        screened = sum(
            len(record.get("rejected_per_site") or {}) for record in trained_records(run)
        )
        if screened:
            refused[str(run.id), SCREENING] += screened
    return refused


def site_rows(store: Store, runs: list[Run], service: CoordinatorService | None) -> list[SiteRow]:
    """Every enrolled site with its traffic and its accepted, refused and declined replies."""
    up: Counter[str] = Counter()
    down: Counter[str] = Counter()
    screened: Counter[str] = Counter()
    for run in runs:
        for record in trained_records(run):
            up.update(record.get("bytes_up_per_site") or {})
            down.update(record.get("bytes_down_per_site") or {})
            screened.update((record.get("rejected_per_site") or {}).keys())
    counts = {
        kind: dict(_count_by(store, AuditEvent.site_name, kind))
        for kind in ("update-accepted", "update-rejected", "site-declined")
    }
    with store.session() as session:
        when = func.coalesce(
            AuditEvent.last_at, AuditEvent.at
        )  # a row of counted refusals: the last one
        latest = select(AuditEvent.site_name, func.max(when)).group_by(AuditEvent.site_name)
        last_events = dict(session.execute(latest).all())
    seen = service.seconds_since_seen() if service is not None else {}
    rows = []
    for site in store.sites():
        node = str(site.node_id)
        rows.append(
            SiteRow(
                name=site.name,
                node_id=site.node_id,
                revoked=site.revoked,
                seen_s_ago=seen.get(site.node_id),
                last_event_at=last_events.get(site.name),
                bytes_up=up[node],
                bytes_down=down[node],
                accepted=counts["update-accepted"].get(site.name, 0),
                refused=counts["update-rejected"].get(site.name, 0) + screened[node],
                declined=counts["site-declined"].get(site.name, 0),
            )
        )
    return rows


def audit_tail(store: Store, limit: int, run_id: int | None = None) -> list[AuditRow]:
    """The latest `limit` audit rows, newest first (of one run when `run_id` is given). Each detail is cut to
    MAX_DETAIL_CHARS in SQL: a row an older coordinator wrote may hold megabytes, and is never loaded whole."""
    detail_head, detail_chars = (
        func.substr(AuditEvent.detail, 1, MAX_DETAIL_CHARS),
        func.length(AuditEvent.detail),
    )
    query = (
        select(AuditEvent, detail_head, detail_chars)
        .options(defer(AuditEvent.detail))
        .order_by(AuditEvent.id.desc())
        .limit(limit)
    )
    if run_id is not None:
        query = query.where(AuditEvent.run_id == run_id)
    with store.session() as session:
        rows = session.execute(query).all()
    return [
        AuditRow(
            at=event.at,
            last_at=event.last_at,
            kind=event.kind,
            site_name=event.site_name,
            run_id=event.run_id,
            server_round=event.server_round,
            count=event.count,
            detail=marked(head, size - len(head)),
        )
        for event, head, size in rows
    ]


def push_latencies(
    run: Run, runs_dir: Path, service: CoordinatorService | None
) -> list[LatencyRow]:
    """A run's push latencies: live from the service while this process drives it, else its push_latency.tsv."""
    if run.status == "running" and service is not None:
        table = service.latency_table()
    else:
        path = runs_dir / str(run.id) / "push_latency.tsv"
        table = path.read_text() if path.is_file() else ""
    rows = []
    for line in table.splitlines()[1:]:
        site, call, count, p50_ms, p99_ms = line.split("\t")
        rows.append(
            LatencyRow(
                site=site, call=call, count=int(count), p50_ms=float(p50_ms), p99_ms=float(p99_ms)
            )
        )
    return rows


def _count_by(store: Store, column: InstrumentedAttribute[Any], kind: str) -> list[tuple]:
    """(value of `column`, number of audit events of `kind`) pairs; a row of counted refusals counts `count`."""
    with store.session() as session:
        query = (
            select(column, func.sum(AuditEvent.count))
            .where(AuditEvent.kind == kind)
            .group_by(column)
        )
        return [(value, int(total)) for value, total in session.execute(query)]


def cohort_stats(run: Run, runs_dir: Path) -> CombinedStats | None:
    """A stats job's combined statistics, read back from its stats.json (each site's report checked again, as
    any value from outside); None while there are none or when the file cannot be read."""
    path = runs_dir / str(run.id) / "stats.json"
    try:
        sites = json.loads(path.read_text())["sites"]
        return combine({str(site): SiteStats.from_json(json.dumps(v)) for site, v in sites.items()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
