"""rounds.tsv's row of a round: each site's bytes in node order, whatever order the sites answered in."""

from __future__ import annotations

from hydrafl.rounds import ROUNDS_TSV_COLUMNS, RoundRecord

UP, DOWN = {"10003": 300, "999": 100, "10001": 200}, {"10001": 300, "999": 300, "10003": 300}


def _row(record: RoundRecord) -> dict[str, str]:
    return dict(zip(ROUNDS_TSV_COLUMNS, record.tsv_row().split("\t"), strict=True))


def test_a_rounds_tsv_row_lists_each_sites_bytes_in_node_order():
    row = _row(RoundRecord(round=2, bytes_up=600, bytes_up_per_site=UP, bytes_down_per_site=DOWN))
    assert row["bytes_up_per_site"] == "999:100,10001:200,10003:300"  # 999 < 10001: numeric order
    assert row["bytes_down_per_site"] == "999:300,10001:300,10003:300"
    assert (row["round"], row["bytes_up"]) == ("2", "600")


def test_a_round_no_site_answered_writes_a_dash_for_its_sites():
    row = _row(RoundRecord(round=1))
    assert row["bytes_up_per_site"] == row["bytes_down_per_site"] == "-"
