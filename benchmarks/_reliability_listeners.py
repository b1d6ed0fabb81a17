"""The reliability benchmark's slow-client and long-string campaign (issue 28): a `hydrafl server --dashboard`
at 1,024 descriptors, long-name pushes from an enrolled site, idle and trickling connections to both listeners."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
from rich.progress import Progress

from hydrafl.benchmarks._reliability_cluster import RUN, Cluster, cluster_wait, free_port
from hydrafl.benchmarks._reliability_hostile import (
    INVALID,
    Attacker,
    SerialisedAgent,
    add_earlier_run,
    open_train_message,
    push_long_name,
    start_agent,
)
from hydrafl.benchmarks._reliability_sockets import (
    HealthProbe,
    Trickle,
    closed_by_peer,
    descriptors,
    held_connections,
    idlers,
    limit_descriptors,
)

LONG_NAME, HUGE_NAME = 100_000, 7 << 20
DESCRIPTORS = 1_024
DASHBOARD_TOKEN = "reliability-dashboard-token-0123456789"
DASHBOARD_CAP, GRPC_CAP = 64, 512


def listener_campaign(
    work: Path, idle: int, long_pushes: int, huge_pushes: int, seed: int, progress: Progress
) -> dict[str, Any]:
    """Slow clients to the dashboard's and the sites' ports, then long-string pushes from an enrolled site,
    against a real `hydrafl server --dashboard` at 1,024 descriptors driving a run; the health check every
    second throughout. Per attack what it held and cost; `ok` when the coordinator lived through all of it."""
    names = ["hospital-0", "hospital-1", "mallory", "revoked"]
    cluster = Cluster(work, names)
    cluster.store.revoke_site("revoked")
    mallory = next(site.node_id for site in cluster.store.sites() if site.name == "mallory")
    cfg = RUN.replace(
        sites=3, min_sites=2, rounds=400
    )  # outlasts the campaign (stopped, not finished); a
    # round mallory fails goes on with the honest two
    earlier = add_earlier_run(
        cluster.store,
        {k: v for k, v in cfg.to_flower().items() if k not in ("run-dir", "resume")},
        mallory,
    )
    run_id = cluster.queue(cfg)
    board_port = free_port()
    attacker = Attacker(
        cluster.address, cluster.address, cluster.store, run_id, cluster.tokens, earlier, seed
    )
    task = progress.add_task("slow clients, long strings: starting", total=None)
    probe = thread = stop = None
    conns: list = []
    result: dict[str, Any] = {
        "descriptor_limit": DESCRIPTORS,
        "idle": idle,
        "load_before": os.getloadavg(),
        "cpus": os.cpu_count(),
    }
    try:
        coordinator = cluster.start_coordinator(
            120,
            "--dashboard",
            str(board_port),
            extra_env={"HYDRAFL_DASHBOARD_TOKEN": DASHBOARD_TOKEN},
            limits=limit_descriptors(DESCRIPTORS),
        )
        pid = coordinator.pid
        for name in ("hospital-0", "hospital-1"):
            cluster.start_site(name)
        thread, stop = start_agent(cluster.address, cluster.tokens["mallory"])
        probe = HealthProbe(cluster.address)
        cluster_wait(attacker.ready, cluster, run_id)
        time.sleep(2)
        result["descriptors_before"] = descriptors(pid, DESCRIPTORS)
        attacks: list[dict[str, Any]] = []

        # long strings first, while the run has rounds to answer. Each kind in a quiet window: the honest sites
        # are stopped (SIGSTOP) and mallory's agent held, so the round waits and the database and log grow only by
        # what the refusals add; every push answers mallory's open train message (the first refusal answers it
        # for good, the next ones are checked and refused all the same).
        for label, chars, count, together in (
            ("100,000-char tensor names, one a second", LONG_NAME, long_pushes, 1),
            ("7 MB tensor names, 8 at once", HUGE_NAME, huge_pushes, 8),
        ):
            progress.update(task, description=f"pushes: {label}")
            with _open_message_held(attacker) as target, _stopped(cluster.sites.values()):
                time.sleep(1.0)
                probe.phase = label
                db_before, log_before = _db_bytes(cluster), _log_bytes(cluster)
                rows_before = _refusal_rows(cluster, "mallory")
                outcomes: list[tuple[Any, str, float]] = []
                started = time.perf_counter()
                while len(outcomes) < count:
                    batch = min(together, count - len(outcomes))
                    outcomes += _at_once(attacker, chars, batch, target)
                    if len(outcomes) < count:
                        time.sleep(max(0.0, 1.0 - (time.perf_counter() - started) % 1.0))
                time.sleep(3)  # the health checks after the last push count too
                db_added, log_added = (
                    _db_bytes(cluster) - db_before,
                    _log_bytes(cluster) - log_before,
                )
                rows = _refusal_rows(cluster, "mallory")
            refused = sum(code == INVALID for code, _, _ in outcomes)
            attacks.append(
                {
                    "attack": label,
                    "size": count,
                    "port": "sites (gRPC)",
                    "refused": refused,
                    "statuses": sorted(
                        {f"{code.name}: {details[:90]}" for code, details, _ in outcomes}
                    ),
                    "push_max_s": max(s for _, _, s in outcomes),
                    "health": probe.summary(label),
                    "db_bytes_added": db_added,
                    "log_bytes_added": log_added,
                    "db_bytes_per_refusal": db_added / max(refused, 1),
                    "log_bytes_per_refusal": log_added / max(refused, 1),
                    "audit_rows_added": rows[0] - rows_before[0],
                    "audit_refusals_counted": rows[1] - rows_before[1],
                    "audit_detail_chars_max": rows[2],
                }
            )
            probe.phase = "between"

        # slow clients: the dashboard's port, then the sites' port
        for label, port, cap in (
            ("idle connections to the dashboard", board_port, DASHBOARD_CAP),
            ("idle connections to the sites' port", cluster.port, GRPC_CAP),
        ):
            progress.update(task, description=f"slow clients: {label}")
            probe.phase = label
            trickle = Trickle(board_port, max(1, idle // 20)) if port == board_port else None
            conns = idlers(port, pid, idle, DESCRIPTORS)
            peak_held = peak_fds = 0
            metrics_ms: list[float] = []
            hold_until = time.monotonic() + (
                14.0 if port == board_port else 6.0
            )  # past the 10 s request timeout
            while time.monotonic() < hold_until:
                peak_held = max(peak_held, held_connections(pid, port))
                peak_fds = max(peak_fds, descriptors(pid, DESCRIPTORS))
                if port == board_port:
                    metrics_ms.append(_metrics_ms(board_port))
                time.sleep(0.5)
            entry = {
                "attack": label,
                "size": len(conns),
                "port": "dashboard" if port == board_port else "sites (gRPC)",
                "cap": cap,
                "held_peak": peak_held,
                "descriptors_peak": peak_fds,
                "closed_by_coordinator": closed_by_peer(conns),
                "health": probe.summary(label),
                "alive": coordinator.poll() is None,
            }
            if trickle is not None:
                trickle.close()
                entry.update(
                    slow_clients=len(trickle.conns),
                    slow_closed=len(trickle.closed_after),
                    slow_closed_after_s_max=max(
                        trickle.closed_after.values(), default=float("nan")
                    ),
                    dashboard_requests=len(metrics_ms),
                    dashboard_request_ms_max=max(
                        (ms for ms in metrics_ms if ms != float("inf")), default=float("nan")
                    ),
                    dashboard_requests_failed=sum(ms == float("inf") for ms in metrics_ms),
                )
            for conn in conns:
                conn.close()
            conns = []
            attacks.append(entry)
            time.sleep(1)
        probe.phase = "after"
        time.sleep(2.5)
        run = cluster.store.run(run_id)
        result.update(
            attacks=attacks,
            health_after=probe.summary("after"),
            alive=coordinator.poll() is None,
            run_status=run.status,
            rounds_done=run.rounds_done,
            load_after=os.getloadavg(),
        )
        result["ok"] = bool(
            result["alive"]
            and run.status == "running"
            and all(a["health"]["failed"] == 0 for a in attacks)
        )
        return result
    finally:
        for conn in conns:
            conn.close()
        if probe is not None:
            probe.close()
        if stop is not None and thread is not None:
            stop.set()
            thread.join(10)
        attacker.close()
        cluster.close()
        progress.remove_task(task)


@contextlib.contextmanager
def _open_message_held(attacker: Attacker, timeout_s: float = 120) -> Iterator[str]:
    """Mallory's agent held (`SerialisedAgent.lock`) at a moment it has a train message it has not answered; its
    id. The lock is let go between looks: the agent must answer its other messages (evaluate) meanwhile."""
    deadline = time.monotonic() + timeout_s
    while True:
        with SerialisedAgent.lock:
            target = open_train_message(attacker)
            if target is not None:
                yield target
                return
        if time.monotonic() > deadline:
            raise TimeoutError("mallory was sent no train message to answer")
        time.sleep(0.1)


@contextlib.contextmanager
def _stopped(processes: Iterable[subprocess.Popen]) -> Iterator[None]:
    """`processes` stopped (SIGSTOP) for the block, continued after it."""
    stopped = [p for p in processes if p.poll() is None]
    for process in stopped:
        process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for process in stopped:
            process.send_signal(signal.SIGCONT)


def _at_once(
    attacker: Attacker, chars: int, count: int, reply_to: str | None
) -> list[tuple[Any, str, float]]:
    """`count` long-name pushes sent together (from threads when more than one); the odd ones name a record key."""
    if count == 1:
        return [push_long_name(attacker, chars, reply_to=reply_to)]
    outcomes: list[tuple[Any, str, float]] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        outcome = push_long_name(attacker, chars, key=i % 2 == 1, reply_to=reply_to)
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def _db_bytes(cluster: Cluster) -> int:
    """The database's files (SQLite's main file, its WAL and shared memory), once the WAL has been written back
    and truncated (a WAL file keeps its size once grown: only the main file's growth says what was added)."""
    with cluster.store.engine.connect() as connection:
        connection.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    db = cluster.root / "coordinator.db"
    return sum(path.stat().st_size for path in db.parent.glob(db.name + "*"))


def _log_bytes(cluster: Cluster) -> int:
    return (cluster.root / "coordinator.log").stat().st_size


def _refusal_rows(cluster: Cluster, site: str) -> tuple[int, int, int]:
    """`site`'s update-rejected audit rows, the refusals they count, the longest detail."""
    rows = [e for e in cluster.store.audit_events("update-rejected") if e.site_name == site]
    return (
        len(rows),
        sum(e.count or 1 for e in rows),
        max((len(e.detail or "") for e in rows), default=0),
    )


def _metrics_ms(port: int) -> float:
    """One authorised /metrics request to the dashboard, in ms (inf when it failed)."""
    started = time.perf_counter()
    try:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/metrics",
            headers={"Authorization": f"Bearer {DASHBOARD_TOKEN}"},
        )
        with urllib.request.urlopen(request, timeout=10) as reply:
            reply.read()
            return (time.perf_counter() - started) * 1e3 if reply.status == 200 else float("inf")
    except OSError:
        return float("inf")


