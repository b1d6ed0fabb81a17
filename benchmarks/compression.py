"""Compressed updates with error feedback: upload bytes and final accuracy against uncompressed, and the wire time
of a 1 GiB pseudo-gradient with each scheme.

    python -m hydrafl.benchmarks.compression [--out DIR] [--quick] [--seeds N] [--setups ...] [--schemes ...]
                                              [--wire-mib M] [--link-gbps G] [--workers W]

Setups: `clinical-text` (the tiny BERT encoder, DiLoCo pseudo-gradients), `tiny-lora` (the same MiniLM-like BERT
encoder with rank-8 LoRA adapters on q/k/v/o, FedAvg over the adapters and the head) and, opt-in with
`--setups minilm-lora`, the pretrained MiniLM-L6 encoder with the same adapters (`hydrafl[minilm]`). Every
scheme runs the same seeds, data and rounds; the sites keep their residuals (error feedback) across rounds.
Bytes are those the run history counts (`bytes_up`: the compressed arrays as sent, npy headers included;
`bytes_down` likewise). Downloads are the whole model, except under the `-down` variants (`--compress-downloads`:
each site is sent the change from the model it holds, in the same scheme, error feedback at the coordinator),
whose download ratio and accuracy gap against none are reported beside the upload ones. A full run merges into the
results file there by (setup, scheme): `--schemes int4` adds int4 beside the schemes measured before.

Goal: a scheme with >= 4x fewer upload bytes than uncompressed and a final accuracy (mean over seeds) within 1
point of it, per setup.

Wire time: encode + decode of a pseudo-gradient of `--wire-mib` MiB (1024 x 1024 float32 matrices, as a
transformer's layers), timed here and scaled linearly to 1 GiB (every codec is linear in the coordinates:
PowerSGD is O(n r), top-k O(n)), plus its encoded bytes at `--link-gbps`. 1 GiB itself is not encoded: it would
not fit this benchmark's few minutes on a shared 2-core CPU.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from rich.console import Console
from rich.table import Table

from hydrafl.benchmarks._common import benchmark_parser, verdict

NAME = "compression"
GOAL_RATIO = 4.0
GOAL_POINTS = 1.0
GIB = 1 << 30
SCHEMES: dict[str, dict[str, Any]] = {
    "none": {},
    "bf16": {},
    "int8": {"compress_block": 256},
    "int4": {"compress_block": 256},
    "topk": {"compress_topk_fraction": 0.05},
    "powersgd": {"compress_rank": 4},
    "int8-down": {"compress": "int8", "compress_block": 256, "compress_downloads": True},
    "topk-down": {"compress": "topk", "compress_topk_fraction": 0.05, "compress_downloads": True},
}
"""Run keys per benchmark scheme: a codec's knobs (`compress` is the scheme's name), or a whole `-down` variant."""
SETUPS: dict[str, dict[str, Any]] = {
    "clinical-text": dict(
        task="clinical-text",
        strategy="diloco",
        sites=3,
        rounds=6,
        local_steps=6,
        samples_per_site=160,
    ),
    "tiny-lora": dict(
        task="clinical-text",
        lora_rank=8,
        lr=5e-3,
        strategy="fedavg",
        sites=3,
        rounds=6,
        local_steps=6,
        samples_per_site=160,
    ),
    "minilm-lora": dict(
        task="clinical-text",
        model="minilm",
        lora_rank=8,
        lr=5e-3,
        strategy="fedavg",
        sites=3,
        rounds=4,
        local_steps=4,
        samples_per_site=256,
    ),
}
DEFAULT_SETUPS = ("clinical-text", "tiny-lora")
"""minilm-lora (the pretrained encoder) is opt-in: its 8 schemes x 3 seeds took 37 minutes on this 2-core CPU
(about 90 s a run, with the test suite running beside it)."""
QUICK_SETUPS = {
    "clinical-text": dict(
        SETUPS["clinical-text"],
        strategy="fedavg",
        sites=2,
        rounds=1,
        local_steps=1,
        samples_per_site=32,
    )
}
QUICK_SCHEMES = ("none", "topk", "topk-down")


def run_one(setup: dict[str, Any], scheme: str, seed: int) -> dict[str, Any]:
    """One run's final accuracy, upload and download bytes (all rounds) and seconds."""
    logging.getLogger("flwr").setLevel(logging.WARNING)
    from hydrafl.client import site_app
    from hydrafl.config import RunConfig
    from hydrafl.server import server_app
    from hydrafl.simulation.grid import InProcessGrid

    cfg = RunConfig.build(**setup, seed=seed, **{"compress": scheme, **SCHEMES[scheme]})
    started = time.perf_counter()
    history = server_app.run_federation(
        InProcessGrid(site_app.client_app, cfg.sites, cfg.to_flower()), cfg
    ).history
    return {
        "accuracy": float(history[-1]["accuracy"]),
        "bytes_up": sum(r["bytes_up"] for r in history),
        "bytes_down": sum(r["bytes_down"] for r in history),
        "seconds": time.perf_counter() - started,
    }


