"""A model larger than the coordinator's memory: one 3-site DiLoCo round of a stack of 4096-wide float32 linear
layers, run as README tells users with a small coordinator to (`hydrafl server --resident-model-mb 128
--send-cache-mb 128`, three `hydrafl site` processes), against the model's size.

    python -m hydrafl.benchmarks.large_model [--out DIR] [--quick] [--sizes 0.25,1,2,4] [--limit-mb 1536]
        [--sites-in-turn]

A round of S GiB holds about 9 S GiB on one disk at its peak when the sites share the coordinator's disk (their
three downloads and three replies beside the coordinator's model, sent chunks and first upload); with
`--sites-in-turn` (the sites write and send their replies one at a time: the aggregation is the same) about 8 S,
the coordinator's at aggregation: the three uploads, the old and new model, the momentum and the same two.

Per size, in a fresh folder: the coordinator process runs under a memory limit (a cgroup's memory.limit_in_bytes
of `--limit-mb`, when this machine lets the benchmark make one) and its peak resident memory (VmHWM) is read at
the end of the run; the sites run the large-model ClientApp (`benchmarks/_large_site.py`: the model generated
a block at a time, delta = 0.01 x start + seeded noise, never the whole model in memory) with their exchange
through files (`--exchange-memory-mb 64`). The run skips evaluation and the curvature probe
(`fraction-evaluate 0`, `outer-check false`), which would each send the model to every site once more.

Checked and measured:
- the aggregated model equals an in-memory aggregation of the same updates: each tensor of the round's
  checkpoint is compared bit for bit with DiLoCo's `aggregate_train` on that tensor's three updates, rebuilt here
  (every tensor up to 1 GiB, the first, middle and last above);
- the round's aggregation time (rounds.tsv `aggregation_s`) against the floor: reading the three updates and
  writing the new model once at the disk's speed, measured in the same run (O_DIRECT, 2 GiB each way); and
  against what DiLoCo's outer Nesterov step must move besides: the start model read and the momentum written
  (reads and writes share this disk's bandwidth: 2 GiB each way at once took as long as one after the other);
- the coordinator's and the sites' peak memory against the model size (plot).
Writes results/large_model.{json,md,png}.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.app.message.message import make_message
from flwr.common import Metadata
from rich.console import Console
from rich.table import Table
from rich.text import Text

from hydrafl import protocol
from hydrafl.benchmarks._common import benchmark_parser, save_against_model_size, verdict
from hydrafl.benchmarks._large_site import initial_values, pseudo_gradient, row_blocks
from hydrafl.config import RunConfig
from hydrafl.server.aggregation.checkpoint import load_checkpoint
from hydrafl.server.store import Store
from hydrafl.strategies import DiLoCo
from hydrafl.strategies.diloco import DiLoCoConfig

GIB = 1 << 30
MIB = 1 << 20
WIDTH = 4096
LAYER_BYTES = WIDTH * WIDTH * 4
SITES = 3
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
GOAL_MEMORY_MB = 1536
RESIDENT_MODEL_MB = 128
"""What README tells a coordinator with 1.5 GiB to keep in memory: an in-memory round holds about five models."""
GOAL_FLOOR_RATIO = 1.5
console = Console()


def disk_speeds(folder: Path, nbytes: int = 2 * GIB) -> tuple[float, float]:
    """(write, read) bytes per second of `folder`'s disk, past the page cache (O_DIRECT, 8 MiB requests; a
    filesystem without O_DIRECT, such as tmpfs, is measured through its cache: memory is its disk)."""
    path = folder / "disk-speed.bin"
    block = mmap.mmap(-1, 8 * MIB)
    block.write(os.urandom(8 * MIB))
    direct = _direct_io(folder)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o644)
    started = time.perf_counter()
    for _ in range(nbytes // (8 * MIB)):
        os.write(descriptor, block)
    os.fsync(descriptor)
    os.close(descriptor)
    write = nbytes / (time.perf_counter() - started)
    descriptor = os.open(path, os.O_RDONLY | direct)
    started = time.perf_counter()
    while os.readv(descriptor, [block]) > 0:
        pass
    read = nbytes / (time.perf_counter() - started)
    os.close(descriptor)
    path.unlink()
    return write, read


def _direct_io(folder: Path) -> int:
    """O_DIRECT where `folder`'s filesystem takes it, else 0."""
    probe = folder / "direct-probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
        return os.O_DIRECT
    except OSError:
        return 0
    finally:
        probe.unlink(missing_ok=True)


