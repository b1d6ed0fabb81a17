"""The dashboard and /metrics on a coordinator database written through the real Store: the token guards every
path, the page escapes what sites wrote, and the metrics equal the store's own counts."""

from __future__ import annotations

import dataclasses
import re
import urllib.error
import urllib.request

import pytest
from dashboard_http import fetch
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from hydrafl.cli import app
from hydrafl.rounds import RoundRecord
from hydrafl.server.dashboard import COOKIE, Dashboard, DashboardConfig
from hydrafl.server.store import Store
from hydrafl.validation import ConfigError

TOKEN = "dashboard-token-for-tests-0123456789"
HOSTILE = "<script>alert(1)</script>"


def finished_run_store(db_url: str) -> tuple[Store, int, int]:
    """A database with three sites, a finished 3-round run with screening and refusals, and a pending run."""
    store = Store(db_url)
    sites = [store.add_site(name)[0] for name in ("st-marys", "royal-infirmary", HOSTILE)]
    nodes = [str(site.node_id) for site in sites]
    run = store.create_run({"strategy": "fedavg", "rounds": 3, "task": "tabular"})
    history = [dataclasses.asdict(RoundRecord(round=0, loss=0.9, accuracy=0.3))]
    for server_round, seconds in ((1, 0.7), (2, 3.0), (3, 45.0)):
        record = RoundRecord(
            round=server_round,
            loss=1.0 / server_round,
            accuracy=0.5 + server_round / 10,
            seconds=seconds,
            aggregation_s=0.02 * server_round,
            gap_s=0.1,
            sites_ok=3,
            bytes_up=3000 * server_round,
            bytes_down=2000,
            bytes_up_per_site=dict.fromkeys(nodes, 1000 * server_round),
            bytes_down_per_site=dict.fromkeys(nodes, 2000 // 3),
            rejected_per_site={nodes[2]: "norm outlier"} if server_round == 2 else {},
        )
        history.append(dataclasses.asdict(record))
    store.set_run_status(run.id, "running")
    store.set_run_status(run.id, "finished", rounds_done=3, history=history)
    for site in sites[:2]:
        for server_round in (1, 2, 3):
            store.audit(
                "update-accepted",
                site_name=site.name,
                run_id=run.id,
                detail=f"{run.id}-{server_round}",
            )
    store.audit(
        "update-rejected",
        site_name=HOSTILE,
        run_id=run.id,
        detail=f"INVALID_ARGUMENT: {HOSTILE} NaN",
    )
    store.audit(
        "update-rejected", site_name=HOSTILE, run_id=run.id, detail="INVALID_ARGUMENT: shape"
    )
    store.audit(
        "update-rejected",
        site_name="st-marys",
        run_id=run.id,
        detail="FAILED_PRECONDITION: late reply",
    )
    store.audit(
        "update-rejected", site_name="st-marys", detail="FAILED_PRECONDITION: nothing to answer"
    )
    store.audit(
        "site-declined",
        site_name="royal-infirmary",
        run_id=run.id,
        detail="round 1 train: out of memory",
    )
    pending = store.create_run({"strategy": "diloco", "rounds": 5, "task": "tabular"})
    return store, run.id, pending.id


@pytest.fixture
def board(db_url, tmp_path):
    """A dashboard on a finished run's database, SQLite or PostgreSQL (`conftest.db_url`)."""
    store, run_id, pending_id = finished_run_store(db_url)
    dashboard = Dashboard(
        DashboardConfig(listen="127.0.0.1:0", token=TOKEN), store, tmp_path / "runs"
    )
    dashboard.start()
    yield dashboard, run_id, pending_id
    dashboard.stop()


def test_every_path_needs_the_token(board):
    dashboard, run_id, _ = board
    for path in ("/", f"/runs/{run_id}", "/metrics", "/nowhere"):
        status, headers, body = fetch(dashboard.url + path)
        assert status == 401, path
        assert headers["WWW-Authenticate"].startswith("Bearer")
        assert "run" not in body.lower().split("unauthorized")[0]
    assert fetch(dashboard.url + "/", {"Authorization": "Bearer " + TOKEN[:-1] + "x"})[0] == 401
    assert fetch(dashboard.url + "/", {"Cookie": f"{COOKIE}=wrong"})[0] == 401
    assert fetch(dashboard.url + "/?token=wrong")[0] == 401
    request = urllib.request.Request(
        dashboard.url + "/", method="POST", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    with pytest.raises(urllib.error.HTTPError, match="501"):  # read-only: GET and HEAD
        urllib.request.urlopen(request, timeout=10)


def test_a_bearer_header_or_the_cookie_set_from_the_query_opens_the_page(board):
    dashboard, run_id, _ = board
    status, headers, body = fetch(dashboard.url + "/", {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    policy = headers["Content-Security-Policy"]
    assert "script-src" not in policy and "default-src 'none'" in policy
    status, headers, _ = fetch(f"{dashboard.url}/runs/{run_id}?token={TOKEN}")
    assert (
        status == 303 and headers["Location"] == f"/runs/{run_id}"
    )  # the token leaves the address bar
    assert f"{COOKIE}={TOKEN}" in headers["Set-Cookie"] and "HttpOnly" in headers["Set-Cookie"]
    cookie = headers["Set-Cookie"].split(";")[0]
    status, _, body = fetch(dashboard.url + headers["Location"], {"Cookie": cookie})
    assert status == 200 and f"Run {run_id}" in body
    assert fetch(dashboard.url + "/runs/999", {"Cookie": cookie})[0] == 404


def test_the_page_shows_rounds_curves_and_sites_and_escapes_what_sites_wrote(board):
    dashboard, run_id, pending_id = board
    _, _, body = fetch(f"{dashboard.url}/runs/{run_id}", {"Authorization": f"Bearer {TOKEN}"})
    assert HOSTILE not in body and "&lt;script&gt;alert(1)&lt;/script&gt;" in body
    assert (
        body.count("<polyline points=") == 3
    )  # loss, accuracy, round seconds; no DP curve without DP
    loss_points = body.split("<polyline points='")[1].split("'")[0].split()
    assert len(loss_points) == 3
    assert f"<a href='/runs/{pending_id}'>" in body and "3/3" in body
    assert "Rounds</h2>" in body and "45.00" in body  # round 3's seconds
    assert "screening rejected 1 replies" in body
    sites = body.split("<h2>Sites</h2>")[1].split("</table>")[0]
    st_marys = re.findall(r"<td[^>]*>([^<]*)</td>", sites.split("st-marys")[1].split("</tr>")[0])
    assert st_marys[-5:] == [
        "0.01",
        "0.00",
        "3",
        "2",
        "0",
    ]  # MB up, MB down, accepted, refused, declined


def test_metrics_equal_the_store(board):
    dashboard, run_id, pending_id = board
    status, headers, text = fetch(dashboard.url + "/metrics", {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    run, pending = str(run_id), str(pending_id)
    store = dashboard.store
    assert (
        samples["hydrafl_rounds_completed_total", (("run", run),)]
        == store.run(run_id).rounds_done
        == 3
    )
    assert samples["hydrafl_rounds_completed_total", (("run", pending),)] == 0
    accepted = len([e for e in store.audit_events("update-accepted") if e.run_id == run_id])
    assert samples["hydrafl_updates_accepted_total", (("run", run),)] == accepted == 6
    assert (
        samples["hydrafl_updates_refused_total", (("reason", "invalid_argument"), ("run", run))]
        == 2
    )
    assert (
        samples["hydrafl_updates_refused_total", (("reason", "failed_precondition"), ("run", run))]
        == 1
    )
    assert (
        samples[
            "hydrafl_updates_refused_total", (("reason", "failed_precondition"), ("run", "none"))
        ]
        == 1
    )
    assert samples["hydrafl_updates_refused_total", (("reason", "screening"), ("run", run))] == 1
    assert samples["hydrafl_received_bytes_total", (("run", run),)] == 3000 * (1 + 2 + 3)
    assert samples["hydrafl_sent_bytes_total", (("run", run),)] == 3 * 2000
    assert samples["hydrafl_round_seconds_count", (("run", run),)] == 3
    assert samples["hydrafl_round_seconds_sum", (("run", run),)] == pytest.approx(48.7)
    assert samples["hydrafl_round_seconds_bucket", (("le", "1.0"), ("run", run))] == 1
    assert samples["hydrafl_round_seconds_bucket", (("le", "5.0"), ("run", run))] == 2
    assert samples["hydrafl_aggregation_seconds_sum", (("run", run),)] == pytest.approx(0.12)
    assert samples["hydrafl_runs", (("status", "finished"),)] == 1
    assert samples["hydrafl_runs", (("status", "pending"),)] == 1
    assert samples["hydrafl_sites_enrolled", (("status", "active"),)] == 3
    assert not any(
        "site" in dict(labels) for _, labels in samples
    )  # no per-site (token-like) labels


def test_the_dashboard_refuses_to_start_without_a_real_token():
    with pytest.raises(ConfigError, match="--dashboard-token or set HYDRAFL_DASHBOARD_TOKEN"):
        DashboardConfig(listen="127.0.0.1:8080")
    with pytest.raises(ConfigError, match="at least 16"):
        DashboardConfig(listen="127.0.0.1:8080", token="short")
    with pytest.raises(ConfigError, match="HOST:PORT or PORT"):
        DashboardConfig(listen="127.0.0.1:http", token=TOKEN)
    assert DashboardConfig(listen="8080", token=TOKEN).address == ("127.0.0.1", 8080)
    assert DashboardConfig(listen="127.0.0.1:8080", token=TOKEN).plaintext_warning is None
    assert DashboardConfig(listen="[::1]:8080", token=TOKEN).plaintext_warning is None
    assert "WITHOUT TLS" in DashboardConfig(listen="0.0.0.0:8080", token=TOKEN).plaintext_warning


def test_a_port_in_use_is_refused_with_the_address(board):
    dashboard, _, _ = board
    taken = dashboard.url.removeprefix("http://")
    with pytest.raises(OSError, match=f"cannot serve the dashboard on {taken}"):
        Dashboard(DashboardConfig(listen=taken, token=TOKEN), dashboard.store, dashboard.runs_dir)


def test_hydrafl_server_with_a_dashboard_and_no_token_exits_with_one_line(tmp_path):
    env = {"HYDRAFL_HOME": str(tmp_path), "HYDRAFL_DASHBOARD_TOKEN": "", "COLUMNS": "60"}
    result = CliRunner().invoke(app, ["server", "--dashboard", "127.0.0.1:0"], env=env)
    assert result.exit_code == 2
    assert (
        "--dashboard needs an admin token: pass --dashboard-token or set HYDRAFL_DASHBOARD_TOKEN"
        in result.output
    )


def test_a_dp_runs_rounds_show_the_exact_epsilon_beside_renyi_dps():
    from hydrafl.server.dashboard_page import _rounds_table

    record = dataclasses.asdict(
        RoundRecord(round=1, sites_ok=4, dp_epsilon=26.5, dp_epsilon_exact=24.92)
    )
    cells = re.findall(r"<t[dh][^>]*>([^<]*)</t[dh]>", _rounds_table([record], dp=True))
    assert cells[-2:] == ["26.5", "24.92"] and cells[cells.index("epsilon") + 1] == "epsilon exact"


def test_a_stats_run_shows_its_counts_per_site_suppressed_cells_and_medians(board):
    from hydrafl.cohort_stats import Histogram, SiteStats, combine, release
    from hydrafl.cohort_stats_report import write_stats

    dashboard, _, _ = board
    run = dashboard.store.create_run({"job": "stats", "task": "tabular", "rounds": 1})
    _, _, body = fetch(f"{dashboard.url}/runs/{run.id}", {"Authorization": f"Bearer {TOKEN}"})
    assert "Cohort statistics</h2><p class='muted'>none yet" in body
    histogram = Histogram(edges=(0.0, 1.0, 2.0), counts=(0, 10, 10, 0))
    sites = {
        "1001": SiteStats(
            modality="tabular",
            records=20,
            categories={"label": {HOSTILE: 17, "ward": 3}},
            histograms={"feature 0": histogram},
        ),
        "1002": SiteStats(
            modality="tabular",
            records=20,
            categories={"label": {HOSTILE: 20, "ward": 0}},
            histograms={"feature 0": histogram},
        ),
    }
    sites["1001"] = release(sites["1001"], min_cell_count=5)
    write_stats(dashboard.runs_dir / str(run.id), combine(sites), {})
    _, _, body = fetch(f"{dashboard.url}/runs/{run.id}", {"Authorization": f"Bearer {TOKEN}"})
    table = body.split("Cohort statistics</h2>")[1].split("</table>")[0]
    assert HOSTILE not in body and "label &lt;script&gt;" in table
    cells = [re.findall(r"<td[^>]*>([^<]*)</td>", row) for row in table.split("<tr>")[2:]]
    assert cells[0] == ["records", "20", "20", "40"]
    assert cells[2] == ["label ward", "&lt;5", "0", "0"]
    assert cells[3] == ["feature 0 median", "1", "1", "1"]
    assert "Rounds</h2>" not in body
