"""Chunked cross-entropy (hydrafl.kernels.chunked_loss) vs full-logits cross-entropy: peak memory and time.

    python -m hydrafl.benchmarks.loss_kernel [--out DIR] [--quick]

Both variants run forward + backward of the mean cross-entropy of N hidden rows [N, D] against an LM head
[V, D]: "full" is `F.cross_entropy(h @ W.T, y)`, which builds the [N, V] logits (and their log-softmax and
gradient), "chunked" is `chunked_cross_entropy(h, W, y)` with its default blocks (1024 rows x 8192 vocab).

Memory: torch's CPU allocations are invisible to tracemalloc, so each (variant, V) runs alone in a fresh
process (this module with --probe) that reports its own peak RSS (VmHWM) and its times; a baseline process
that only builds the inputs is subtracted, so "extra" is what the loss costs. Both variants must also produce
the head's gradient [V, D]: that floor is shown. Torch runs one thread (a shared machine); times are the median
of --reps runs after one warm-up. The two losses and head gradients are compared, so a fast wrong kernel shows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from hydrafl.kernels.chunked_loss import chunked_cross_entropy

NAME = "loss_kernel"
MB = 1024**2
VARIANTS = ("full", "chunked")
FULL_SIZES = {"rows": 2048, "dim": 256, "vocabs": (32_768, 131_072), "reps": 3}
QUICK_SIZES = {"rows": 512, "dim": 64, "vocabs": (8192, 32_768), "reps": 1}


def peak_rss_bytes() -> int:
    """This process's own peak RSS (VmHWM; ru_maxrss would carry the parent's size into a forked child)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (the memory probe needs Linux)")


def inputs(rows: int, dim: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same hidden [N, D], head [V, D] and targets [N] in every process."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, dim, generator=gen).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=gen) / dim**0.5).requires_grad_()
    return hidden, weight, torch.randint(0, vocab, (rows,), generator=gen)


def loss(
    variant: str, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    if variant == "full":
        return F.cross_entropy(hidden @ weight.T, target)
    return chunked_cross_entropy(hidden, weight, target)


def probe(variant: str, rows: int, dim: int, vocab: int, reps: int) -> dict[str, Any]:
    """Run in a fresh process: forward + backward `reps` + 1 times; peak RSS, times, loss, head gradient norm."""
    torch.set_num_threads(1)
    hidden, weight, target = inputs(rows, dim, vocab)
    if variant == "baseline":
        return {"peak_bytes": peak_rss_bytes()}
    seconds = []
    for _ in range(reps + 1):
        hidden.grad = weight.grad = None
        started = time.perf_counter()
        value = loss(variant, hidden, weight, target)
        value.backward()
        seconds.append(time.perf_counter() - started)
    assert weight.grad is not None
    return {
        "peak_bytes": peak_rss_bytes(),
        "seconds": seconds[1:],
        "loss": value.item(),
        "head_grad": weight.grad.flatten()[:: max(1, weight.grad.numel() // 4096)].tolist(),
    }


def run_probe(variant: str, rows: int, dim: int, vocab: int, reps: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "hydrafl.benchmarks.loss_kernel", "--probe", variant]
    sizes = ["--rows", str(rows), "--dim", str(dim), "--vocab", str(vocab), "--reps", str(reps)]
    done = subprocess.run([*command, *sizes], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"probe {variant} at V={vocab} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(rows: int, dim: int, vocab: int, reps: int) -> dict[str, Any]:
    """Both variants at one vocabulary size, each in its own process, against one baseline process."""
    baseline = run_probe("baseline", rows, dim, vocab, reps)["peak_bytes"]
    results = {variant: run_probe(variant, rows, dim, vocab, reps) for variant in VARIANTS}
    extra = {variant: (results[variant]["peak_bytes"] - baseline) / MB for variant in VARIANTS}
    median = {variant: statistics.median(results[variant]["seconds"]) for variant in VARIANTS}
    grads = [torch.tensor(results[variant]["head_grad"]) for variant in VARIANTS]
    return {
        "vocab": vocab,
        "logits_mb": rows * vocab * 4 / MB,
        "head_grad_mb": vocab * dim * 4 / MB,
        "baseline_mb": baseline / MB,
        "extra_mb": extra,
        "memory_ratio_full_over_chunked": extra["full"] / extra["chunked"],
        "seconds": {variant: results[variant]["seconds"] for variant in VARIANTS},
        "median_s": median,
        "time_ratio_chunked_over_full": median["chunked"] / median["full"],
        "loss": {variant: results[variant]["loss"] for variant in VARIANTS},
        "loss_abs_diff": abs(results["full"]["loss"] - results["chunked"]["loss"]),
        "head_grad_max_abs_diff": float((grads[0] - grads[1]).abs().max()),
    }


def table(summary: dict[str, Any]) -> Table:
    config = summary["config"]
    result = Table(
        title=f"cross-entropy forward + backward, N={config['rows']} D={config['dim']} fp32, "
        f"1 thread, median of {config['reps']}"
    )
    columns = (
        "V",
        "logits MB",
        "[V,D] grad MB",
        "full extra MB",
        "chunked extra MB",
        "memory full/chunked",
        "full s",
        "chunked s",
        "time chunked/full",
        "|loss diff|",
        "|grad diff|",
    )
    for column in columns:
        result.add_column(column, justify="right")
    for entry in summary["vocabularies"]:
        result.add_row(
            f"{entry['vocab']:,}",
            f"{entry['logits_mb']:.0f}",
            f"{entry['head_grad_mb']:.0f}",
            f"{entry['extra_mb']['full']:.0f}",
            f"{entry['extra_mb']['chunked']:.0f}",
            f"{entry['memory_ratio_full_over_chunked']:.1f}x",
            f"{entry['median_s']['full']:.2f}",
            f"{entry['median_s']['chunked']:.2f}",
            f"{entry['time_ratio_chunked_over_full']:.2f}x",
            f"{entry['loss_abs_diff']:.1e}",
            f"{entry['head_grad_max_abs_diff']:.1e}",
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results"), help="where JSON and the table go"
    )
    parser.add_argument("--quick", action="store_true", help=f"smoke-test sizes: {QUICK_SIZES}")
    parser.add_argument("--probe", choices=("baseline", *VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dim", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--reps", type=int, help="timed runs per variant (default 3, 1 with --quick)"
    )
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe(args.probe, args.rows, args.dim, args.vocab, args.reps)))
        return
    sizes = {
        **(QUICK_SIZES if args.quick else FULL_SIZES),
        **({"reps": args.reps} if args.reps else {}),
    }
    summary: dict[str, Any] = {
        "benchmark": NAME,
        "quick": args.quick,
        "config": sizes,
        "vocabularies": [],
    }
    for vocab in sizes["vocabs"]:
        summary["vocabularies"].append(measure(sizes["rows"], sizes["dim"], vocab, sizes["reps"]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{NAME}.json").write_text(json.dumps(summary, indent=1))
    console = Console(record=True, width=180)
    console.print(table(summary))
    (args.out / f"{NAME}.txt").write_text(console.export_text())


if __name__ == "__main__":
    main()
