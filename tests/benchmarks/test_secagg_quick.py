"""The secure-aggregation benchmark's --quick mode runs end to end and its numerical checks pass, its poisoner
scenario included."""

from __future__ import annotations

import pytest
from helpers import run_quick


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One --quick run for both tests (about 3 minutes on a busy machine)."""
    out = tmp_path_factory.mktemp("secagg")
    return run_quick("secagg", out, timeout_s=900), out


@pytest.mark.slow
def test_secagg_quick(quick):
    result, tmp_path = quick
    assert result["quick"] is True and result["all_within_bound"]
    assert [(row["sites"], row["params"]) for row in result["core"]][2:] == [
        (3, 100_000),
        (5, 100_000),
    ]
    for row in result["core"]:
        secure, plain = row["secure"], row["plain"]
        assert (
            secure["upload_bytes"] == plain["upload_bytes"] + 4 * row["sites"]
        )  # uint32 words, one more: the weight
        assert secure["protocol_bytes"] > row["sites"] * 64  # at least every site's two public keys
    final = result["accuracy"]["final"]
    assert abs(final["secure"]["accuracy"] - final["plain"]["accuracy"]) <= 0.05
    assert final["secure"]["secagg_bytes"] > 0 and final["plain"]["secagg_bytes"] == 0
    assert (tmp_path / "secagg.md").read_text().startswith("| sites | params |")


@pytest.mark.slow
def test_secagg_quick_poisoner_numbers(quick):
    """2 of 10 sites scale their update x100: plain and secure aggregation both let it through (the loss blows
    up), screening (plain only) removes it, the honest-site bound does nothing against sites that skip it and
    holds the same x100 to C when it comes from the ClientApp under an unmodified pipeline; a bound above every
    honest update costs the clean run nothing."""
    result, tmp_path = quick
    poison = result["poisoning"]
    assert (
        poison["config"]["sites"] == 10
        and poison["config"]["poisoners"] == 2
        and poison["config"]["scale"] == 100
    )
    runs = {row["run"]: row for row in poison["runs"]}
    clean = runs["plain, clean"]
    assert poison["honest_norms"]["max"] < poison["config"]["secagg_clip"]
    for name in (
        "plain, poisoned",
        "secure, poisoned",
        "secure, poisoned, honest-site bound",
    ):  # 1.77 vs 1.07
        assert (
            runs[name]["loss"] > 1.4 * clean["loss"] and runs[name]["accuracy"] <= clean["accuracy"]
        ), name
    for name in (
        "plain, poisoned, screening",
        "secure, poisoned app under the unmodified pipeline, honest-site bound",
        "secure, clean, honest-site bound",
    ):
        assert (
            runs[name]["loss"] < 1.15 * clean["loss"]
            and runs[name]["accuracy"] >= clean["accuracy"] - 0.1
        ), name
    # a site that skips the bound gets through as if there were none; honest sites under it lose nothing
    assert (
        abs(runs["secure, poisoned, honest-site bound"]["loss"] - runs["secure, poisoned"]["loss"])
        < 0.05
    )
    assert abs(runs["secure, clean, honest-site bound"]["loss"] - clean["loss"]) < 0.01
    assert "| secure, poisoned, honest-site bound |" in (tmp_path / "secagg.md").read_text()
