"""Running it for months: a coordinator killed at random moments, hostile requests against a running one, a
site killed mid-upload and a site whose disk fills up.

    python -m hydrafl.benchmarks.reliability [--kills 20] [--requests 10000] [--quick] [--out DIR]

1. Kills. A reference 10-round FedAvg run (3 tabular site processes, fixed seed) runs uninterrupted; then runs
   of the same configuration whose coordinator is kill -9'd at seeded random moments (uniform over the
   reference's duration, 5 kills a run) and restarted on the same database and blobs, until --kills kills
   have happened. Each must finish with final arrays bitwise equal to the reference's, every round answered
   by all 3 sites, and every update accepted exactly once (no audit `update-accepted` twice, as many as the
   reference).
2. Hostile requests. The same sites plus the attacker's own enrolled site (its honest agent in this process)
   drive a run; --requests hostile requests of 17 kinds (`_reliability_hostile.KINDS`) are sent while it
   runs. Each kind's statuses are tallied against the right ones, the coordinator's health is checked every
   250 requests, and the run must end with the final model, replies, outbound messages and blob files of the
   same run without the attack.
3. Sites. A site killed halfway through an upload and restarted resumes it (the chunks it had sent are not
   sent again); a site whose training processes cannot write their temporary files fails its round with a
   "disk full" reply and log line, and trains again once the space is back.
4. Slow clients and long strings (issue 28). A `hydrafl server --dashboard` held at 1,024 descriptors drives a
   run of 2 site processes and mallory's agent (min 2 sites a round). Mallory pushes replies whose tensor names
   (or record keys) are 100,000 characters (one a second) and 7 MB (8 at once), each kind while the honest
   sites are stopped, so that the database and the log grow only by what the refusals add; then --idle
   connections that never send a byte (and --idle/20 that send a request one byte every 0.2 s) are opened to
   the dashboard's port and held past its request timeout, then --idle to the sites' port. The gRPC health
   check runs every second throughout. Per attack: connections the coordinator held (its sockets on that
   port, from /proc) against its cap, health-check latency, and for the pushes the bytes added to the
   database and the log per refused push. `--only listeners` runs this part alone and keeps the other parts'
   results in --out.

Writes reliability.json, reliability.md and reliability.png under --out (`_reliability_report`).
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress, TaskID

from hydrafl.benchmarks._common import benchmark_parser
from hydrafl.benchmarks._reliability_cluster import (
    RUN,
    Cluster,
    RunOutcome,
    cluster_wait,
    run_clean,
)
from hydrafl.benchmarks._reliability_hostile import (
    FORGED,
    KINDS,
    Attacker,
    Tally,
    add_earlier_run,
    attack,
    start_agent,
)
from hydrafl.benchmarks._reliability_listeners import listener_campaign
from hydrafl.benchmarks._reliability_report import markdown, plot, print_tables
from hydrafl.benchmarks._reliability_site import site_disk_full, site_upload_resume
from hydrafl.config import RunConfig

NAME = "reliability"
KILLS_PER_RUN = 5
SITES = [f"hospital-{i}" for i in range(RUN.sites)]
PARTS = ("kills", "hostile", "sites", "listeners")


def kill_campaign(
    work: Path, cfg: RunConfig, kills: int, seed: int, progress: Progress
) -> dict[str, Any]:
    """The reference run, then killed runs until `kills` kills; per run what the goal checks."""
    task = progress.add_task("reference run", total=None)
    reference, reference_s = run_clean(work / "reference", cfg)
    progress.update(
        task, description=f"kills (reference {reference_s:.0f} s)", total=kills, completed=0
    )
    rng = random.Random(seed)
    runs: list[dict[str, Any]] = []
    done = 0
    while done < kills:
        run = _killed_run(
            work / f"killed-{len(runs)}",
            cfg,
            min(KILLS_PER_RUN, kills - done),
            reference_s,
            rng,
            lambda: progress.advance(task),
        )
        run.update(_compare(run.pop("outcome"), reference))
        runs.append(run)
        done += run["kills"]
    progress.remove_task(task)
    return {
        "reference_s": reference_s,
        "reference_accepted": len(reference.accepted),
        "runs": runs,
        "kills": done,
        "ok": all(run["ok"] for run in runs),
    }


def _killed_run(
    root: Path,
    cfg: RunConfig,
    kills: int,
    reference_s: float,
    rng: random.Random,
    advance: Callable[[], None],
) -> dict[str, Any]:
    """One run whose coordinator is killed `kills` times (fewer when it finishes first) at moments drawn
    uniformly over the reference's duration, each measured from the restart before it."""
    moments = sorted(rng.uniform(0, reference_s) for _ in range(kills))
    gaps = [b - a for a, b in pairwise([0.0, *moments])]
    cluster = Cluster(root, SITES)
    started = time.perf_counter()
    killed_at: list[dict[str, Any]] = []
    try:
        run_id = cluster.queue(cfg)
        cluster.start_coordinator()
        for name in SITES:
            cluster.start_site(name)
        for gap in gaps:
            deadline = time.monotonic() + gap
            while time.monotonic() < deadline and cluster.store.run_status(run_id) not in (
                "finished",
                "failed",
            ):
                time.sleep(0.05)
            if cluster.store.run_status(run_id) in ("finished", "failed"):
                break
            cluster.kill_coordinator()
            killed_at.append(
                {
                    "after_s": round(time.perf_counter() - started, 2),
                    "rounds_done": cluster.store.run(run_id).rounds_done,
                }
            )
            advance()
            cluster.start_coordinator()
        cluster.wait_run(run_id, 20 * reference_s + 300)
        return {
            "kills": len(killed_at),
            "killed_at": killed_at,
            "seconds": time.perf_counter() - started,
            "outcome": cluster.outcome(run_id),
        }
    finally:
        cluster.close()


