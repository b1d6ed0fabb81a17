"""`hydrafl admin run status ID` shows the sites that declined or failed the run's messages (table and --json)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from hydrafl.cli import app
from hydrafl.server.store import Store

WIDE = {"COLUMNS": "200"}


def _status(db_url: str, run_id: int, *options: str) -> str:
    result = CliRunner().invoke(app, ["admin", "run", "status", str(run_id), "--db", db_url, *options], env=WIDE)
    assert result.exit_code == 0, result.output
    return result.stdout


def test_run_status_lists_the_sites_that_declined_this_run(tmp_path):
    db_url = f"sqlite:///{tmp_path / 'coordinator.db'}"
    store = Store(db_url)
    run = store.create_run({"strategy": "fedavg", "rounds": 3})
    other = store.create_run({"strategy": "fedavg", "rounds": 3})
    store.audit("site-declined", site_name="st-marys", run_id=run.id,
                detail="round 0 query.init: ValueError: --label-column 'outcom' is not a column of visits.csv")
    store.audit("update-accepted", site_name="royal-infirmary", run_id=run.id, detail=f"{run.id}-0-query.init-10002-0")
    store.audit("site-declined", site_name="royal-infirmary", run_id=other.id, detail="round 1 train: out of memory")
    store.audit("site-declined", site_name="st-marys", run_id=run.id, detail="refused by the site policy")

    declines = json.loads(_status(db_url, run.id, "--json"))["declines"]
    assert [(d["site"], d["round"], d["reason"]) for d in declines] == [
        ("st-marys", 0, "query.init: ValueError: --label-column 'outcom' is not a column of visits.csv"),
        ("st-marys", None, "refused by the site policy"),
    ]
    shown = _status(db_url, run.id)
    assert "sites that declined or failed" in shown
    rows = [line for line in shown.splitlines() if "st-marys" in line or "royal-infirmary" in line]
    assert len(rows) == 2
    assert [cell.strip() for cell in rows[0].split("│")[1:4]] == [
        "st-marys", "0", "query.init: ValueError: --label-column 'outcom' is not a column of visits.csv"
    ]
    assert "refused by the site policy" in rows[1]
    assert json.loads(_status(db_url, other.id, "--json"))["declines"][0]["reason"] == "train: out of memory"


def test_run_status_shows_the_last_twenty_declines_and_json_has_all(tmp_path):
    db_url = f"sqlite:///{tmp_path / 'coordinator.db'}"
    store = Store(db_url)
    run = store.create_run({"strategy": "fedavg", "rounds": 30})
    for server_round in range(1, 24):
        store.audit("site-declined", site_name="st-marys", run_id=run.id, detail=f"round {server_round} train: no data")
    assert [d["round"] for d in json.loads(_status(db_url, run.id, "--json"))["declines"]] == list(range(1, 24))
    shown = _status(db_url, run.id)
    assert "sites that declined or failed, the last 20 of 23" in shown
    rounds = [int(line.split("│")[2]) for line in shown.splitlines() if "st-marys" in line]
    assert rounds == list(range(4, 24))


def test_run_status_without_declines_has_no_section(tmp_path):
    db_url = f"sqlite:///{tmp_path / 'coordinator.db'}"
    run = Store(db_url).create_run({"strategy": "fedavg", "rounds": 1})
    assert "declined" not in _status(db_url, run.id)
    assert json.loads(_status(db_url, run.id, "--json"))["declines"] == []
