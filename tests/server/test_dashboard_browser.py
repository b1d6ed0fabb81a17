"""The dashboard in a real browser: a coordinator process started with `--dashboard` drives a run of three site
processes to the end, then headless Chromium (Debian's `chromium`) loads the page from that database, the token
travelling the way a person's browser carries it (once in the URL, then as the cookie set from it)."""

from __future__ import annotations

import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
from dashboard_http import fetch
from deployment import enrol, free_port, queue_run, start_hydrafl, wait_serving, wait_until
from helpers import SMALL_RUN
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "browser-test-dashboard-token-0123456789"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def _browser() -> str:
    found = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    if found is None:
        pytest.skip("no chromium binary on PATH (Debian: apt-get install chromium)")
    return found


def _chromium(browser: str, profile: Path, *options: str) -> str:
    command = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        *options,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture
def finished_run(tmp_path):
    """(dashboard URL, store, run id) of a coordinator process that drove SMALL_RUN to the end and still serves."""
    env, db, store, tokens, address = enrol(tmp_path, SMALL_RUN)
    env["HYDRAFL_DASHBOARD_TOKEN"] = TOKEN
    run_id = queue_run(store, SMALL_RUN)
    url = f"http://127.0.0.1:{free_port()}"
    processes = [
        start_hydrafl(
            "server",
            "--listen",
            address,
            "--db",
            db,
            "--blobs",
            str(tmp_path / "blobs"),
            "--dashboard",
            url.removeprefix("http://"),
            env=env,
            log=tmp_path / "coordinator.log",
        )
    ]
    try:
        wait_serving(address, process=processes[0])
        for i, token in enumerate(tokens):
            processes.append(
                start_hydrafl(
                    "site",
                    "--coordinator",
                    address,
                    "--token",
                    token,
                    env=env,
                    log=tmp_path / f"site-{i}.log",
                )
            )
        wait_until(
            lambda: store.run(run_id).status in ("finished", "failed"),
            300,
            "the run did not finish",
        )
        assert store.run(run_id).status == "finished", store.run(run_id).detail
        yield url, store, run_id
    finally:
        for process in processes:
            process.kill()
            process.wait()


def test_the_dashboard_shows_a_finished_run_in_chromium(finished_run, tmp_path):
    browser = _browser()
    url, store, run_id = finished_run

    assert fetch(f"{url}/runs/{run_id}")[0] == 401
    assert fetch(f"{url}/metrics")[0] == 401
    status, _, page = fetch(f"{url}/runs/{run_id}", {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200 and f"Run {run_id}" in page
    status, headers, _ = fetch(f"{url}/?token={TOKEN}")
    assert status == 303 and headers["Location"] == "/"
    assert fetch(url + "/", {"Cookie": headers["Set-Cookie"].split(";")[0]})[0] == 200

    refused = _chromium(browser, tmp_path / "no-token", "--dump-dom", f"{url}/runs/{run_id}")
    assert "401 Unauthorized" in refused and "polyline" not in refused

    dom = _chromium(
        browser, tmp_path / "profile", "--dump-dom", f"{url}/runs/{run_id}?token={TOKEN}"
    )
    assert f'Run {run_id}: <span class="finished">finished</span>, 3/3 rounds' in dom
    curves = re.findall(r'<polyline points="([^"]+)"', dom)
    assert len(curves) == 3 and all(len(points.split()) == SMALL_RUN.rounds for points in curves)
    rounds_table = dom.split('<table class="rounds">')[1].split("</table>")[0]
    assert re.findall(r"<tr><td>(\d+)</td>", rounds_table) == ["3", "2", "1"]
    assert "push_reply" in dom and "hospital-0" in dom and "update-accepted" in dom

    shot = tmp_path / "dashboard.png"
    _chromium(
        browser,
        tmp_path / "profile",
        f"--screenshot={shot}",
        "--window-size=1200,1800",
        f"{url}/runs/{run_id}?token={TOKEN}",
    )
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, results / "dashboard.png")

    request = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        families = {
            family.name: family
            for family in text_string_to_metric_families(response.read().decode())
        }
    rounds = {
        sample.labels["run"]: sample.value
        for sample in families["hydrafl_rounds_completed"].samples
        if sample.name.endswith("_total")
    }
    assert rounds[str(run_id)] == store.run(run_id).rounds_done == SMALL_RUN.rounds
    accepted = [event for event in store.audit_events("update-accepted") if event.run_id == run_id]
    assert families["hydrafl_updates_accepted"].samples[0].value == len(accepted) > 0
    assert 0 <= families["hydrafl_sites_connected"].samples[0].value <= SMALL_RUN.sites
