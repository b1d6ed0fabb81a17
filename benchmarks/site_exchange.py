"""A site's peak resident memory for one exchange (a model down, a pseudo-gradient of its size up) against the
model's size, in memory and through files (`hydrafl site --exchange-memory-mb`).

    python -m hydrafl.benchmarks.site_exchange [--out DIR] [--quick] [--sizes 0.25,1,2,4] [--file-only-from 4]

For each size and mode a real coordinator (in this process) sends a `train` message with a stack of 4096-wide
float32 linear layers to a fresh `hydrafl site` process running the large-model ClientApp
(`benchmarks/_large_site.py`), which answers with delta = 0.01 * start + seeded noise, computed a block of rows
at a time. Modes:

- memory: today's in-memory exchange (`--exchange-memory-mb` above the model) and an app that replies with
  Arrays in memory, as an ordinary ClientApp does;
- file: `--exchange-memory-mb 0`: the download goes into a safetensors file, the app reads it a block at a time
  and writes its reply to a file, which the site uploads a chunk at a time.

Measured in the site process (/proc/PID/status): its resident memory once warm (a tiny message first, so imports
and first buffers are counted before), when its peak is reset to it (`5` to /proc/PID/clear_refs), and its peak
(VmHWM) after the exchange, and the peak of its anonymous memory (RssAnon, sampled every 10 ms: writing
gigabytes fills the page cache, and the kernel then takes back file pages the site maps, which VmHWM counts);
the exchange's growth is the larger of the two differences. The reply's chunk names (XXH3 of every
chunk) must be the same in both modes: bit-identical pseudo-gradients. Sizes from `--file-only-from` on are
measured through files only (in memory they would need twice the model in this machine's memory, which the
smaller sizes already show). The machine may be shared: an in-memory run waits up to a minute for 3 models and
1 GiB to be available (MemAvailable), and is skipped, and said so, if they are not. Writes
results/site_exchange.{json,md,png}.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import xxhash
from flwr.app import ConfigRecord, Message, RecordDict
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from hydrafl.benchmarks._common import (
    benchmark_parser,
    progress_columns,
    save_against_model_size,
    verdict,
)
from hydrafl.benchmarks._large_site import initial_values, large_layout, row_blocks
from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.server.config import CoordinatorConfig
from hydrafl.server.coordinator import Coordinator
from hydrafl.server.transport.grid import CoordinatorGrid
from hydrafl.tensor_files import TensorFileWriter, as_record

GIB = 1 << 30
MB = 1e6
WIDTH = 4096
LAYER_BYTES = WIDTH * WIDTH * 4
GOAL_GROWTH_MB = 128
"""The file-backed exchange's growth must stay under this at every size (a window of chunks, not the model)."""
console = Console()


def measure(size_gib: float, mode: str, workdir: Path) -> dict[str, Any]:
    """One exchange of a model of `size_gib` with a fresh site process, in `mode`."""
    layers = max(1, round(size_gib * GIB / LAYER_BYTES))
    coordinator = Coordinator(
        CoordinatorConfig(
            listen="127.0.0.1:0",
            db_url=f"sqlite:///{workdir / 'c.db'}",
            blob_dir=workdir / "blobs",
            runs_dir=workdir / "runs",
            send_cache_mb=0,
        )
    )
    coordinator.start()
    site = None
    try:
        store = coordinator.store
        node, token = store.add_site("large")
        run = store.create_run({"rounds": 1})
        store.set_run_status(run.id, "running")
        grid = CoordinatorGrid(store, coordinator.blobs, coordinator.service, run.id)
        (workdir / "token").write_text(token)
        site = _start_site(coordinator.port, workdir, mode)
        _exchange(grid, node.node_id, _model_file(workdir / "warm.safetensors", 1, 8), 1)
        Path(f"/proc/{site.pid}/clear_refs").write_text(
            "5"
        )  # VmHWM := VmRSS: imports' peak forgotten
        before = _status(site.pid)
        sampler = _AnonPeak(site.pid)
        sampler.start()
        model = _model_file(workdir / "model.safetensors", layers, WIDTH)
        started = time.perf_counter()
        digests = _exchange(grid, node.node_id, model, 2)
        seconds = time.perf_counter() - started
        after = _status(site.pid)
        sampler.done.set()
        sampler.join()
    except BaseException:
        log = workdir / "site.log"
        console.print(log.read_text()[-3000:] if log.exists() else "(no site log)")
        raise
    finally:
        if site is not None:
            site.send_signal(signal.SIGINT)
            try:
                site.wait(timeout=60)
            except subprocess.TimeoutExpired:
                site.kill()
        coordinator.stop()
    model_bytes = layers * LAYER_BYTES
    hwm_growth = after["VmHWM"] - before["VmRSS"]
    anon_growth = sampler.peak - before["RssAnon"]
    growth = max(hwm_growth, anon_growth)
    return {
        "size_gib": model_bytes / GIB,
        "mode": mode,
        "layers": layers,
        "rss_before_mb": before["VmRSS"] / MB,
        "hwm_before_mb": before["VmHWM"] / MB,
        "hwm_after_mb": after["VmHWM"] / MB,
        "hwm_growth_mb": hwm_growth / MB,
        "anon_growth_mb": anon_growth / MB,
        "growth_mb": growth / MB,
        "growth_of_model": growth / model_bytes,
        "seconds": seconds,
        "reply_digest": digests,
    }


