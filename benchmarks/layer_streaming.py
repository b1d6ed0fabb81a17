"""Layer streaming against in-memory training: step time and peak memory for windows of 1, 2 and 4 blocks.

    python -m hydrafl.benchmarks.layer_streaming [--out DIR] [--quick] [--device cpu|cuda]

One site trains a BERT classifier (clinical-text, AdamW) for a few steps, in memory and with `--stream-layers`
at each window, every configuration in a fresh process so that one's memory never shows in another's. Measured
from the second step on (the first allocates the in-memory optimizer state and offloads the streamed blocks):

- step time: median wall time from one step's loss to the next;
- peak memory: on CPU the process's peak resident anonymous memory (RssAnon, sampled every 2 ms; the blocks
  stream from safetensors files, so only the window is materialised); on CUDA the device's peak allocation
  (the blocks stream from pinned host memory on a copy stream);
- the window's peak (bytes of block tensors materialised at once, `LayerStream.peak_resident_bytes`) and the
  parameter-memory footprint each configuration needs (`layer_store.parameter_footprint`).

Streaming recomputes each block's forward in the backward pass and moves every block in and out three times a
step (forward, backward, update), so it is slower; the read-ahead hides the reads where compute is longer than
a block's transfer. A last row streams window 2 from host memory instead of disk, which separates the cost of
the files from that of the recomputation. Each configuration runs `--repeats` times, interleaved, and the
fastest run is reported (the machine may be shared). Writes results/layer_streaming.{json,md,png}.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from torch import nn

from hydrafl.benchmarks._common import benchmark_parser
from hydrafl.data import load_cohort
from hydrafl.kernels.distributed import train_distributed
from hydrafl.kernels.layer_store import parameter_footprint
from hydrafl.kernels.local_training import LocalTraining
from hydrafl.losses import classification_loss
from hydrafl.models import TinyShape, build_model, federated_state

NAME = "layer_streaming"
WINDOWS = (1, 2, 4)


@dataclass(frozen=True, kw_only=True, slots=True)
class Scale:
    shape: TinyShape
    steps: int
    batch_size: int


FULL = Scale(
    shape=TinyShape(hidden=512, layers=8, heads=8, intermediate=2048), steps=5, batch_size=8
)
QUICK = Scale(
    shape=TinyShape(hidden=64, layers=4, heads=4, intermediate=128), steps=3, batch_size=8
)


@dataclass
class _Clocked:
    """The task loss, timing each step and switching the memory sampler on from the second step."""

    device: str
    calls: list[float] = field(default_factory=list)
    steady: threading.Event = field(default_factory=threading.Event)

    def __call__(self, model: nn.Module, x: Any, y: torch.Tensor) -> torch.Tensor:
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.calls.append(time.perf_counter())
        if len(self.calls) == 2:
            if self.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            self.steady.set()
        return classification_loss(model, x, y)


def _rss_anon() -> int:
    """This process's resident anonymous memory in bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def measure(scale: Scale, window: int, offload: str, device: str) -> dict[str, Any]:
    """One configuration in this (fresh) process; window 0 trains in memory."""
    cohort = load_cohort("clinical-text", num_sites=1, samples_per_site=64)
    split = cohort.sites[0]
    model = build_model(cohort.task, shape=scale.shape)
    footprint = parameter_footprint(model, "adamw")
    state = {name: p.detach().clone() for name, p in federated_state(model).items()}
    clock = _Clocked(device)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            if clock.steady.is_set():
                peak[0] = max(peak[0], _rss_anon())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    config = LocalTraining(
        steps=scale.steps,
        batch_size=scale.batch_size,
        lr=1e-3,
        optimizer="adamw",
        stream_layers=window > 0,
        window=max(window, 1),
        stream_offload=offload,
    )
    result = train_distributed(
        lambda: model,
        state,
        split.train_x,
        split.train_y,
        config,
        device=device,
        loss_fn=clock,
    )
    done.set()
    sampler.join()
    steps = [b - a for a, b in zip(clock.calls[1:], clock.calls[2:], strict=False)]
    peak_bytes = torch.cuda.max_memory_allocated() if device == "cuda" else peak[0]
    return {
        "window": window,
        "offload": offload,
        "step_s": statistics.median(steps),
        "peak_memory_bytes": peak_bytes,
        "window_peak_bytes": result.peak_stream_bytes,
        "footprint_bytes": (
            footprint.streamed_bytes(window) if window else footprint.in_memory_bytes
        ),
        "loss": result.loss,
    }


def _label(window: int, offload: str = "auto") -> str:
    if not window:
        return "in memory"
    return f"streamed, window {window}" + (f", {offload} store" if offload != "auto" else "")


