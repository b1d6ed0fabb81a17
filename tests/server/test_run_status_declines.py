"""`hydrafl admin run status ID` shows the sites that declined or failed the run's messages (table and --json)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from hydrafl.cli import app
from hydrafl.server.store import Store

WIDE = {"COLUMNS": "200"}


def _status(db_url: str, run_id: int, *options: str) -> str:
    result = CliRunner().invoke(
        app, ["admin", "run", "status", str(run_id), "--db", db_url, *options], env=WIDE
    )
    assert result.exit_code == 0, result.output
    return result.stdout


def test_run_status_lists_the_sites_that_declined_this_run(tmp_path):
    db_url = f"sqlite:///{tmp_path / 'coordinator.db'}"
    store = Store(db_url)
    run = store.create_run({"strategy": "fedavg", "rounds": 3})
    other = store.create_run({"strategy": "fedavg", "rounds": 3})
    store.audit(
        "site-declined",
        site_name="st-marys",
        run_id=run.id,
        detail="round 0 query.init: ValueError: --label-column 'outcom' is not a column of visits.csv",
    )
    store.audit(
        "update-accepted",
        site_name="royal-infirmary",
        run_id=run.id,
        detail=f"{run.id}-0-query.init-10002-0",
    )
    store.audit(
        "site-declined",
        site_name="royal-infirmary",
        run_id=other.id,
        detail="round 1 train: out of memory",
    )
    store.audit(
        "site-declined", site_name="st-marys", run_id=run.id, detail="refused by the site policy"
    )

    declines = json.loads(_status(db_url, run.id, "--json"))["declines"]
    assert [(d["site"], d["round"], d["reason"]) for d in declines] == [
        (
            "st-marys",
            0,
            "query.init: ValueError: --label-column 'outcom' is not a column of visits.csv",
        ),
        ("st-marys", None, "refused by the site policy"),
    ]
    shown = _status(db_url, run.id)
    assert "sites that declined or failed" in shown
    rows = [line for line in shown.splitlines() if "st-marys" in line or "royal-infirmary" in line]
    assert len(rows) == 2
    assert [cell.strip() for cell in rows[0].split("│")[1:4]] == [
        "st-marys",
        "0",
        "query.init: ValueError: --label-column 'outcom' is not a column of visits.csv",
    ]
    assert "refused by the site policy" in rows[1]
    assert (
        json.loads(_status(db_url, other.id, "--json"))["declines"][0]["reason"]
        == "train: out of memory"
    )


def test_run_status_shows_the_last_twenty_declines_and_json_has_all(tmp_path):
    db_url = f"sqlite:///{tmp_path / 'coordinator.db'}"
    store = Store(db_url)
    run = store.create_run({"strategy": "fedavg", "rounds": 30})
    for server_round in range(1, 24):
        store.audit(
            "site-declined",
            site_name="st-marys",
            run_id=run.id,
            detail=f"round {server_round} train: no data",
        )
    assert [d["round"] for d in json.loads(_status(db_url, run.id, "--json"))["declines"]] == list(
        range(1, 24)
    )
    shown = _status(db_url, run.id)
    assert "sites that declined or failed, the last 20 of 23" in shown
    rounds = [int(line.split("│")[2]) for line in shown.splitlines() if "st-marys" in line]
    assert rounds == list(range(4, 24))


def test_run_status_without_declines_has_no_section(tmp_path):
    db_url = f"sqlite:///{tmp_path / 'coordinator.db'}"
    run = Store(db_url).create_run({"strategy": "fedavg", "rounds": 1})
    assert "declined" not in _status(db_url, run.id)
    assert json.loads(_status(db_url, run.id, "--json"))["declines"] == []


def test_run_status_reports_the_privacy_spent_and_the_rejected_replies(tmp_path):
    db_url = f"sqlite:///{tmp_path / 'coordinator.db'}"
    store = Store(db_url)
    run = store.create_run(
        {"strategy": "diloco", "rounds": 2, "dp-noise-multiplier": 1.5, "dp-clip": 0.5}
    )
    rounds = [
        {"round": 0, "loss": 1.0, "accuracy": 0.2, "sites_ok": 3, "bytes_up": 0, "seconds": 0.1},
        {
            "round": 1,
            "loss": 0.9,
            "accuracy": 0.3,
            "sites_ok": 2,
            "bytes_up": 10,
            "seconds": 0.2,
            "dp_epsilon": 1.25,
            "dp_clip": 0.5,
            "rejected_per_site": {"1003": "update norm 40 above 3 x the round's median (6)"},
        },
        {
            "round": 2,
            "loss": 0.8,
            "accuracy": 0.4,
            "sites_ok": 3,
            "bytes_up": 10,
            "seconds": 0.2,
            "dp_epsilon": 1.75,
            "dp_clip": 0.5,
        },
    ]
    store.set_run_status(run.id, "finished", rounds_done=2, history=rounds)

    trust = json.loads(_status(db_url, run.id, "--json"))["trust"]
    assert trust["dp"]["epsilon"] == 1.75 and trust["dp"]["epsilon_per_round"] == [1.25, 1.75]
    assert trust["dp"]["noise_multiplier"] == 1.5 and trust["dp"]["delta"] is None
    assert trust["rejected"] == [
        {"round": 1, "site": "1003", "reason": "update norm 40 above 3 x the round's median (6)"}
    ]
    shown = _status(db_url, run.id)
    assert "central DP: noise multiplier 1.5, clip 0.5; spent epsilon 1.75" in shown
    assert "screening rejected 1 replies" in shown
