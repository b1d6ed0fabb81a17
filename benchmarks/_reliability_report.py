"""The reliability campaign's report (`benchmarks/reliability.py`): console tables, reliability.md and the
plot of kill moments and hostile requests' statuses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from rich.console import Console
from rich.table import Table

from hydrafl.benchmarks._common import verdict
from hydrafl.benchmarks._reliability_listeners import listener_markdown


def print_tables(summary: dict[str, Any]) -> None:
    """The three parts' tables and one line of verdicts."""
    console = Console()
    kills = summary["kills"]
    table = Table(
        title=f"kill -9 of the coordinator: {kills['kills']} kills, reference run {kills['reference_s']:.0f} s"
    )
    for column in (
        "run",
        "kills",
        "rounds done at kills",
        "seconds",
        "finished",
        "same model",
        "all sites",
        "accepted once",
    ):
        table.add_column(column, justify="right")
    for i, run in enumerate(kills["runs"]):
        table.add_row(
            str(i),
            str(run["kills"]),
            ",".join(str(k["rounds_done"]) for k in run["killed_at"]),
            f"{run['seconds']:.0f}",
            *(
                _yes(run[k])
                for k in ("finished", "same_model", "all_sites_every_round", "accepted_once")
            ),
        )
    console.print(table)
    hostile = summary["hostile"]
    table = Table(
        title=f"{hostile['requests']} hostile requests in {hostile['seconds']:.0f} s, "
        f"{hostile['health_checks']} health checks, {hostile['crashes']} crashes"
    )
    for column in ("kind", "sent", "right status", "got"):
        table.add_column(column, justify="left" if column in ("kind", "got") else "right")
    for kind, entry in hostile["kinds"].items():
        got = ", ".join(f"{code} {n}" for code, n in sorted(entry["got"].items()))
        table.add_row(
            kind,
            str(entry["sent"]),
            " or ".join(entry["expected"]),
            got if not entry["wrong"] else f"[red]{got}[/]",
        )
    console.print(table)
    sites = summary["sites"]
    console.print(
        f"kills: {verdict(kills['ok'])}; hostile: status {verdict(hostile['right_status'])}, nothing stored "
        f"{verdict(hostile['nothing_stored'])}, run unaffected {verdict(hostile['run_unaffected'])}; site resumes its "
        f"upload ({sites['upload']['chunks_skipped_on_restart']} of {sites['upload']['chunks_in_reply']} chunks kept): "
        f"{verdict(sites['upload']['ok'])}; disk full said and rejoined: {verdict(sites['disk_full']['ok'])}"
    )
    if "listeners" in summary:
        console.print(
            "\n".join(listener_markdown(summary["listeners"])), markup=False, highlight=False
        )
        console.print(f"slow clients and long strings: {verdict(summary['listeners']['ok'])}")


def _yes(value: bool) -> str:
    return "yes" if value else "[red]NO[/]"


def markdown(summary: dict[str, Any]) -> str:
    """reliability.md: the same tables as the console's, for the record."""
    kills, hostile, sites = summary["kills"], summary["hostile"], summary["sites"]
    lines = [
        f"# Reliability campaign{' (quick)' if summary['quick'] else ''}",
        "",
        f"## kill -9 of the coordinator: {kills['kills']} kills (reference run {kills['reference_s']:.0f} s, "
        f"{kills['reference_accepted']} accepted updates)",
        "",
        "| run | kills | rounds done at each kill | seconds | finished | identical final model "
        "| 3 sites every round | each update accepted once |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, run in enumerate(kills["runs"]):
        marks = [
            "yes" if run[k] else "NO"
            for k in ("finished", "same_model", "all_sites_every_round", "accepted_once")
        ]
        lines.append(
            f"| {i} | {run['kills']} | {', '.join(str(k['rounds_done']) for k in run['killed_at'])} | "
            f"{run['seconds']:.0f} | {' | '.join(marks)} |"
        )
    lines += [
        "",
        f"## {hostile['requests']} hostile requests ({hostile['seconds']:.0f} s, {hostile['crashes']} crashes in "
        f"{hostile['health_checks']} health checks)",
        "",
        "| kind | sent | right status | got |",
        "|---|---|---|---|",
    ]
    for kind, entry in hostile["kinds"].items():
        got = ", ".join(f"{code} {n}" for code, n in sorted(entry["got"].items()))
        lines.append(f"| {kind} | {entry['sent']} | {' or '.join(entry['expected'])} | {got} |")
    lines += [
        "",
        f"Nothing stored: {hostile['nothing_stored']}; run unaffected (same final model as without the "
        f"attack): {hostile['run_unaffected']}.",
        "",
        "## Sites",
        "",
        f"- killed mid-upload: {sites['upload']['chunks_held_after_kill']} chunks held by the coordinator after "
        f"the kill, {sites['upload']['chunks_skipped_on_restart']} of {sites['upload']['chunks_in_reply']} not "
        f"sent again after the restart; run {sites['upload']['run_status']}, sites per round "
        f"{sites['upload']['sites_ok']}.",
        f"- disk full: reply `{sites['disk_full']['reply_reason']}`; site log `{sites['disk_full']['site_log_line']}`; "
        f"back with all sites in rounds {sites['disk_full']['rounds_back_with_all_sites']}; run "
        f"{sites['disk_full']['run_status']}.",
        "",
    ]
    if "listeners" in summary:
        lines += listener_markdown(summary["listeners"])
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> None:
    """Left: when each kill happened; right: the statuses of the hostile requests by kind."""
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [1, 1.6]}
    )
    for i, run in enumerate(summary["kills"]["runs"]):
        left.scatter(
            [k["after_s"] for k in run["killed_at"]],
            [i] * run["kills"],
            marker="x",
            color="tab:green" if run["ok"] else "tab:red",
        )
    left.set_xlabel("seconds into the run")
    left.set_ylabel("run")
    left.set_title(f"{summary['kills']['kills']} kill -9 moments (green: identical final model)")
    kinds = list(summary["hostile"]["kinds"])
    codes = sorted(
        {code for entry in summary["hostile"]["kinds"].values() for code in entry["got"]}
    )
    bottom = [0] * len(kinds)
    for code in codes:
        counts = [summary["hostile"]["kinds"][kind]["got"].get(code, 0) for kind in kinds]
        right.barh(kinds, counts, left=bottom, label=code)
        bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
    right.invert_yaxis()
    right.legend(fontsize=7)
    right.set_xlabel("requests")
    right.set_title("status of each hostile request, by kind")
    right.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