def _start_site(port: int, workdir: Path, mode: str) -> subprocess.Popen:
    exchange_mb = "0" if mode == "file" else "100000"
    node_config = "large-layers=1 large-width=8" + (
        " large-in-memory=true" if mode == "memory" else ""
    )
    return subprocess.Popen(
        [sys.executable, "-m", "hydrafl", "site", "--coordinator", f"127.0.0.1:{port}"]
        + ["--token-file", str(workdir / "token"), "--state-dir", str(workdir / "state")]
        + ["--app", "hydrafl.benchmarks._large_site:app", "--exchange-memory-mb", exchange_mb]
        + ["--max-download-mb", "100000", "--node-config", node_config],
        env={"TMPDIR": str(workdir), "PATH": "/usr/bin:/bin"},
        stdout=subprocess.DEVNULL,
        stderr=(workdir / "site.log").open("w"),
    )


def _model_file(path: Path, layers: int, width: int) -> dict[str, Any]:
    """The start model written a block of rows at a time and mapped: this process never holds it either."""
    writer = TensorFileWriter(path, large_layout(layers, width))
    for name in writer.layout:
        for rows in row_blocks(width, width * 4):
            writer.write_at(name, rows.start * width * 4, initial_values(name, rows, width))
    return writer.close(durable=False)


def _exchange(grid: CoordinatorGrid, node_id: int, model: dict[str, Any], server_round: int) -> str:
    """Send `model` in a train message and wait for the reply; the XXH3 of its chunks' names, in order."""
    request = Message(
        RecordDict(
            {"arrays": as_record(model), "config": ConfigRecord({"server-round": server_round})}
        ),
        dst_node_id=node_id,
        message_type="train",
    )
    request.metadata.group_id = str(server_round)
    [message_id] = grid.push_messages([request])
    deadline = time.monotonic() + 1800
    while not (replies := grid.store.replies_to([message_id])):
        if time.monotonic() > deadline:
            raise TimeoutError("the site did not reply in 30 minutes")
        time.sleep(0.05)
    envelope = pb.Envelope.FromString(replies[0].envelope)
    if envelope.error_reason:
        raise RuntimeError(f"the site replied with an error: {envelope.error_reason}")
    names = [d for record in envelope.arrays for t in record.tensors for d in t.chunk_digests]
    return xxhash.xxh3_128_hexdigest("".join(names).encode())


def _available_bytes(wait_for: float = 0, wait_s: float = 60) -> int:
    """The machine's MemAvailable; waits up to `wait_s` for `wait_for` bytes to be available (it is shared)."""
    deadline = time.monotonic() + wait_s
    while True:
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        available = next(
            int(line.split()[1]) << 10 for line in meminfo if line.startswith("MemAvailable:")
        )
        if available >= wait_for or time.monotonic() > deadline:
            return available
        time.sleep(5)