class MemoryLimit:
    """A cgroup (v1 memory controller) limiting the processes put in it to `limit` bytes; None where this
    machine does not let the benchmark make one (the limit is then only measured, not enforced)."""

    def __init__(self, limit: int) -> None:
        self.folder: Path | None = Path(f"/sys/fs/cgroup/memory/hydrafl-large-{os.getpid()}")
        try:
            self.folder.mkdir()
            (self.folder / "memory.limit_in_bytes").write_text(str(limit))
        except OSError:
            self.folder = None

    def add(self, pid: int) -> None:
        if self.folder is not None:
            (self.folder / "cgroup.procs").write_text(str(pid))

    def failures(self) -> int:
        """How often the group hit its limit (memory.failcnt)."""
        return int((self.folder / "memory.failcnt").read_text()) if self.folder else 0

    def close(self) -> None:
        """Remove the group once the kernel has moved its last process out (a killed one takes a moment)."""
        for _ in range(50):
            if self.folder is None or not (self.folder / "cgroup.procs").read_text().strip():
                break
            time.sleep(0.1)
        if self.folder is not None:
            self.folder.rmdir()


def run_size(
    size_gib: float, workdir: Path, limit_mb: int, in_turn: bool = False
) -> dict[str, Any]:
    """One round of a model of about `size_gib`, in a fresh coordinator and three fresh sites (`in_turn`: the
    sites write and send their replies one after another)."""
    layers = max(1, round(size_gib * GIB / LAYER_BYTES))
    home = workdir / "home"
    home.mkdir(parents=True)
    db = f"sqlite:///{home / 'coordinator.db'}"
    store = Store(db)
    tokens = []
    for index in range(SITES):
        _, token = store.add_site(f"site-{index}")
        (workdir / f"site-{index}.token").write_text(token)
        tokens.append(workdir / f"site-{index}.token")
    cfg = RunConfig().replace(
        strategy="diloco",
        sites=SITES,
        rounds=1,
        fraction_evaluate=0.0,
        outer_check=False,
        outer_lr=OUTER_LR,
        outer_momentum=OUTER_MOMENTUM,
    )
    run_id = store.create_run(cfg.to_flower()).id
    env = {**os.environ, "HYDRAFL_HOME": str(home), "TMPDIR": str(workdir)}
    port = _free_port()
    limit = MemoryLimit(limit_mb * MIB)
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "hydrafl", "server", "--listen", f"127.0.0.1:{port}"]
        + ["--db", db, "--blobs", str(home / "blobs")]
        + ["--resident-model-mb", str(RESIDENT_MODEL_MB), "--send-cache-mb", "128"],
        env=env,
        stdout=(workdir / "coordinator.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    limit.add(coordinator.pid)
    turns = f' large-turns="{workdir / "turns.lock"}"' if in_turn else ""
    sites = [
        subprocess.Popen(
            [sys.executable, "-m", "hydrafl", "site", "--coordinator", f"127.0.0.1:{port}"]
            + ["--token-file", str(token), "--state-dir", str(workdir / f"state-{index}")]
            + ["--app", "hydrafl.benchmarks._large_site:app", "--exchange-memory-mb", "64"]
            + ["--max-download-mb", str(100 * 1024)]
            + ["--node-config", f"large-layers={layers} large-width={WIDTH}{turns}"],
            env=env,
            stdout=(workdir / f"site-{index}.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        for index, token in enumerate(tokens)
    ]
    started = time.perf_counter()
    try:
        status = _wait(store, run_id, coordinator)
        alive = status == "finished"
        coordinator_hwm = _hwm(coordinator.pid) if alive else 0
        sites_hwm = [_hwm(site.pid) for site in sites] if alive else [0]
    finally:
        for process in (*sites, coordinator):
            process.send_signal(signal.SIGINT)
        for process in (*sites, coordinator):
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        failures = limit.failures()
        limit.close()
    seconds = time.perf_counter() - started
    run = store.run(run_id)
    if status != "finished":
        raise RuntimeError(
            f"{size_gib} GiB: the run ended {status}: {run.detail} (see {workdir}/coordinator.log)"
        )
    round_one = run.history[-1]
    nodes = {site.name: site.node_id for site in store.sites()}
    equal, compared = _compare(home / "runs" / str(run_id), layers, sorted(nodes.values()))
    return {
        "size_gib": layers * LAYER_BYTES / GIB,
        "layers": layers,
        "coordinator_hwm_mb": coordinator_hwm / MIB,
        "site_hwm_mb": max(sites_hwm) / MIB,
        "limit_mb": limit_mb if limit.folder is not None else None,
        "limit_hits": failures,
        "aggregation_s": round_one["aggregation_s"],
        "round_s": round_one["seconds"],
        "run_s": seconds,
        "equal_to_in_memory": equal,
        "tensors_compared": compared,
    }


def _compare(run_dir: Path, layers: int, nodes: list[int]) -> tuple[bool, int]:
    """Whether the checkpoint's tensors equal DiLoCo's in-memory aggregation of the same three updates."""
    checkpoint = load_checkpoint(run_dir)
    assert checkpoint is not None and checkpoint.server_round == 1
    indices = range(layers) if layers * LAYER_BYTES <= GIB else sorted({0, layers // 2, layers - 1})
    for index in indices:
        name = f"layer{index}.weight"
        start = np.concatenate([initial_values(name, rows, WIDTH) for rows in _blocks()])
        strategy = DiLoCo(DiLoCoConfig(outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM))
        strategy.current_arrays = ArrayRecord({name: Array(start)})
        replies = [_reply(name, _delta(start, index, node), node) for node in nodes]
        arrays, _ = strategy.aggregate_train(1, replies)
        assert arrays is not None
        if not np.array_equal(arrays[name].numpy(), checkpoint.arrays[name].numpy()):
            return False, len(indices)
    return True, len(indices)


def _blocks() -> list[slice]:
    return list(row_blocks(WIDTH, WIDTH * 4))


def _delta(start: np.ndarray, index: int, node: int) -> np.ndarray:
    """The site's update of one tensor, as `_large_site.train` computes it block by block."""
    return np.concatenate(
        [pseudo_gradient(start[rows], (1, node, index, rows.start)) for rows in _blocks()]
    )


def _reply(name: str, delta: np.ndarray, node: int) -> Message:
    content = RecordDict(
        {
            "arrays": ArrayRecord({name: Array(delta)}),
            "metrics": MetricRecord({protocol.WEIGHT: 1}),
        }
    )
    metadata = Metadata(
        run_id=1,
        message_id=f"reply-{node}",
        src_node_id=node,
        dst_node_id=0,
        reply_to_message_id=f"train-{node}",
        group_id="1",
        created_at=time.time(),
        ttl=0.0,
        message_type="train",
    )
    return make_message(metadata=metadata, content=content)


def _wait(store: Store, run_id: int, coordinator: subprocess.Popen) -> str:
    while (status := store.run_status(run_id)) not in ("finished", "failed"):
        if coordinator.poll() is not None:
            return f"with the coordinator gone (exit {coordinator.returncode}: the memory limit?)"
        time.sleep(0.5)
    return str(status)


def _hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise RuntimeError(f"no VmHWM for process {pid}")


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    sizes = [row["size_gib"] for row in rows]
    axis.plot(sizes, [r["coordinator_hwm_mb"] / 1024 for r in rows], "o-", label="coordinator")
    axis.plot(sizes, [r["site_hwm_mb"] / 1024 for r in rows], "s-", label="site (largest)")
    axis.axhline(GOAL_MEMORY_MB / 1024, color="red", lw=0.8, ls="--", label="coordinator goal")
    save_against_model_size(
        figure,
        axis,
        sizes,
        "peak resident memory (GiB, VmHWM)",
        "One 3-site DiLoCo round of a model larger than memory",
        path,
    )


def main() -> None:
    parser = benchmark_parser(__doc__, "0.1875 and 0.25 GiB")
    parser.add_argument("--sizes", default="0.25,1,2,4", help="model sizes in GiB, comma-separated")
    parser.add_argument("--limit-mb", type=int, default=GOAL_MEMORY_MB)
    parser.add_argument(
        "--sites-in-turn",
        action="store_true",
        help="the sites write and send their replies one at a time (a disk too small for three at once)",
    )
    parser.add_argument(
        "--merge",
        type=Path,
        help="an earlier run's large_model.json: its other sizes are reported beside these",
    )
    args = parser.parse_args()
    sizes = [0.1875, 0.25] if args.quick else [float(s) for s in args.sizes.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    probe = GIB // 4 if args.quick else 2 * GIB
    with tempfile.TemporaryDirectory(dir=os.environ.get("HYDRAFL_BENCH_DIR")) as tmp:
        write, read = disk_speeds(Path(tmp), probe)
        for index, size in enumerate(sizes):
            console.print(f"[bold]{size} GiB[/bold]: coordinator, three sites, one DiLoCo round")
            workdir = Path(tmp) / f"size-{size}"
            in_turn = args.sites_in_turn or (args.quick and index == 1)  # quick: both ways
            row = run_size(size, workdir, args.limit_mb, in_turn)
            row["sites_in_turn"] = in_turn
            model = row["size_gib"] * GIB
            row["floor_s"] = SITES * model / read + model / write
            row["floor_ratio"] = row["aggregation_s"] / row["floor_s"]
            row["rule_floor_s"] = (SITES + 1) * model / read + 2 * model / write
            row["rule_floor_ratio"] = row["aggregation_s"] / row["rule_floor_s"]
            rows.append(row)
            shutil.rmtree(workdir, ignore_errors=True)
            console.print(row)
        again_write, again_read = disk_speeds(Path(tmp), probe)
    disks = [
        {
            "sizes_gib": [row["size_gib"] for row in rows],
            "write_gib_s": [write / GIB, again_write / GIB],
            "read_gib_s": [read / GIB, again_read / GIB],
        }
    ]
    if args.merge:  # each row's floors are of its own run's disk speeds
        earlier = json.loads(args.merge.read_text())
        measured = {round(row["size_gib"], 4) for row in rows}
        kept = [row for row in earlier["rows"] if round(row["size_gib"], 4) not in measured]
        rows = sorted(kept + rows, key=lambda row: row["size_gib"])
        disks = earlier["disks"] + disks
    report(rows, disks, out)


def report(rows: list[dict[str, Any]], disks: list[dict[str, Any]], out: Path) -> None:
    table = Table(title="A 3-site DiLoCo round against model size")
    columns = [
        "GiB",
        "coordinator MB",
        "site MB",
        "aggregation s",
        "floor s",
        "ratio",
        "rule's floor s",
        "ratio",
        "equal",
    ]
    for column in columns:
        table.add_column(column, justify="right")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [
            f"{row['size_gib']:.2f}",
            f"{row['coordinator_hwm_mb']:.0f}",
            f"{row['site_hwm_mb']:.0f}",
            f"{row['aggregation_s']:.1f}",
            f"{row['floor_s']:.1f}",
            f"{row['floor_ratio']:.2f}",
            f"{row['rule_floor_s']:.1f}",
            f"{row['rule_floor_ratio']:.2f}",
            f"{row['equal_to_in_memory']} ({row['tensors_compared']})",
        ]
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    console.print(table)
    memory_ok = all(r["coordinator_hwm_mb"] < GOAL_MEMORY_MB for r in rows)
    largest = max(rows, key=lambda row: row["size_gib"])  # the goal's run: the largest model
    floor_ok = largest["floor_ratio"] <= GOAL_FLOOR_RATIO
    equal = all(r["equal_to_in_memory"] for r in rows)
    goals = [
        f"Coordinator peak memory under {GOAL_MEMORY_MB} MB at every size: {verdict(memory_ok)}",
        f"Aggregation within {GOAL_FLOOR_RATIO}x the disk floor at the largest size "
        f"({largest['size_gib']:g} GiB: {largest['floor_ratio']:.2f}x; smaller models pay fixed costs "
        f"over less data): {verdict(floor_ok)}",
        "Aggregation against the floor of what DiLoCo's step moves (the start model read, the momentum "
        f"written): {max(r['rule_floor_ratio'] for r in rows):.2f}x at most",
        f"The aggregated model equals the in-memory aggregation: {verdict(equal, 'yes', 'NO')}",
    ]
    for goal in goals:
        console.print(goal)
    disk_lines = [
        f"Disk at {', '.join(f'{size:g}' for size in disk['sizes_gib'])} GiB (O_DIRECT, before and after): "
        f"write {disk['write_gib_s'][0]:.2f} / {disk['write_gib_s'][1]:.2f} GiB/s, "
        f"read {disk['read_gib_s'][0]:.2f} / {disk['read_gib_s'][1]:.2f} GiB/s."
        for disk in disks
    ]
    plain = [Text.from_markup(goal).plain for goal in goals]
    (out / "large_model.md").write_text("\n".join([*lines, "", *disk_lines, "", *plain]) + "\n")
    (out / "large_model.json").write_text(json.dumps({"rows": rows, "disks": disks}, indent=1))
    plot(rows, out / "large_model.png")


if __name__ == "__main__":
    main()