def summarise(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per setup and scheme: means over seeds, the upload ratio and accuracy gap against none, the goal."""
    out = {}
    for setup, by_scheme in runs.items():
        reference = by_scheme["none"]
        base_up = statistics.fmean(r["bytes_up"] for r in reference)
        base_down = statistics.fmean(r["bytes_down"] for r in reference)
        base_accuracy = statistics.fmean(r["accuracy"] for r in reference)
        rows = {}
        for scheme, results in by_scheme.items():
            up = statistics.fmean(r["bytes_up"] for r in results)
            accuracy = statistics.fmean(r["accuracy"] for r in results)
            down = statistics.fmean(r["bytes_down"] for r in results)
            rows[scheme] = {
                "mean_accuracy": accuracy,
                "mean_bytes_up": up,
                "mean_bytes_down": down,
                "upload_ratio": base_up / up,
                "download_ratio": base_down / down,
                "total_ratio": (base_up + base_down) / (up + down),
                "accuracy_gap_points": 100 * (base_accuracy - accuracy),
            }
            rows[scheme]["meets_goal"] = scheme != "none" and (
                rows[scheme]["upload_ratio"] >= GOAL_RATIO
                and rows[scheme]["accuracy_gap_points"] <= GOAL_POINTS
            )
        out[setup] = {"schemes": rows, "goal_met": any(row["meets_goal"] for row in rows.values())}
    return out


def merged(
    previous: dict[str, Any] | None,
    runs: dict[str, Any],
    setups: dict[str, Any],
    schemes: tuple[str, ...],
) -> tuple[dict[str, Any], dict[str, Any], tuple[str, ...]]:
    """This run's runs laid over a previous full run's (`--schemes int4` adds a scheme without rerunning the
    others): a (setup, scheme) pair this run measured replaces the previous one; a setup whose config changed
    starts afresh."""
    if previous is None or previous.get("quick"):
        return runs, setups, schemes
    kept = {
        setup: dict(by_scheme)
        for setup, by_scheme in previous["runs"].items()
        if setup not in setups or previous["setups"].get(setup) == setups[setup]
    }
    for setup, by_scheme in runs.items():
        kept.setdefault(setup, {}).update(by_scheme)
    all_setups = {**previous["setups"], **setups}
    all_schemes = tuple(dict.fromkeys([*previous["schemes"], *schemes]))
    return (
        kept,
        {name: all_setups[name] for name in kept},
        tuple(s for s in all_schemes if s in SCHEMES),
    )


def wire_times(mib: int, link_gbps: float, schemes: tuple[str, ...]) -> dict[str, Any]:
    """Per scheme: encode and decode seconds of `mib` MiB and their linear extrapolation to 1 GiB, the encoded
    bytes of 1 GiB, and the wire time (encode + decode + bytes at the link rate)."""
    import torch

    from hydrafl.compression.codecs import decode, encode
    from hydrafl.compression.layout import Scheme

    side = 1024
    count = max(1, mib * (1 << 20) // (4 * side * side))
    generator = torch.Generator().manual_seed(0)
    update = {
        f"layer{i}.weight": torch.randn(side, side, generator=generator) for i in range(count)
    }
    measured = count * side * side * 4
    scale = GIB / measured
    out: dict[str, Any] = {
        "measured_mib": measured / (1 << 20),
        "scale_to_gib": scale,
        "link_gbps": link_gbps,
    }
    for name in (
        s for s in schemes if "compress" not in SCHEMES[s]
    ):  # each codec once: `-down` reuses it
        if name == "none":
            out[name] = {
                "encode_s": 0.0,
                "decode_s": 0.0,
                "gib_bytes": GIB,
                "wire_s": GIB * 8 / (link_gbps * 1e9),
            }
            continue
        knobs = {key.removeprefix("compress_"): value for key, value in SCHEMES[name].items()}
        scheme = Scheme(name=name, **knobs)
        started = time.perf_counter()
        encoded = encode(update, scheme)
        encoded_s = time.perf_counter() - started
        started = time.perf_counter()
        decode(encoded.arrays, encoded.shapes, scheme)
        decoded_s = time.perf_counter() - started
        gib_bytes = sum(array.nbytes for array in encoded.arrays.values()) * scale
        out[name] = {
            "encode_s": encoded_s * scale,
            "decode_s": decoded_s * scale,
            "gib_bytes": gib_bytes,
            "wire_s": (encoded_s + decoded_s) * scale + gib_bytes * 8 / (link_gbps * 1e9),
        }
    return out


def plot(summary: dict[str, Any], wire: dict[str, Any], path: Path) -> None:
    setups = list(summary)
    figure, axes = plt.subplots(1, len(setups) + 1, figsize=(5 * (len(setups) + 1), 4))
    for axis, setup in zip(axes, setups, strict=False):  # the last axis: the wire sizes
        for scheme, row in summary[setup]["schemes"].items():
            axis.scatter(row["upload_ratio"], -row["accuracy_gap_points"], s=40)
            axis.annotate(scheme, (row["upload_ratio"], -row["accuracy_gap_points"]), fontsize=8)
        axis.axvline(GOAL_RATIO, color="grey", linestyle=":")
        axis.axhline(-GOAL_POINTS, color="grey", linestyle=":")
        axis.set_xscale("log")
        axis.set(
            title=setup,
            xlabel="upload bytes: uncompressed / scheme",
            ylabel="accuracy vs uncompressed (points)",
        )
    schemes = [s for s in wire if isinstance(wire[s], dict)]
    axes[-1].bar(schemes, [wire[s]["wire_s"] for s in schemes])
    axes[-1].set(
        title=f"1 GiB pseudo-gradient at {wire['link_gbps']:g} Gbit/s",
        ylabel="encode + decode + bytes (s)",
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def report(console: Console, summary: dict[str, Any], wire: dict[str, Any]) -> None:
    for setup, result in summary.items():
        table = Table(
            title=f"{setup}: goal >= {GOAL_RATIO:g}x fewer upload bytes within {GOAL_POINTS:g} point: "
            f"{verdict(result['goal_met'])}"
        )
        columns = (
            "scheme",
            "accuracy",
            "MB up",
            "MB down",
            "up ratio",
            "down ratio",
            "up+down ratio",
            "gap (points)",
            "goal",
        )
        for column in columns:
            table.add_column(column, justify="left" if column == "scheme" else "right")
        for scheme, row in result["schemes"].items():
            table.add_row(
                scheme,
                f"{row['mean_accuracy']:.3f}",
                f"{row['mean_bytes_up'] / 1e6:.2f}",
                f"{row['mean_bytes_down'] / 1e6:.2f}",
                f"{row['upload_ratio']:.1f}x",
                f"{row['download_ratio']:.2f}x",
                f"{row['total_ratio']:.2f}x",
                f"{row['accuracy_gap_points']:+.1f}",
                "" if scheme == "none" else verdict(row["meets_goal"], "yes", "no"),
            )
        console.print(table)
    table = Table(
        title=f"wire time of a 1 GiB pseudo-gradient (measured on {wire['measured_mib']:.0f} MiB, scaled "
        f"x{wire['scale_to_gib']:.0f}; bytes at {wire['link_gbps']:g} Gbit/s)"
    )
    for column in ("scheme", "encode s", "decode s", "MiB sent", "wire s"):
        table.add_column(column, justify="left" if column == "scheme" else "right")
    for scheme, row in wire.items():
        if isinstance(row, dict):
            table.add_row(
                scheme,
                f"{row['encode_s']:.2f}",
                f"{row['decode_s']:.2f}",
                f"{row['gib_bytes'] / (1 << 20):.0f}",
                f"{row['wire_s']:.2f}",
            )
    console.print(table)


def main() -> None:
    parser = benchmark_parser(
        __doc__, "clinical-text only, none and topk, 1 seed, 1 round, 4 MiB wire sample"
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--setups", nargs="+", choices=sorted(SETUPS), default=list(DEFAULT_SETUPS))
    parser.add_argument("--schemes", nargs="+", choices=list(SCHEMES), default=list(SCHEMES))
    parser.add_argument(
        "--wire-mib", type=int, default=128, help="pseudo-gradient MiB timed for the wire time"
    )
    parser.add_argument(
        "--link-gbps", type=float, default=1.0, help="link rate the encoded bytes travel at"
    )
    parser.add_argument("--workers", type=int, default=2, help="runs in parallel worker processes")
    args = parser.parse_args()
    setups = QUICK_SETUPS if args.quick else {name: SETUPS[name] for name in args.setups}
    schemes = QUICK_SCHEMES if args.quick else tuple(dict.fromkeys(["none", *args.schemes]))
    seeds = 1 if args.quick else args.seeds
    console = Console()
    started = time.perf_counter()
    jobs = [
        (setup, scheme, seed) for setup in setups for scheme in schemes for seed in range(seeds)
    ]
    with ProcessPoolExecutor(max_workers=1 if args.quick else args.workers) as pool:
        futures = {job: pool.submit(run_one, setups[job[0]], job[1], job[2]) for job in jobs}
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for (setup, scheme, seed), future in futures.items():
            runs.setdefault(setup, {}).setdefault(scheme, []).append(
                {"seed": seed, **future.result()}
            )
            console.print(
                f"{setup} {scheme} seed {seed}: accuracy {runs[setup][scheme][-1]['accuracy']:.3f}"
            )
    path = args.out / f"{NAME}.json"
    if not args.quick:
        runs, setups, schemes = merged(
            json.loads(path.read_text()) if path.exists() else None, runs, setups, schemes
        )
    summary = summarise(runs)
    wire = wire_times(4 if args.quick else args.wire_mib, args.link_gbps, schemes)
    result = {
        "quick": args.quick,
        "seeds": seeds,
        "setups": setups,
        "schemes": {s: SCHEMES[s] for s in schemes},
        "runs": runs,
        "summary": summary,
        "wire": wire,
        "seconds": time.perf_counter() - started,
        "goal": {"upload_ratio": GOAL_RATIO, "accuracy_points": GOAL_POINTS},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    plot(summary, wire, args.out / f"{NAME}.png")
    report(console, summary, wire)
    console.print(
        f"{time.perf_counter() - started:.0f} s; results in {args.out / NAME}.json and .png"
    )


if __name__ == "__main__":
    main()
