"""The run's privacy and security record, as results.json, report.md and `admin run status` show it."""

from hydrafl.trust import trust_lines, trust_summary


def _round(number: int, **fields) -> dict:
    return {
        "round": number,
        "dp_epsilon": None,
        "dp_clip": None,
        "local_epsilon_per_site": {},
        "rejected_per_site": {},
        "secagg_bytes": 0,
        "secagg_s": 0.0,
        **fields,
    }


def test_a_plain_run_has_nothing_to_report():
    history = [_round(0), _round(1), _round(2)]
    assert trust_summary(history, {"strategy": "fedavg", "dp-noise-multiplier": 0.0}) == {}


def test_central_dp_reports_the_last_epsilon_of_both_accountants_and_every_round():
    history = [
        _round(0),
        _round(1, dp_epsilon=0.8, dp_epsilon_exact=0.7, dp_clip=1.0),
        _round(2, dp_epsilon=1.3, dp_epsilon_exact=1.2, dp_clip=0.9),
    ]
    summary = trust_summary(
        history, {"dp-noise-multiplier": 1.1, "dp-clip": 1.0, "dp-adaptive": True, "dp-delta": 1e-5}
    )
    assert summary["dp"]["epsilon"] == 1.3 and summary["dp"]["epsilon_exact"] == 1.2
    assert summary["dp"]["epsilon_per_round"] == [0.8, 1.3]
    assert summary["dp"]["epsilon_exact_per_round"] == [0.7, 1.2]
    assert summary["dp"]["clip_per_round"] == [1.0, 0.9]
    assert summary["dp"]["neighbours"] == "replace-one site"
    [line] = trust_lines(summary)
    assert (
        "epsilon 1.3 at delta 1e-05 (Renyi DP" in line
        and "1.2 (PLD, exact" in line
        and "(adaptive)" in line
    )
    assert "replace-one site neighbours, covering the model updates released each round" in line


def test_a_history_stored_before_the_exact_accountant_shows_only_renyi_dp():
    history = [_round(0), _round(1, dp_epsilon=0.8, dp_clip=1.0)]
    summary = trust_summary(history, {"dp-noise-multiplier": 1.1, "dp-clip": 1.0, "dp-delta": 1e-5})
    assert summary["dp"]["epsilon_exact"] is None and summary["dp"]["epsilon_exact_per_round"] == [
        None
    ]
    [line] = trust_lines(summary)
    assert "epsilon 0.8 at delta 1e-05 (Renyi DP" in line and "PLD" not in line


def test_secagg_local_dp_and_rejections_are_summarised():
    history = [
        _round(0),
        _round(
            1,
            secagg_bytes=3000,
            secagg_s=0.5,
            local_epsilon_per_site={"1001": 2.0},
            rejected_per_site={"1002": "norm 50 above 3 x median 2"},
        ),
        _round(2, secagg_bytes=1000, secagg_s=1.5, local_epsilon_per_site={"1001": 2.5}),
    ]
    summary = trust_summary(history, {"secagg": True})
    assert summary["secagg"] == {
        "protocol_bytes_per_round": 2000,
        "protocol_seconds_per_round": 1.0,
    }
    assert summary["local_dp"]["epsilon_per_site"] == {"1001": 2.5}
    assert summary["rejected"] == [
        {"round": 1, "site": "1002", "reason": "norm 50 above 3 x median 2"}
    ]
    assert len(trust_lines(summary)) == 3