def markdown(summary: dict[str, Any]) -> str:
    scale, base = summary["scale"], summary["runs"][0]
    lines = [
        f"# Layer streaming against in-memory training ({summary['device']})",
        "",
        f"BERT classifier, hidden {scale['hidden']}, {scale['layers']} blocks, AdamW, batch "
        f"{scale['batch_size']} x {scale['seq_len']} tokens, {scale['parameters'] / 1e6:.1f}M parameters; "
        f"median of steps 2..{scale['steps']}, fastest of {summary['repeats']} interleaved runs. Peak memory: "
        f"{summary['memory']}. The streamed blocks live on {summary['store']} unless the row names the store.",
        "",
        "| training | step (s) | every run's step (s) | step vs in memory | peak memory (MB) | memory vs in "
        "memory | window peak (MB) | parameter footprint (MB) | loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in summary["runs"]:
        lines.append(
            f"| {_label(run['window'], run['offload'])} | {run['step_s']:.3f} | "
            f"{', '.join(f'{step:.2f}' for step in run['step_s_runs'])} | "
            f"{run['step_s'] / base['step_s']:.2f}x | "
            f"{run['peak_memory_bytes'] / 1e6:.0f} | "
            f"{run['peak_memory_bytes'] / base['peak_memory_bytes']:.2f}x | "
            f"{run['window_peak_bytes'] / 1e6:.1f} | {run['footprint_bytes'] / 1e6:.1f} | "
            f"{run['loss']:.6f} |"
        )
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], path: Path) -> None:
    runs = summary["runs"]
    labels = [
        _label(run["window"], run["offload"]).replace("streamed, ", "").replace(", ", "\n")
        for run in runs
    ]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    left.bar(labels, [run["step_s"] for run in runs], color="tab:blue", label="fastest run")
    for label, run in zip(labels, runs, strict=True):
        left.scatter([label] * len(run["step_s_runs"]), run["step_s_runs"], color="black", s=12)
    left.scatter([], [], color="black", s=12, label="every run")
    left.legend()
    left.set_ylabel("seconds per step")
    left.set_title("step time")
    right.bar(labels, [run["peak_memory_bytes"] / 1e6 for run in runs], color="tab:orange")
    right.set_ylabel("MB")
    right.set_title(f"peak memory ({summary['memory']})")
    fig.suptitle(f"Layer streaming vs in-memory training ({summary['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = benchmark_parser(__doc__, "a 64-wide, 4-block model, 3 steps")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs of each configuration; the fastest is reported"
    )
    args = parser.parse_args()
    scale = QUICK if args.quick else FULL
    args.repeats = 1 if args.quick else args.repeats
    console = Console()
    cohort = load_cohort("clinical-text", num_sites=1, samples_per_site=64)
    parameters = sum(p.numel() for p in build_model(cohort.task, shape=scale.shape).parameters())
    configurations = [(0, "auto"), *((window, "auto") for window in WINDOWS), (2, "host")]
    repeats: dict[tuple[int, str], list[dict[str, Any]]] = {c: [] for c in configurations}
    spawn = get_context("spawn")
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("configurations", total=args.repeats * len(configurations))
        # interleaved, so that a busy spell of the machine hits every configuration; a fresh process for each
        # run, so that none sees another's memory (quick mode: one process for all, a smoke test)
        shared = ProcessPoolExecutor(max_workers=1, mp_context=spawn) if args.quick else None
        for _ in range(args.repeats):
            for window, offload in configurations:
                progress.update(task, description=_label(window, offload))
                pool = shared or ProcessPoolExecutor(max_workers=1, mp_context=spawn)
                run = pool.submit(measure, scale, window, offload, args.device).result()
                if pool is not shared:
                    pool.shutdown()
                repeats[(window, offload)].append(run)
                progress.advance(task)
        if shared is not None:
            shared.shutdown()
    runs = [
        {
            **min(repeats[c], key=lambda run: run["step_s"]),
            "step_s_runs": [run["step_s"] for run in repeats[c]],
        }
        for c in configurations
    ]
    summary = {
        "quick": args.quick,
        "repeats": args.repeats,
        "store": "disk (safetensors)" if args.device == "cpu" else "pinned host memory",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "memory": "device peak allocation" if args.device == "cuda" else "process peak RssAnon",
        "scale": {
            "hidden": scale.shape.hidden,
            "layers": scale.shape.layers,
            "batch_size": scale.batch_size,
            "seq_len": cohort.task.seq_len,
            "steps": scale.steps,
            "parameters": parameters,
        },
        "runs": runs,
    }
    table = Table(title=f"layer streaming ({summary['device']})")
    for column in ("training", "step (s)", "peak memory (MB)", "window peak (MB)", "loss"):
        table.add_column(column)
    for run in runs:
        table.add_row(
            _label(run["window"], run["offload"]),
            f"{run['step_s']:.3f}",
            f"{run['peak_memory_bytes'] / 1e6:.0f}",
            f"{run['window_peak_bytes'] / 1e6:.1f}",
            f"{run['loss']:.6f}",
        )
    console.print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.device == "cpu" else f"-{args.device}"
    (args.out / f"{NAME}{suffix}.json").write_text(json.dumps(summary, indent=1))
    (args.out / f"{NAME}{suffix}.md").write_text(markdown(summary))
    plot(summary, args.out / f"{NAME}{suffix}.png")


if __name__ == "__main__":
    main()
