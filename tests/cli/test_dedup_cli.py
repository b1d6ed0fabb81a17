"""`hydrafl simulate --dedup`: the sites drop their cross-site duplicates before round 1 and the command says
how many each dropped; a threshold or task deduplication cannot use is a one-line error, exit 2."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from hydrafl.cli import app

SMALL = [
    "--task",
    "tabular",
    "--sites",
    "3",
    "--samples-per-site",
    "80",
    "--rounds",
    "1",
    "--local-steps",
    "2",
]


def test_simulate_with_planted_duplicates_reports_what_each_site_dropped(tmp_path):
    result = CliRunner().invoke(
        app,
        [
            "simulate",
            *SMALL,
            "--duplicates",
            "0.25",
            "--dedup",
            "--strategies",
            "fedavg",
            "--out",
            str(tmp_path / "o"),
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    line = " ".join(result.output.split())  # rich wraps the line
    dropped = re.search(
        r"site 0 dropped (\d+) of 96, site 1 dropped 0 of 64, site 2 dropped 0 of 64", line
    )
    assert dropped and 31 <= int(dropped.group(1)) <= 32  # 32 copies planted at site 0
    results = json.loads((tmp_path / "o" / "results.json").read_text())
    assert results["strategies"]["fedavg"]["dedup"]["0"] == {
        "records": 96,
        "dropped": int(dropped.group(1)),
    }
    assert "## Cross-site deduplication" in (tmp_path / "o" / "report.md").read_text()


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--dedup", "--dedup-threshold", "1.5"], "dedup-threshold"),
        (["--task", "chest-xray", "--dedup"], "--dedup"),
        (["--task", "chest-xray", "--duplicates", "0.2"], "--duplicates"),
    ],
)
def test_a_dedup_setting_that_cannot_work_is_a_one_line_error(tmp_path, flags, named):
    result = CliRunner().invoke(
        app, ["simulate", *flags, "--out", str(tmp_path / "o"), "--no-progress"]
    )
    assert result.exit_code == 2
    assert named in result.output


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("not hex", "hold hex text"),
        ("ab" * 4, "hold 16 to 64 bytes"),
        ("ab" * 65, "hold 16 to 64 bytes"),
    ],
)
def test_a_site_refuses_a_key_file_that_holds_no_usable_key_before_connecting(
    tmp_path, key, message
):
    key_file = tmp_path / "consortium.key"
    key_file.write_text(key)
    result = CliRunner().invoke(
        app,
        ["site", "--coordinator", "127.0.0.1:1", "--token", "t", "--dedup-key-file", str(key_file)],
    )
    assert result.exit_code == 2
    assert f"--dedup-key-file must {message}" in " ".join(result.output.split())
