"""Site-side faults for the reliability campaign: a site killed in the middle of an upload and restarted, and a
site whose disk fills up.

Run as a module, this is a site that kills itself (SIGKILL, no cleanup) once it has streamed half of its first
multi-chunk upload: `python -m hydrafl.benchmarks._reliability_site --coordinator HOST:PORT` with the token in
$HYDRAFL_SITE_TOKEN. Everything else it does as `hydrafl site` does, so the site restarted after it
(`--restarted`, the same agent, not dying) trains the same reply and finds the chunks already sent.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flwr.app import Message

from hydrafl.apps import client_app
from hydrafl.benchmarks._reliability_cluster import RUN, Cluster, Limits, wait_until
from hydrafl.client.agent import SiteAgent
from hydrafl.proto.chunk_wire import CoordinatorClient
from hydrafl.proto.envelope import split_message

RESUMED = re.compile(r"upload: (\d+) of (\d+) chunks already at the coordinator")
DISK_FULL = re.compile(r"disk full: [^;]*;")
DISK_LIMIT_BYTES = 160 << 10
"""The disk-full site's file-size limit: above its log's size, below the ~285 kB its training processes save
(RLIMIT_FSIZE: writes past it fail with EFBIG, as a full disk fails them with ENOSPC)."""
FILE_SIZE_LIMIT: Limits = {resource.RLIMIT_FSIZE: (DISK_LIMIT_BYTES, resource.RLIM_INFINITY)}


class DyingAgent(SiteAgent):
    """Streams half of its first upload of two chunks or more, then dies."""

    def _push(self, stub: CoordinatorClient, reply: Message, server_round: int) -> None:
        _, chunks = split_message(reply, server_round)
        if len(chunks) < 2:
            return super()._push(stub, reply, server_round)
        half = list(chunks)[: len(chunks) // 2]

        def stream() -> Iterator[tuple[str, memoryview]]:
            for digest in half:
                yield digest, chunks[digest]
            time.sleep(
                1.0
            )  # the half in flight reaches the coordinator; then the process dies mid-stream
            logging.getLogger(__name__).warning(
                "killing this site mid-upload after %d of %d chunks", len(half), len(chunks)
            )
            os.kill(os.getpid(), signal.SIGKILL)

        stub.PutChunks(stream(), metadata=self.metadata)


def site_upload_resume(root: Path, timeout_s: float = 600) -> dict[str, Any]:
    """Three sites, one killed halfway through its first upload and restarted with the same token (the site
    agent `hydrafl site` runs, streaming its replies as a model over one chunk does): what the coordinator held
    from the dead upload, what the restarted site skipped, the run's end."""
    cfg = RUN.replace(rounds=2)
    cluster = Cluster(root, ["steady-0", "steady-1", "dying"])
    started = time.perf_counter()
    restarted: subprocess.Popen | None = None
    try:
        run_id = cluster.queue(cfg)
        cluster.start_coordinator()
        for name in ("steady-0", "steady-1"):
            cluster.start_site(name)
        env = {**cluster.env, "HYDRAFL_SITE_TOKEN": cluster.tokens["dying"]}
        with cluster.site_log("dying").open("a") as log:
            dying = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "hydrafl.benchmarks._reliability_site",
                    "--coordinator",
                    cluster.address,
                ],
                env=env,
                stdout=log,
                stderr=log,
            )
        killed = dying.wait(timeout_s) == -signal.SIGKILL
        node = next(site.node_id for site in cluster.store.sites() if site.name == "dying")
        held = sum(1 for p in (root / "blobs" / "sites" / str(node)).rglob("*") if p.is_file())
        with cluster.site_log("dying").open("a") as log:
            restarted = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "hydrafl.benchmarks._reliability_site",
                    "--coordinator",
                    cluster.address,
                    "--restarted",
                ],
                env=env,
                stdout=log,
                stderr=log,
            )
        status = cluster.wait_run(run_id, timeout_s)
        outcome = cluster.outcome(run_id)
        match = RESUMED.search(_read(cluster.site_log("dying")))
        return {
            "killed_mid_upload": killed,
            "chunks_held_after_kill": held,
            "chunks_skipped_on_restart": int(match.group(1)) if match else 0,
            "chunks_in_reply": int(match.group(2)) if match else 0,
            "run_status": status,
            "sites_ok": outcome.sites_ok,
            "seconds": time.perf_counter() - started,
            "ok": bool(
                killed
                and match
                and int(match.group(1)) > 0
                and status == "finished"
                and outcome.sites_ok == [cfg.sites] * cfg.rounds
            ),
        }
    finally:
        if restarted is not None:
            restarted.kill()
            restarted.wait()
        cluster.close()


