"""FedBuff's buffer with the model kept on disk: the coordinator's peak resident memory against the model's size
and K, and the same model as the in-memory buffer's.

    python -m hydrafl.benchmarks.fedbuff_on_disk [--out DIR] [--quick] [--sizes-mib 256,512,1024,2048]

A model of float32 tensors of `TENSOR_MIB` (--quick: 4 MiB) and K updates in safetensors files, read when they
are folded as the coordinator's blob store leaves them. In a fresh process per case, FedBuff (lr 0.7, momentum
0.9, staleness 0, 1, 2, ...) folds the K updates as they arrive and steps once, the model on disk (`add_on_disk`,
`step_on_disk`) or in memory (`add`, `step`; only the sizes up to `MEMORY_MIB`). The peak is VmHWM after
/proc/self/clear_refs resets it, once the process has opened its files: the growth a buffer and its step cost.
Goals: on disk, every case's growth within 1.25x of the smallest, whatever the model's size and K; and the
stepped model equal, byte for byte, to the in-memory buffer's wherever both ran.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from hydrafl.benchmarks._common import (
    benchmark_parser,
    progress_columns,
    save_against_model_size,
    verdict,
)

NAME = "fedbuff_on_disk"
TENSOR_MIB = 16
MEMORY_MIB = 512
"""The largest model also stepped in memory (about five times its size resident)."""
KS = (2, 8)
GOAL_FLAT = 1.25
MIB = 1 << 20
console = Console()


def write_updates(folder: Path, size_mib: int, tensor_mib: int, updates: int) -> None:
    """The start model and `updates` updates, one tensor in memory at a time."""
    from hydrafl.tensor_files import TensorFileWriter

    count, elements = size_mib // tensor_mib, tensor_mib * MIB // 4
    layout = {f"layer{i}": ("float32", (elements,)) for i in range(count)}
    rng = np.random.default_rng(0)
    for name in ["start", *(f"update{k}" for k in range(updates))]:
        writer = TensorFileWriter(folder / f"{name}.safetensors", layout)
        for tensor in layout:
            writer.write(tensor, rng.standard_normal(elements, dtype=np.float32))
        writer.close(durable=False)


def child(mode: str, folder: Path, updates: int) -> dict[str, Any]:
    """One buffer of `updates` and its step (`mode`: disk or memory), run in this process; its growth in MB."""
    from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
    from flwr.app.message.message import make_message
    from flwr.app.metadata import Metadata

    from hydrafl.strategies.by_tensor import RoundFiles
    from hydrafl.strategies.fedbuff import FedBuff, FedBuffConfig
    from hydrafl.tensor_files import as_record, open_tensors

    start = as_record(open_tensors(folder / "start.safetensors"))
    if mode == "memory":
        start = ArrayRecord({name: Array(array.numpy()) for name, array in start.items()})
    replies = []
    for k in range(updates):
        content = RecordDict(
            {
                "arrays": as_record(open_tensors(folder / f"update{k}.safetensors")),
                "metrics": MetricRecord({"num-examples": 10.0 + k}),
            }
        )
        metadata = Metadata(
            run_id=1,
            message_id=f"reply-{k}",
            src_node_id=k + 1,
            dst_node_id=0,
            reply_to_message_id=f"train-{k}",
            group_id="1",
            created_at=0.0,
            ttl=0.0,
            message_type="train",
        )
        replies.append(make_message(metadata=metadata, content=content))
    strategy = FedBuff(FedBuffConfig(buffer_size=updates, outer_lr=0.7, outer_momentum=0.9))
    files = RoundFiles(folder / f"run-{mode}-{updates}", 1)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
    before = _hwm_mb()
    for staleness, reply in enumerate(replies):
        if mode == "disk":
            strategy.add_on_disk(reply, staleness, start, files)
        else:
            strategy.add(reply, staleness)
        del reply
    del replies
    new = strategy.step_on_disk(start, files)[0] if mode == "disk" else strategy.step(start)[0]
    growth = _hwm_mb() - before
    digest = hashlib.sha256()
    for array in new.values():
        digest.update(array.numpy().tobytes())
    return {"growth_mb": growth, "sha256": digest.hexdigest()}


def _hwm_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]


def run_case(mode: str, folder: Path, updates: int) -> dict[str, Any]:
    command = [sys.executable, "-m", f"hydrafl.benchmarks.{NAME}", "--child", mode, str(folder)]
    done = subprocess.run(
        [*command, str(updates)], capture_output=True, text=True, check=True, timeout=3600
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = benchmark_parser(__doc__, "32 and 128 MiB models of 4 MiB tensors")
    parser.add_argument("--sizes-mib", default="256,512,1024,2048", help="model sizes, MiB")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # MODE FOLDER K: one case
    args = parser.parse_args()
    if args.child:
        mode, folder, updates = args.child
        print(json.dumps(child(mode, Path(folder), int(updates))))
        return
    tensor_mib = 4 if args.quick else TENSOR_MIB
    sizes = [32, 128] if args.quick else [int(s) for s in args.sizes_mib.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, Progress(*progress_columns()) as progress:
        cases = [(size, k) for size in sizes for k in KS]
        task = progress.add_task("buffers", total=len(cases))
        for size in sizes:
            folder = Path(tmp) / f"size-{size}"
            folder.mkdir()
            write_updates(folder, size, tensor_mib, max(KS))
            for k in KS:
                progress.update(task, description=f"{size} MiB, K={k}")
                disk = run_case("disk", folder, k)
                memory = run_case("memory", folder, k) if size <= MEMORY_MIB else None
                rows.append(
                    {
                        "size_mib": size,
                        "tensor_mib": tensor_mib,
                        "k": k,
                        "disk_growth_mb": disk["growth_mb"],
                        "memory_growth_mb": None if memory is None else memory["growth_mb"],
                        "equal": None if memory is None else memory["sha256"] == disk["sha256"],
                    }
                )
                progress.advance(task)
    report(rows, Path(args.out), args.quick)


def report(rows: list[dict[str, Any]], out: Path, quick: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    growth = [row["disk_growth_mb"] for row in rows]
    flat = max(growth) / max(min(growth), 1e-9)
    equal = [row["equal"] for row in rows if row["equal"] is not None]
    met = flat <= GOAL_FLAT and bool(equal) and all(equal)
    result = {
        "quick": quick,
        "rows": rows,
        "goal": {"flat_ratio": flat, "flat_goal": GOAL_FLAT, "all_equal": all(equal), "met": met},
    }
    (out / f"{NAME}.json").write_text(json.dumps(result, indent=1))
    table = Table(title="FedBuff's buffer and step: peak resident growth (VmHWM, MB)")
    for column in ("model MiB", "tensor MiB", "K", "on disk", "in memory", "same model"):
        table.add_column(column, justify="right")
    for row in rows:
        memory, same = row["memory_growth_mb"], row["equal"]
        table.add_row(
            str(row["size_mib"]),
            str(row["tensor_mib"]),
            str(row["k"]),
            f"{row['disk_growth_mb']:.0f}",
            "-" if memory is None else f"{memory:.0f}",
            "-" if same is None else str(same),
        )
    console.print(table)
    console.print(
        f"on disk, largest growth / smallest: {flat:.2f} (goal <= {GOAL_FLAT}); the same model as in "
        f"memory: {all(equal)}: {verdict(met)}"
    )
    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    for k in KS:
        mine = [row for row in rows if row["k"] == k]
        sizes = [row["size_mib"] / 1024 for row in mine]
        axis.plot(sizes, [r["disk_growth_mb"] / 1024 for r in mine], "o-", label=f"on disk, K={k}")
        kept = [r for r in mine if r["memory_growth_mb"] is not None]
        axis.plot(
            [r["size_mib"] / 1024 for r in kept],
            [r["memory_growth_mb"] / 1024 for r in kept],
            "s--",
            label=f"in memory, K={k}",
        )
    save_against_model_size(
        figure,
        axis,
        sorted({row["size_mib"] / 1024 for row in rows}),
        "peak resident growth (GiB, VmHWM)",
        "FedBuff: one buffer and its step",
        out / f"{NAME}.png",
    )


if __name__ == "__main__":
    main()