def _compare(outcome: RunOutcome, reference: RunOutcome) -> dict[str, Any]:
    """What the goal asks of a killed run against the reference."""
    checks = {
        "finished": outcome.status == "finished",
        "same_model": outcome.same_model(reference),
        "all_sites_every_round": outcome.sites_ok
        == reference.sites_ok
        == [RUN.sites] * len(reference.sites_ok),
        "accepted_once": len(outcome.accepted)
        == len(set(outcome.accepted))
        == len(reference.accepted),
    }
    return {
        **checks,
        "detail": outcome.detail,
        "accepted": len(outcome.accepted),
        "ok": all(checks.values()),
    }


def hostile_campaign(
    work: Path, requests: int, rounds: int, seed: int, progress: Progress
) -> dict[str, Any]:
    """A clean run and the same run under `requests` hostile requests; the tallies and what must match."""
    cfg = RUN.replace(sites=RUN.sites + 1, rounds=rounds)
    task = progress.add_task("hostile: clean run", total=None)
    clean, clean_stored, _, _ = _attacked_run(work / "clean", cfg, 0, seed, progress, task)
    progress.update(task, description="hostile requests", total=requests, completed=0)
    attacked, stored, tally, seconds = _attacked_run(
        work / "attacked", cfg, requests, seed, progress, task
    )
    progress.remove_task(task)
    kinds = {
        kind: {
            "sent": tally.sent[kind],
            "expected": sorted(code.name for code in KINDS[kind][0])
            + (["FAILED_PRECONDITION (late)"] if kind in FORGED else []),
            "got": dict(tally.got.get(kind, {})),
            "wrong": dict(tally.wrong.get(kind, {})),
        }
        for kind in KINDS
    }
    checks = {
        "no_crash": tally.crashes == 0,
        "right_status": not tally.wrong,
        "nothing_stored": stored == clean_stored
        and sorted(attacked.accepted) == sorted(clean.accepted)
        and attacked.declined == clean.declined == [],
        "run_unaffected": attacked.status == clean.status == "finished"
        and attacked.same_model(clean)
        and attacked.sites_ok == clean.sites_ok,
    }
    return {
        "requests": sum(tally.sent.values()),
        "seconds": seconds,
        "health_checks": tally.health_checks,
        "crashes": tally.crashes,
        "kinds": kinds,
        **checks,
        "stored_difference": {k: sorted(stored[k] ^ clean_stored[k])[:10] for k in stored},
        "ok": all(checks.values()),
    }


