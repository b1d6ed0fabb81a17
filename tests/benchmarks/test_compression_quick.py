"""The compression benchmark's --quick mode end to end: the runs, the summary's ratios and verdicts computed from
them, and the wire-time table's arithmetic (no goal is asserted: those are measurements)."""

from __future__ import annotations

import pytest
from helpers import run_quick


@pytest.mark.slow
def test_compression_quick(tmp_path):
    result = run_quick("compression", tmp_path, timeout_s=600)
    assert result["quick"] is True and result["seeds"] == 1
    assert list(result["schemes"]) == ["none", "topk", "topk-down"]
    runs, rows = result["runs"]["clinical-text"], result["summary"]["clinical-text"]["schemes"]
    [plain], [topk], [down] = runs["none"], runs["topk"], runs["topk-down"]
    assert rows["topk"]["upload_ratio"] == pytest.approx(plain["bytes_up"] / topk["bytes_up"])
    assert (
        rows["topk"]["upload_ratio"] > 4
    )  # 5% of the coordinates at 8 bytes each, against 4 bytes each
    assert topk["bytes_down"] == plain["bytes_down"]  # downloads stay whole
    # one round: the initial and the final evaluation go whole, the training round's change is compressed
    assert rows["topk-down"]["download_ratio"] == pytest.approx(
        plain["bytes_down"] / down["bytes_down"]
    )
    assert (
        1.4 < rows["topk-down"]["download_ratio"] < 1.5
    )  # 3 whole models against 2 and a top-k change
    assert down["bytes_up"] == topk["bytes_up"]
    assert rows["topk"]["accuracy_gap_points"] == pytest.approx(
        100 * (plain["accuracy"] - topk["accuracy"])
    )
    assert rows["topk"]["meets_goal"] == (rows["topk"]["accuracy_gap_points"] <= 1.0)
    wire = result["wire"]
    assert wire["scale_to_gib"] == pytest.approx(2**30 / (wire["measured_mib"] * 2**20))
    assert (
        "topk-down" not in wire
        and wire["none"]["gib_bytes"] == 2**30
        and wire["topk"]["gib_bytes"] < 2**30 / 4
    )
    link = wire["link_gbps"] * 1e9 / 8
    expected = (
        wire["topk"]["encode_s"] + wire["topk"]["decode_s"] + wire["topk"]["gib_bytes"] / link
    )
    assert wire["topk"]["wire_s"] == pytest.approx(expected)