def site_disk_full(root: Path, rounds: int = 3, timeout_s: float = 900) -> dict[str, Any]:
    """Three sites, one training with two processes (whose temporary files are the site's only writes) under a
    file-size limit below what they save: its first round fails with a "disk full" reply and log line, the
    run goes on with the other two (min-sites 2); the limit lifted, the site trains the next round."""
    cfg = RUN.replace(rounds=rounds, min_sites=2)
    cluster = Cluster(root, ["full", "steady-0", "steady-1"])
    started = time.perf_counter()
    try:
        cluster.start_coordinator()
        full = cluster.start_site("full", "--nproc", "2", limits=FILE_SIZE_LIMIT)
        for name in ("steady-0", "steady-1"):
            cluster.start_site(name)
        wait_until(
            lambda: all("joined as" in _read(cluster.site_log(n)) for n in cluster.tokens),
            timeout_s,
            "the sites did not join",
        )
        run_id = cluster.queue(
            cfg
        )  # queued once all three have joined: every round samples all three
        wait_until(
            lambda: bool(_declined(cluster, run_id)),
            timeout_s,
            "the disk-full site never failed a round",
        )
        resource.prlimit(
            full.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
        )
        status = cluster.wait_run(run_id, timeout_s)
        outcome = cluster.outcome(run_id)
        reasons = _declined(cluster, run_id)
        log_lines = DISK_FULL.findall(_read(cluster.site_log("full")))
        failed_round = int(reasons[0].split()[1]) if reasons else 0
        back = [i + 1 for i, ok in enumerate(outcome.sites_ok) if ok == 3 and i + 1 > failed_round]
        return {
            "reply_reason": reasons[0] if reasons else "",
            "site_log_line": log_lines[0] if log_lines else "",
            "failed_round": failed_round,
            "rounds_back_with_all_sites": back,
            "run_status": status,
            "sites_ok": outcome.sites_ok,
            "seconds": time.perf_counter() - started,
            "ok": bool(
                reasons
                and "disk full" in reasons[0]
                and log_lines
                and back
                and status == "finished"
            ),
        }
    finally:
        cluster.close()


def _declined(cluster: Cluster, run_id: int) -> list[str]:
    return [
        e.detail
        for e in cluster.store.audit_events("site-declined")
        if e.run_id == run_id and e.site_name == "full"
    ]


def _read(path: Path) -> str:
    """A log's text with every run of whitespace one space (the console wraps long lines)."""
    return re.sub(r"\s+", " ", path.read_text(errors="replace")) if path.exists() else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--coordinator", required=True)
    parser.add_argument(
        "--restarted",
        action="store_true",
        help="the site restarted after the kill: it does not die",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    agent = SiteAgent if args.restarted else DyingAgent
    # every reply streams (the campaign's small model would otherwise travel inline, in one call, with nothing
    # to resume): what a model larger than one chunk does
    agent(
        args.coordinator,
        os.environ["HYDRAFL_SITE_TOKEN"],
        client_app,
        {},
        demo=True,
        inline_bytes=0,
    ).run()


if __name__ == "__main__":
    main()