def listener_markdown(part: dict[str, Any]) -> list[str]:
    """The slow-client and long-string table, and the conditions it ran in."""
    load = ", ".join(f"{x:.1f}" for x in part["load_before"])
    load_after = ", ".join(f"{x:.1f}" for x in part.get("load_after", []))
    lines = [
        f"## Slow clients and long strings{' (quick)' if part.get('quick') else ''}",
        "",
        f"A `hydrafl server --dashboard` held at {part['descriptor_limit']:,} descriptors "
        f"({part['descriptors_before']} open before the attacks), driving a run of 2 site processes and mallory's "
        f"agent; gRPC health checked every second. Machine: {part['cpus']} CPUs, load average {load} at the start "
        f"and {load_after} at the end (another test run was going on the same machine).",
        "",
        "| attack | size | connections held by the coordinator (cap) | health check median / max | refused | "
        "database bytes per refused push | log bytes per refused push |",
        "|---|---|---|---|---|---|---|",
    ]
    for a in part["attacks"]:
        health = a["health"]
        latency = (
            f"{health['median_ms']:.0f} / {health['max_ms']:.0f} ms "
            f"({health['checks']} checks, {health['failed']} failed)"
        )
        if "held_peak" in a:
            lines.append(
                f"| {a['attack']} | {a['size']} | {a['held_peak']} ({a['cap']}) | {latency} | - | - | - |"
            )
        else:
            lines.append(
                f"| {a['attack']} | {a['size']} pushes | - | {latency} | {a['refused']} | "
                f"{a['db_bytes_per_refusal']:,.0f} | {a['log_bytes_per_refusal']:,.0f} |"
            )
    lines.append("")
    for a in part["attacks"]:
        if "held_peak" in a:
            extra = (
                f"; {a['slow_clients']} clients sending a byte every 0.2 s: {a['slow_closed']} dropped, the last "
                f"after {a['slow_closed_after_s_max']:.1f} s; "
                f"of {a['dashboard_requests']} authorised /metrics requests "
                f"beside them {a['dashboard_requests_failed']} were closed unanswered (the cap was full), the others "
                f"took at most {a['dashboard_request_ms_max']:.0f} ms"
                if "slow_clients" in a
                else ""
            )
            lines.append(
                f"- {a['attack']}: coordinator descriptors at most {a['descriptors_peak']}; "
                f"{a['closed_by_coordinator']} of {a['size']} closed by the coordinator by the end{extra}."
            )
        else:
            lines.append(
                f"- {a['attack']}: slowest refusal {a['push_max_s']:.2f} s; {a['audit_rows_added']} audit rows "
                f"added for {a['audit_refusals_counted']} refusals (longest detail {a['audit_detail_chars_max']} "
                f"chars); {a['db_bytes_added']:,} database and {a['log_bytes_added']:,} log bytes in all (honest "
                f"sites stopped meanwhile); statuses: {'; '.join(f'`{x}`' for x in a['statuses'])}."
            )
    lines += [
        f"- after: coordinator alive {part['alive']}, run {part['run_status']} at round {part['rounds_done']}; "
        f"health after the attacks {part['health_after']['median_ms']:.0f} ms median.",
        "",
    ]
    return lines
