"""The dashboard's one HTML page, rendered on the server: no script, no framework, nothing fetched from elsewhere.

Curves are inline SVG polylines, so the page works offline in a hospital network and under a Content Security
Policy that allows no script at all. Every value read from the database (site names, run configs, audit
details a site's error text ends up in) goes through `html.escape`: a site could otherwise inject markup.

The page has a size bound whatever the database holds (MAX_PAGE_CHARS): every text cell is cut
(`hydrafl.bounded`), and each table lists a bounded number of rows (the latest runs, audit rows and rounds).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from html import escape
from pathlib import Path

from hydrafl.bounded import MAX_DETAIL_CHARS, bounded
from hydrafl.cohort_stats import CombinedStats, SiteStats, histogram_quantile
from hydrafl.rounds import megabytes
from hydrafl.server.dashboard_data import (
    AuditRow,
    LatencyRow,
    SiteRow,
    audit_tail,
    cohort_stats,
    push_latencies,
    site_rows,
    trained_records,
)
from hydrafl.server.store import Store
from hydrafl.server.tables import Run
from hydrafl.server.transport.service import CoordinatorService
from hydrafl.trust import trust_lines, trust_summary

REFRESH_S = 30
SHOWN_ROUNDS = 50
"""The round table lists the last rounds only; the curves draw every round."""
SHOWN_EVENTS = 100
SHOWN_RUNS = 100
SHOWN_SITES = 500
CELL_CHARS = 100
"""A name or label in a table cell (site names, strategies, tasks) is cut to this; details to MAX_DETAIL_CHARS."""
MAX_PAGE_CHARS = 2_000_000
"""What the page can reach with every table full and every cell at its cut, each character escaped to six (about
1.2 M): a database written by a hostile site (or by a coordinator from before the cuts) renders within it."""
CURVE_WIDTH, CURVE_HEIGHT, CURVE_PAD = 420, 180, 40
MARKED_POINTS = 60
"""Curves of up to this many rounds also mark each round with a dot (a one-round polyline draws nothing)."""
STATUSES = ("pending", "running", "finished", "failed", "stopped")
STYLE = """
body{font:14px system-ui,sans-serif;margin:24px;color:#1b1f24;background:#fafbfc}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}table{border-collapse:collapse;margin:8px 0}
th,td{padding:3px 10px;border-bottom:1px solid #dde;text-align:right}th{background:#eef1f5}
td.text,th.text{text-align:left}.muted{color:#667}.running{color:#0a6}.failed{color:#c22}.finished{color:#235}.stopped{color:#a60}
.curves{display:flex;gap:16px;flex-wrap:wrap}svg{background:#fff;border:1px solid #dde}
"""


def render_page(
    store: Store, runs_dir: Path, service: CoordinatorService | None, run_id: int | None
) -> str:
    """The whole page: runs, the chosen run (default: the one running, else the newest), sites, the audit log.
    Raises ValueError for a run id the database does not have."""
    runs = store.runs()
    chosen = store.run(run_id) if run_id is not None else _default_run(runs)
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    body = [
        f"<h1>hydrafl coordinator</h1><p class='muted'>generated {generated}; refreshes every {REFRESH_S} s; "
        "<a href='/'>runs</a> · <a href='/metrics'>metrics</a></p>",
        _runs_table(runs, chosen),
        _run_section(chosen, runs_dir, service)
        if chosen is not None
        else "<p class='muted'>no runs yet</p>",
        _sites_table(site_rows(store, runs, service)),
        _audit_table(audit_tail(store, SHOWN_EVENTS)),
    ]
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        f"<meta http-equiv='refresh' content='{REFRESH_S}'><title>hydrafl coordinator</title>"
        f"<style>{STYLE}</style></head><body>{''.join(body)}</body></html>"
    )


def svg_curve(points: Sequence[tuple[float, float | None]], *, title: str, color: str) -> str:
    """(round, value) pairs as an SVG polyline scaled to the plot, with the value range and rounds on the axes;
    rounds without a finite value are left out."""
    finite = [(float(x), float(y)) for x, y in points if y is not None and math.isfinite(y)]
    if not finite:
        return f"<p class='muted'>{escape(title)}: no values yet</p>"
    xs, ys = [x for x, _ in finite], [y for _, y in finite]
    x_span, y_span = (max(xs) - min(xs)) or 1.0, (max(ys) - min(ys)) or 1.0
    inner_w, inner_h = CURVE_WIDTH - 2 * CURVE_PAD, CURVE_HEIGHT - 2 * CURVE_PAD
    bottom, right = CURVE_HEIGHT - CURVE_PAD, CURVE_WIDTH - CURVE_PAD
    scaled = [
        (CURVE_PAD + (x - min(xs)) / x_span * inner_w, bottom - (y - min(ys)) / y_span * inner_h)
        for x, y in finite
    ]
    coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in scaled)
    dots = "".join(f"<circle cx='{x:.1f}' cy='{y:.1f}' r='2.5' fill='{color}'/>" for x, y in scaled)
    return (
        f"<svg class='curve' width='{CURVE_WIDTH}' height='{CURVE_HEIGHT}' role='img' aria-label='{escape(title)}'>"
        f"<text x='{CURVE_PAD}' y='16' font-size='13'>{escape(title)}</text>"
        f"<line x1='{CURVE_PAD}' y1='{bottom}' x2='{right}' y2='{bottom}' stroke='#99a'/>"
        f"<line x1='{CURVE_PAD}' y1='{CURVE_PAD}' x2='{CURVE_PAD}' y2='{bottom}' stroke='#99a'/>"
        f"<text x='2' y='{CURVE_PAD + 4}' font-size='10'>{_number(max(ys))}</text>"
        f"<text x='2' y='{bottom}' font-size='10'>{_number(min(ys))}</text>"
        f"<text x='{CURVE_PAD}' y='{bottom + 14}' font-size='10'>round {int(min(xs))}</text>"
        f"<text x='{right - 50}' y='{bottom + 14}' font-size='10'>round {int(max(xs))}</text>"
        f"<polyline points='{coords}' fill='none' stroke='{color}' stroke-width='2'/>"
        f"{dots if len(scaled) <= MARKED_POINTS else ''}</svg>"
    )


def _default_run(runs: list[Run]) -> Run | None:
    running = [run for run in runs if run.status == "running"]
    return (running or runs)[-1] if runs else None


def _runs_table(runs: list[Run], chosen: Run | None) -> str:
    rows = []
    for run in reversed(runs[-SHOWN_RUNS:]):
        what = f"ServerApp {run.server_app}" if run.server_app else str(run.config.get("strategy"))
        marker = " ◀" if chosen is not None and run.id == chosen.id else ""
        rows.append(
            [
                f"<a href='/runs/{run.id}'>{run.id}</a>{marker}",
                _cell(what),
                _cell(run.config.get("task", "-")),
                _status(run.status),
                f"{run.rounds_done}/{_text(run.total_rounds)}",
                _time(run.created_at),
                _time(run.finished_at),
            ]
        )
    headers = ["run", "strategy or app", "task", "status", "rounds", "created", "finished"]
    earlier = f", the latest {SHOWN_RUNS} of {len(runs)}" if len(runs) > SHOWN_RUNS else ""
    return f"<h2>Runs{earlier}</h2>" + _table(headers, rows, text_columns=(1, 2, 3))


def _run_section(run: Run, runs_dir: Path, service: CoordinatorService | None) -> str:
    records = trained_records(run)
    parts = [
        f"<h2 id='run'>Run {run.id}: {_status(run.status)}, {run.rounds_done}/{_text(run.total_rounds)} rounds</h2>"
    ]
    if run.detail:
        parts.append(f"<p>{_cell(run.detail, MAX_DETAIL_CHARS)}</p>")
    if run.config.get("job") == "stats":
        parts.append(_stats_table(cohort_stats(run, runs_dir)))
        return "".join(parts)
    trust = trust_summary(run.history or [], {} if run.server_app else run.config)
    parts.extend(
        f"<p class='privacy'>{_cell(line, MAX_DETAIL_CHARS)}</p>" for line in trust_lines(trust)
    )
    curves = [
        svg_curve([(r["round"], r.get("loss")) for r in records], title="loss", color="#c33"),
        svg_curve(
            [(r["round"], r.get("accuracy")) for r in records], title="accuracy", color="#27a"
        ),
        svg_curve(
            [(r["round"], r.get("seconds")) for r in records], title="round seconds", color="#585"
        ),
    ]
    if "dp" in trust:
        curves.append(
            svg_curve(
                [(r["round"], r.get("dp_epsilon")) for r in records],
                title="DP epsilon",
                color="#a5a",
            )
        )
        curves.append(
            svg_curve(
                [(r["round"], r.get("dp_epsilon_exact")) for r in records],
                title="DP epsilon, exact (PLD)",
                color="#759",
            )
        )
    parts.append(f"<div class='curves'>{''.join(curves)}</div>")
    parts.append(_rounds_table(records, dp="dp" in trust))
    parts.append(_latency_table(push_latencies(run, runs_dir, service)))
    return "".join(parts)


def _rounds_table(records: list[dict], *, dp: bool) -> str:
    shown = records[-SHOWN_ROUNDS:]
    headers = [
        "round",
        "loss",
        "accuracy",
        "sites ok",
        "failed",
        "round s",
        "aggregation s",
        "gap s",
        "MB up",
        "MB down",
        *(["epsilon", "epsilon exact"] if dp else []),
    ]
    rows = [
        [
            str(r["round"]),
            _number(r.get("loss")),
            _number(r.get("accuracy")),
            _text(r.get("sites_ok")),
            _text(r.get("sites_failed")),
            _seconds(r.get("seconds")),
            _seconds(r.get("aggregation_s")),
            _seconds(r.get("gap_s")),
            megabytes(r.get("bytes_up")),
            megabytes(r.get("bytes_down")),
            *([_number(r.get("dp_epsilon")), _number(r.get("dp_epsilon_exact"))] if dp else []),
        ]
        for r in reversed(shown)
    ]
    earlier = f", the last {len(shown)} of {len(records)}" if len(records) > len(shown) else ""
    return f"<h2>Rounds{earlier}</h2>" + _table(headers, rows, css="rounds")


def _stats_table(stats: CombinedStats | None) -> str:
    """A stats job's records and labels per site and combined, and each histogram's median (stats.md in the
    run's folder has every quantile)."""
    if stats is None:
        return "<h2>Cohort statistics</h2><p class='muted'>none yet</p>"
    reports = list(stats.sites.values())

    def count(value: int | None, report: SiteStats) -> str:
        return f"&lt;{report.release.min_cell_count}" if value is None else str(value)

    rows = [["records", *(count(r.records, r) for r in reports), str(stats.records)]]
    for value, total in stats.categories.get("label", {}).items():
        cells = [count(r.categories.get("label", {}).get(value), r) for r in reports]
        rows.append([_cell(f"label {value}"), *cells, str(total)])
    for name, histogram in stats.histograms.items():
        medians = [r.histograms.get(name) for r in reports]
        cells = [_number(histogram_quantile(h, 0.5)) if h else "-" for h in medians]
        rows.append([_cell(f"{name} median"), *cells, _number(histogram_quantile(histogram, 0.5))])
    headers = ["", *(f"site {site}" for site in stats.sites), "all"]
    return "<h2>Cohort statistics</h2>" + _table(headers, rows, text_columns=(0,))


def _latency_table(rows: list[LatencyRow]) -> str:
    if not rows:
        return "<h2>Push latency</h2><p class='muted'>none recorded for this run</p>"
    cells = [
        [_cell(r.site), _cell(r.call), str(r.count), f"{r.p50_ms:.1f}", f"{r.p99_ms:.1f}"]
        for r in rows
    ]
    return "<h2>Push latency</h2>" + _table(
        ["site", "call", "count", "P50 ms", "P99 ms"], cells, text_columns=(0, 1)
    )


def _sites_table(sites: list[SiteRow]) -> str:
    rows = []
    for site in sites[:SHOWN_SITES]:
        seen = "-" if site.seen_s_ago is None else f"{site.seen_s_ago:.0f} s ago"
        rows.append(
            [
                _cell(site.name),
                str(site.node_id),
                "revoked" if site.revoked else "active",
                seen,
                _time(site.last_event_at),
                megabytes(site.bytes_up),
                megabytes(site.bytes_down),
                str(site.accepted),
                str(site.refused),
                str(site.declined),
            ]
        )
    headers = [
        "site",
        "node id",
        "status",
        "last call",
        "last event",
        "train MB up",
        "train MB down",
        "accepted",
        "refused",
        "declined",
    ]
    first = f", the first {SHOWN_SITES} of {len(sites)}" if len(sites) > SHOWN_SITES else ""
    return f"<h2>Sites{first}</h2>" + _table(headers, rows, text_columns=(0, 2))


def _audit_table(events: list[AuditRow]) -> str:
    """Refusals of one site in one round are one row: its count, the first and the last time."""
    rows = [
        [
            _time(e.at),
            _time(e.last_at),
            _cell(e.kind),
            _cell(e.site_name),
            _text(e.run_id),
            _text(e.server_round),
            str(e.count),
            _cell(e.detail, MAX_DETAIL_CHARS + 40),
        ]
        for e in events
    ]
    title = (
        f"Audit log, the latest {len(events)} rows" if len(events) == SHOWN_EVENTS else "Audit log"
    )
    headers = ["at", "last", "event", "site", "run", "round", "count", "detail"]
    return f"<h2>{title}</h2>" + _table(headers, rows, text_columns=(0, 1, 2, 3, 7))


def _table(
    headers: list[str],
    rows: Iterable[list[str]],
    *,
    text_columns: tuple[int, ...] = (),
    css: str = "",
) -> str:
    """Cells are already escaped (or built from numbers) by the caller."""

    def cell(tag: str, index: int, value: str) -> str:
        return (
            f"<{tag} class='text'>{value}</{tag}>"
            if index in text_columns
            else f"<{tag}>{value}</{tag}>"
        )

    head = "".join(cell("th", i, escape(h)) for i, h in enumerate(headers))
    body = "".join(
        "<tr>" + "".join(cell("td", i, v) for i, v in enumerate(row)) + "</tr>" for row in rows
    )
    return f"<table class='{css}'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _status(status: str) -> str:
    css = status if status in STATUSES else ""
    return f"<span class='{css}'>{_cell(status)}</span>"


def _cell(value: object, limit: int = CELL_CHARS) -> str:
    """A text read from the database, cut to `limit` characters (and a marker), escaped."""
    return escape(bounded(value, limit))


def _text(value: object) -> str:
    return "-" if value is None else _cell(value)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _time(moment: datetime | None) -> str:
    return "-" if moment is None else f"{moment:%Y-%m-%d %H:%M:%S}"
