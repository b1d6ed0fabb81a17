"""The wire benchmark's report: tables on the console and the PNG plot (`benchmarks/wire.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
from rich.console import Console
from rich.table import Table

from hydrafl.benchmarks._common import verdict
from hydrafl.server.blobs import WRITERS

GIB = 1 << 30
GOAL_RATIO = 0.7
GOAL_EXTRA_UPDATES = 3.0


def print_tables(summary: dict[str, Any]) -> None:
    tput, parts, mem = summary["throughput"], summary["components"], summary["memory"]
    console = Console()
    size = tput["update_bytes"] / GIB
    table = Table(
        title=f"one {size:g} GiB update over loopback ({tput['chunks']} chunks), median of {tput['reps']}"
    )
    for column in ("path", "median s", "GiB/s", "runs s"):
        table.add_column(column, justify="right")
    for name in ("hydrafl", "raw"):
        runs = " ".join(f"{run['seconds']:.2f}" for run in tput["runs"][name])
        table.add_row(name, f"{tput['median_s'][name]:.2f}", f"{tput['gib_per_s'][name]:.3f}", runs)
    console.print(table)
    checks = tput["checks"]
    console.print(
        f"hydrafl/raw throughput {tput['ratio_hydrafl_over_raw']:.2f}: {verdict(tput['goal_met'])} (goal >= "
        f"{GOAL_RATIO:g}); accepted and byte-exact: {verdict(checks['passed'], 'PASS', 'FAIL')}"
    )
    down = summary["download"]
    console.print(
        f"download of the same size: hydrafl {down['gib_per_s']['hydrafl']:.3f} GiB/s, raw "
        f"{down['gib_per_s']['raw']:.3f} GiB/s, ratio {down['ratio_hydrafl_over_raw']:.2f}: "
        f"{verdict(down['goal_met'])} (goal >= {GOAL_RATIO:g}); byte-exact: "
        f"{verdict(down['checks']['passed'], 'PASS', 'FAIL')} (the coordinator stored the model in "
        f"{down['coordinator_store_median_s']:.2f} s, once per round)"
    )
    beside = summary["raw_beside_floor"]["median_s"]
    console.print(
        f"the raw stream while the coordinator's process writes the same bytes durably: both end after "
        f"{beside['both']:.2f} s (the stream {beside['raw']:.2f} s, the writes {beside['floor']:.2f} s), against the "
        f"stream alone {tput['median_s']['raw']:.2f} s: raw / both at once = "
        f"{tput['median_s']['raw'] / beside['both']:.2f}, hydrafl's upload {tput['ratio_hydrafl_over_raw']:.2f}"
    )
    if summary.get("throughput_tmpfs"):
        shm = summary["throughput_tmpfs"]
        console.print(
            f"with the coordinator's database and blobs on tmpfs: hydrafl {shm['gib_per_s']['hydrafl']:.3f} GiB/s, "
            f"raw {shm['gib_per_s']['raw']:.3f} GiB/s, ratio {shm['ratio_hydrafl_over_raw']:.2f} "
            f"(reported, not a goal: the goal is for a disk-backed store); accepted and byte-exact: "
            f"{verdict(shm['checks']['passed'], 'PASS', 'FAIL')}"
        )
    table = Table(
        title=f"where hydrafl's time goes ({size:g} GiB; phases median, components timed alone)"
    )
    table.add_column("step")
    table.add_column("seconds", justify="right")
    table.add_column("what", justify="left")
    phases, median = tput["hydrafl_phases_median_s"], parts["median_s"]
    rows = [
        ("HasChunks", phases["ask_s"], "one call with the first chunk's XXH3-128 name: a resume?"),
        (
            "PutChunks",
            phases["put_s"],
            "stream; the site names each chunk as it sends it; the coordinator's writer "
            "threads check XXH3 and write its pack past the page cache",
        ),
        ("PushReply", phases["push_s"], "coordinator checks sizes, one syncfs, records"),
        (
            "  XXH3-128",
            median["upload_digest_s"],
            "one pass over the bytes (done 2x on the path: site, coordinator)",
        ),
        (
            "  BLAKE3, pool",
            median["content_digest_s"],
            "what naming the bytes as a model to send would cost",
        ),
        (
            "  pack puts + sync",
            median["blob_put_s"],
            f"UploadPacks.put_stream of every chunk, then sync ({parts['filesystem']})",
        ),
        ("  of which sync", median["sync_s"], "put_stream + sync minus put_stream alone"),
        (
            "  durable floor",
            median["durable_floor_s"],
            f"O_DIRECT into one preallocated file, then one sync, {WRITERS} threads: "
            f"raw/floor = {tput['median_s']['raw'] / median['durable_floor_s']:.2f}",
        ),
        (
            "  PushReply work",
            median["push_reply_work_s"],
            f"check_reply + sync, no RPC; holds {parts['push_reply_peak_updates']:.1f} updates",
        ),
        (
            "  SQLite per push",
            median["sqlite_per_push_s"],
            "3 authenticates, outbound, run, add_reply, audit",
        ),
    ]
    for step, seconds, what in rows:
        table.add_row(step, f"{seconds:.3f}", what)
    console.print(table)
    table = Table(
        title=f"coordinator RSS while {mem['sites']} sites push {mem['update_mb']:.0f} MB each at once"
    )
    for column in (
        "idle MB",
        "peak MB",
        "extra MB",
        "extra updates",
        "VmHWM MB",
        "1 s after MB",
        "PushReply at once",
        "wall s",
    ):
        table.add_column(column, justify="right")
    table.add_row(
        f"{mem['idle_mb']:.0f}",
        f"{mem['peak_mb']:.0f}",
        f"{mem['peak_extra_mb']:.0f}",
        f"{mem['peak_extra_updates']:.2f}",
        f"{mem['vmhwm_mb']:.0f}",
        f"{mem['after_mb']:.0f}",
        str(mem["max_concurrent"]["PushReply"]),
        f"{mem['wall_s']:.1f}",
    )
    console.print(table)
    console.print(
        f"peak extra {mem['peak_extra_updates']:.2f} updates: {verdict(mem['goal_met'])} (goal < "
        f"{GOAL_EXTRA_UPDATES:g}); all accepted: {verdict(mem['checks']['passed'], 'PASS', 'FAIL')}"
    )


def plot(summary: dict[str, Any], path: Path) -> None:
    tput, parts, mem = summary["throughput"], summary["components"], summary["memory"]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.5))
    down = summary["download"]
    left.bar(
        [0, 1, 3, 4],
        [
            tput["gib_per_s"]["hydrafl"],
            tput["gib_per_s"]["raw"],
            down["gib_per_s"]["hydrafl"],
            down["gib_per_s"]["raw"],
        ],
        color=["tab:blue", "tab:gray"] * 2,
    )
    left.set_xticks(
        [0, 1, 3, 4],
        ["hydrafl\nupload", "raw gRPC\nupload", "hydrafl\ndownload", "raw gRPC\ndownload"],
    )
    left.set_ylabel("GiB/s (site side, loopback)")
    left.set_title(
        f"hydrafl/raw: up {tput['ratio_hydrafl_over_raw']:.2f}, down {down['ratio_hydrafl_over_raw']:.2f} "
        f"(goal >= {GOAL_RATIO:g})"
    )
    phases, median = tput["hydrafl_phases_median_s"], parts["median_s"]
    names = ["HasChunks", "PutChunks", "PushReply", "XXH3", "pack puts", "sync", "PushReply\nwork"]
    values = [
        phases["ask_s"],
        phases["put_s"],
        phases["push_s"],
        median["upload_digest_s"],
        median["blob_put_s"],
        median["sync_s"],
        median["push_reply_work_s"],
    ]
    middle.barh(names[::-1], values[::-1], color=["tab:orange"] * 4 + ["tab:blue"] * 3)
    middle.axvline(
        tput["median_s"]["raw"], color="gray", linestyle=":", label="raw stream, whole update"
    )
    middle.set_xlabel("seconds")
    middle.set_title(
        f"hydrafl phases (blue) and components (orange), {tput['update_bytes'] / GIB:g} GiB"
    )
    middle.legend()
    trace = np.array(mem["rss_trace"])
    right.plot(trace[:, 0], trace[:, 1], color="tab:blue", label="coordinator RSS")
    for k, style in ((1, "--"), (GOAL_EXTRA_UPDATES, ":")):
        level = mem["idle_mb"] + k * mem["update_mb"]
        right.axhline(level, color="gray", linestyle=style, label=f"idle + {k:g} updates")
    for start, end in mem["push_windows"]:
        right.axvspan(start, end, color="tab:orange", alpha=0.08)
    right.set_xlim(left=min(-1.0, trace[0, 0]))
    right.set_xlabel("seconds since the pushes started (orange: PushReply calls)")
    right.set_ylabel("MB")
    right.set_title(
        f"{mem['sites']} sites x {mem['update_mb']:.0f} MB: peak extra {mem['peak_extra_updates']:.1f} updates"
    )
    right.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