class _AnonPeak(threading.Thread):
    """The peak of a process's anonymous resident memory, sampled every 10 ms: VmHWM counts the file pages it
    maps too, which the kernel takes back when writing gigabytes fills the page cache, so its peak can hide a
    growth of anonymous memory."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.done = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.01):
            self.peak = max(self.peak, _status(self.pid)["RssAnon"])


def _status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM and RssAnon of process `pid`, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon"):
            fields[key] = int(value.split()[0]) << 10
    return fields


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    for mode, style in (("memory", "o-"), ("file", "s-")):
        points = sorted(
            (r["size_gib"], r["growth_mb"] * MB / GIB) for r in rows if r["mode"] == mode
        )
        if points:
            axis.plot(*zip(*points, strict=True), style, label=f"{mode}-backed exchange")
    save_against_model_size(
        figure,
        axis,
        sorted({r["size_gib"] for r in rows}),
        "site's peak memory growth (GiB)",
        "A site's memory for one exchange (download + upload)",
        path,
    )


def main() -> None:
    parser = benchmark_parser(__doc__, "0.0625 and 0.25 GiB")
    parser.add_argument("--sizes", default="0.25,1,2,4", help="model sizes in GiB, comma-separated")
    parser.add_argument(
        "--file-only-from", type=float, default=4.0, help="GiB from which only files are measured"
    )
    args = parser.parse_args()
    sizes = [0.0625, 0.25] if args.quick else [float(s) for s in args.sizes.split(",")]
    runs = [
        (size, mode)
        for size in sizes
        for mode in ("memory", "file")
        if mode == "file" or size < args.file_only_from
    ]
    rows = []
    skipped = []
    with Progress(*progress_columns(), console=console) as progress:
        task = progress.add_task("exchanges", total=len(runs))
        for size, mode in runs:
            progress.update(task, description=f"{size:g} GiB, {mode}")
            available = _available_bytes(wait_for=3 * size * GIB + GIB if mode == "memory" else 0)
            if mode == "memory" and available < 3 * size * GIB + GIB:
                skipped.append({"size_gib": size, "available_gib": available / GIB})
                progress.advance(task)
                continue
            workdir = Path(tempfile.mkdtemp(prefix="site-exchange-"))
            try:
                rows.append(measure(size, mode, workdir))
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
            progress.advance(task)
    by_size: dict[float, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_size.setdefault(row["size_gib"], {})[row["mode"]] = row
    identical = all(
        len({r["reply_digest"] for r in modes.values()}) == 1 for modes in by_size.values()
    )
    worst = max(r["growth_mb"] for r in rows if r["mode"] == "file")
    goal_met = worst < GOAL_GROWTH_MB and identical
    table = Table(title="Site exchange: the site's peak memory growth for one exchange")
    for column in (
        "model GiB",
        "mode",
        "RSS before MB",
        "VmHWM growth MB",
        "RssAnon growth MB",
        "growth / model",
        "s",
    ):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            f"{row['size_gib']:.3g}",
            row["mode"],
            f"{row['rss_before_mb']:.0f}",
            f"{row['hwm_growth_mb']:.0f}",
            f"{row['anon_growth_mb']:.0f}",
            f"{row['growth_of_model']:.3f}",
            f"{row['seconds']:.1f}",
        )
    console.print(table)
    for skip in skipped:
        console.print(
            f"in memory at {skip['size_gib']:g} GiB: skipped, {skip['available_gib']:.1f} GiB available"
        )
    console.print(
        f"file-backed growth at most {worst:.0f} MB (goal < {GOAL_GROWTH_MB} MB at every size), replies "
        f"bit-identical across modes: {identical}: {verdict(goal_met)}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    name = "site_exchange"
    result = {
        "quick": args.quick,
        "rows": rows,
        "goal_growth_mb": GOAL_GROWTH_MB,
        "worst_file_growth_mb": worst,
        "replies_identical": identical,
        "goal_met": goal_met,
        "memory_runs_skipped": skipped,
    }
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2))
    lines = [
        "| model GiB | mode | RSS before MB | VmHWM growth MB | RssAnon growth MB | growth / model | s |",
        "|---:|:--|---:|---:|---:|---:|---:|",
        *(
            f"| {r['size_gib']:.3g} | {r['mode']} | {r['rss_before_mb']:.0f} | {r['hwm_growth_mb']:.0f} | "
            f"{r['anon_growth_mb']:.0f} | "
            f"{r['growth_of_model']:.3f} | {r['seconds']:.1f} |"
            for r in rows
        ),
    ]
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    plot(rows, args.out / f"{name}.png")
    if not goal_met:
        sys.exit(1)


if __name__ == "__main__":
    main()