def _attacked_run(
    root: Path, cfg: RunConfig, requests: int, seed: int, progress: Progress, task: TaskID
) -> tuple[RunOutcome, dict[str, set[str]], Tally, float]:
    """`cfg` driven by the three site processes and mallory's own agent; with `requests`, attacked once mallory
    has a reply to forge. The run's outcome, its storage once settled, the tally and the attack's seconds."""
    names = [*SITES, "mallory", "revoked"]
    cluster = Cluster(
        root, names, listen_host="localhost"
    )  # [::1] too: the address auth failures come from
    cluster.store.revoke_site("revoked")
    mallory = next(site.node_id for site in cluster.store.sites() if site.name == "mallory")
    config = {k: v for k, v in cfg.to_flower().items() if k not in ("run-dir", "resume")}
    earlier = add_earlier_run(cluster.store, config, mallory)
    run_id = cluster.queue(cfg)
    attacker = Attacker(
        cluster.address,
        f"[::1]:{cluster.port}",
        cluster.store,
        run_id,
        cluster.tokens,
        earlier,
        seed,
    )
    thread = stop = None
    try:
        cluster.start_coordinator()
        for name in SITES:
            cluster.start_site(name)
        thread, stop = start_agent(cluster.address, cluster.tokens["mallory"])
        tally, seconds = Tally(), 0.0
        if requests:
            cluster_wait(attacker.ready, cluster, run_id)
            started = time.perf_counter()
            tally = attack(
                attacker,
                requests,
                cluster.healthy,
                lambda: cluster.store.run_status(run_id) == "running",
                lambda n: progress.update(task, completed=n),
            )
            seconds = time.perf_counter() - started
        cluster.wait_run(run_id, 1800)
        return cluster.outcome(run_id), cluster.settled(), tally, seconds
    finally:
        if stop is not None and thread is not None:
            stop.set()
            thread.join(10)
        attacker.close()
        cluster.close()


def main() -> None:
    parser = benchmark_parser(
        __doc__, "3 kills of a 3-round run, 500 hostile requests, 300 idle connections"
    )
    parser.add_argument(
        "--kills", type=int, help="coordinator kills in all (default 20; 3 with --quick)"
    )
    parser.add_argument(
        "--requests", type=int, help="hostile requests (default 10000; 500 with --quick)"
    )
    parser.add_argument(
        "--idle", type=int, help="idle connections to each port (default 1100; 300 with --quick)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the kill moments and the hostile requests"
    )
    parser.add_argument(
        "--only",
        choices=PARTS,
        action="append",
        help="run only this part (repeatable); the other parts' results already in --out are kept",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the runs' folders (logs, databases) under --out"
    )
    args = parser.parse_args()
    torch.set_num_threads(
        1
    )  # the attacker's own site trains in this process: the same arithmetic every run
    kills = args.kills or (3 if args.quick else 20)
    requests = args.requests or (500 if args.quick else 10_000)
    idle = args.idle or (300 if args.quick else 1_100)
    cfg = RUN.replace(rounds=3) if args.quick else RUN
    hostile_rounds = max(10, requests // 120)
    parts = args.only or PARTS
    work = Path(tempfile.mkdtemp(prefix="hydrafl-reliability-"))
    started = time.perf_counter()
    summary: dict[str, Any] = {
        "benchmark": NAME,
        "quick": args.quick,
        "seed": args.seed,
        "run": {
            "task": cfg.task,
            "strategy": cfg.strategy,
            "rounds": cfg.rounds,
            "sites": cfg.sites,
        },
    }
    earlier = args.out / f"{NAME}.json"
    if args.only and earlier.exists():  # the parts not run now keep their recorded results
        summary = json.loads(earlier.read_text())
    try:
        with Progress() as progress:
            if "kills" in parts:
                summary["kills"] = kill_campaign(work / "kills", cfg, kills, args.seed, progress)
            if "hostile" in parts:
                summary["hostile"] = hostile_campaign(
                    work / "hostile", requests, hostile_rounds, args.seed, progress
                )
            if "sites" in parts:
                task = progress.add_task("sites: killed mid-upload, disk full", total=None)
                summary["sites"] = {
                    "upload": site_upload_resume(work / "upload"),
                    "disk_full": site_disk_full(work / "disk-full"),
                }
                progress.remove_task(task)
            if "listeners" in parts:
                summary["listeners"] = listener_campaign(
                    work / "listeners",
                    idle,
                    3 if args.quick else 10,
                    2 if args.quick else 8,
                    args.seed,
                    progress,
                )
                summary["listeners"]["quick"] = args.quick
    finally:
        if args.keep:
            shutil.copytree(work, args.out / f"{NAME}-work", dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    if args.only:
        summary.setdefault("part_seconds", {})[",".join(parts)] = time.perf_counter() - started
    else:
        summary["seconds"] = time.perf_counter() - started
    save(summary, args.out)
    print_tables(summary)


def save(summary: dict[str, Any], out: Path) -> None:
    """reliability.json (every number), reliability.md (the tables) and reliability.png under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    for suffix, text in (("json", json.dumps(summary, indent=1)), ("md", markdown(summary))):
        (out / f"{NAME}.{suffix}").write_text(text)
    plot(summary, out / f"{NAME}.png")


if __name__ == "__main__":
    main()
