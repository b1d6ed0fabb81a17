"""What a privacy officer reads about a run: the privacy spent, whether updates were summed securely, which
replies screening rejected. One summary of a run's round history, shown by `hydrafl simulate`'s results.json
and report.md and by `hydrafl admin run status`."""

from __future__ import annotations

from typing import Any

ACCOUNTANT = "Renyi DP (Google dp-accounting)"
EXACT_ACCOUNTANT = "PLD, exact (Google dp-accounting)"
NEIGHBOURS = "replace-one site"
COVERS = "the model updates released each round"


def trust_summary(history: list[dict[str, Any]], run_config: dict[str, Any]) -> dict[str, Any]:
    """The run's privacy, secure-aggregation and screening record; keys absent when the feature was off.
    `run_config` may be snake_case (RunConfig.flat) or kebab-case (Flower's run_config)."""
    config = {key.replace("-", "_"): value for key, value in run_config.items()}
    trained = [record for record in history if record.get("round", 0) > 0]
    summary: dict[str, Any] = {}
    epsilons = [record.get("dp_epsilon") for record in trained]
    exact = [record.get("dp_epsilon_exact") for record in trained]
    if config.get("dp_noise_multiplier") or config.get("dp_clip"):
        summary["dp"] = {
            "noise_multiplier": config.get("dp_noise_multiplier", 0.0),
            "clip": config.get("dp_clip", 0.0),
            "adaptive": bool(config.get("dp_adaptive", False)),
            "delta": config.get("dp_delta"),
            "neighbours": NEIGHBOURS,
            "covers": COVERS,
            "accountant": ACCOUNTANT,
            "epsilon": _last(epsilons),
            "epsilon_per_round": epsilons,
            "exact_accountant": EXACT_ACCOUNTANT,
            "epsilon_exact": _last(exact),
            "epsilon_exact_per_round": exact,
            "clip_per_round": [record.get("dp_clip") for record in trained],
        }
    local: dict[str, Any] = {}
    for record in trained:
        local.update(record.get("local_epsilon_per_site") or {})
    if local:
        summary["local_dp"] = {"accountant": ACCOUNTANT, "epsilon_per_site": local}
    if config.get("secagg"):
        rounds = max(len(trained), 1)
        summary["secagg"] = {
            "protocol_bytes_per_round": sum(record.get("secagg_bytes", 0) for record in trained)
            / rounds,
            "protocol_seconds_per_round": sum(record.get("secagg_s", 0.0) for record in trained)
            / rounds,
        }
    rejected = [
        {"round": record["round"], "site": site, "reason": reason}
        for record in trained
        for site, reason in (record.get("rejected_per_site") or {}).items()
    ]
    if rejected:
        summary["rejected"] = rejected
    return summary


def _last(values: list[Any]) -> Any:
    return next((value for value in reversed(values) if value is not None), None)


def trust_lines(summary: dict[str, Any]) -> list[str]:
    """The summary as short sentences, for report.md and the status table."""
    lines = []
    if "dp" in summary:
        dp = summary["dp"]
        at_delta = "" if dp["delta"] is None else f" at delta {dp['delta']:g}"
        spent = "not reported"
        if dp["epsilon"] is not None:
            spent = f"epsilon {dp['epsilon']:.3g}{at_delta} ({dp['accountant']})"
        if dp.get("epsilon_exact") is not None:
            spent += f", {dp['epsilon_exact']:.3g} ({dp['exact_accountant']})"
        lines.append(
            f"central DP: noise multiplier {dp['noise_multiplier']:g}, clip {dp['clip']:g}"
            f"{' (adaptive)' if dp['adaptive'] else ''}; spent {spent}; {NEIGHBOURS} neighbours, covering {COVERS}"
        )
    if "local_dp" in summary:
        worst = max(summary["local_dp"]["epsilon_per_site"].values())
        lines.append(f"local DP at the sites: largest site epsilon {worst:.3g}")
    if "secagg" in summary:
        secagg = summary["secagg"]
        lines.append(
            f"secure aggregation: {secagg['protocol_bytes_per_round'] / 1e6:.2f} MB and "
            f"{secagg['protocol_seconds_per_round']:.2f} s of protocol per round"
        )
    if "rejected" in summary:
        lines.append(f"screening rejected {len(summary['rejected'])} replies")
    return lines
