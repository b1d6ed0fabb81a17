"""Hydra vs the LoRA baselines on MiniLM-LoRA when a tier is the memory or the time a site really has.

    python -m hydrafl.benchmarks.budgets [--out DIR] [--quick] [--seeds N] [--first-seed K] [--groups ...]
        [--strategies hydra,flexlora,hydra-bypass] [--merge FILE,...]

The sites, data and model of `heterogeneous.py`'s minilm-lora group (three sites: small, medium, large), at
a scale that affords 8 seeds on a shared CPU (3 rounds of 4 local steps), Hydra against FlexLoRA (its best
baseline there) unless `--strategies` names more. Groups differ only in what limits a site:
- minilm-lora-params: equal trainable parameters per tier (`heterogeneous.py`'s rule), for reference;
- minilm-lora-memory: no tiers; each site declares a training memory: small what a rank-2 LoRA site needs,
  large what a full-rank (R) one needs, medium halfway. Every method takes the largest configuration that
  fits, from the same footprint measurement at the site (`hydrafl.footprint`: Hydra its layers and heads,
  `plan_budget`; a LoRA baseline its rank, `fit_rank`);
- minilm-lora-tight: the same with the small site's memory at two thirds of what rank-1 LoRA needs (every LoRA
  site trains all layers, so none fits; a Hydra-net of fewer layers does), medium at rank 2's, large at R's;
- minilm-lora-time: no tiers; a per-round deadline of 1.25 x local steps x the measured step time of a
  rank-R LoRA site, and the sites at speeds 0.5, 0.85 and 1 (their measured step time divided by it).
  Step times are measured on this machine as the run goes, so they move with its load.

Hydra's options run as methods of their own, paired with plain Hydra by seed (`--strategies hydra-rescore`:
layers and heads rescored every round; `hydra-bypass`: the layers outside a site's net skipped). A variant's
seeds may run later, into a results file that holds Hydra's.

The limits are measured when the benchmark starts (on the first training batch of every site, the largest)
and kept in the results. Results merge by group and seed as `heterogeneous.py`'s do; processes splitting the
seeds write to their own --out and one run with `--groups "" --merge A/budgets.json,B/budgets.json` gathers
them.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

from hydrafl.benchmarks.heterogeneous import (
    GROUPS,
    TIERS,
    Group,
    Scale,
    chosen_groups,
    group_parser,
    paired_gap,
    plot,
    print_tables,
    run,
    run_config,
    write_results,
)
from hydrafl.client.site_app import run_cohort
from hydrafl.footprint import training_footprint
from hydrafl.models import build_model, lora_spec, task_loss
from hydrafl.subnet.measure import measure_rank_cost

NAME = "budgets"
LORA = GROUPS["minilm-lora"]
SCALE, QUICK = (
    Scale(sites=3, rounds=3, local_steps=4, seeds=8),
    Scale(sites=3, rounds=1, local_steps=1, seeds=1),
)
SPEEDS = (0.5, 0.85, 1.0)
"""Per tier (small, medium, large): the sites' speeds in the time group."""
DEADLINE_MARGIN = 1.25
TIGHT = 2 / 3
"""The tight group's small site: this fraction of what a rank-1 LoRA site needs."""
REFERENCE = ("hydra", "flexlora")
"""What the groups run, for CPU time (8 seeds on a shared 2-core machine): Hydra and FlexLoRA, the best
baseline of `heterogeneous.py`'s minilm-lora group (equal parameters, 5 seeds); `--strategies` picks others,
and Hydra's variants (`VARIANTS`)."""
VARIANTS: dict[str, tuple[tuple[str, object], ...]] = {
    "hydra-rescore": (("rescore_every", 1),),
    "hydra-bypass": (("hydra_bypass", True),),
}
"""Hydra's options the issue asks to measure, each paired with plain Hydra: rescoring layers and heads every
round as the model moves; skipping the layers outside a site's net (less time and memory per layer trained)."""
GROUP_NAMES = (
    "minilm-lora-params",
    "minilm-lora-memory",
    "minilm-lora-tight",
    "minilm-lora-time",
)


def lora_needs(scale: Scale, ranks: tuple[int, ...]) -> tuple[dict[int, int], float]:
    """Per rank, the peak training bytes of a LoRA site that trains every layer at that rank (the largest over
    the sites' first training batches); and the step seconds of a rank-R one on site 0, on this machine."""
    cfg = run_config(LORA, scale, 0)
    cohort = run_cohort(cfg)
    loss = task_loss(cohort.task)
    batches = [(s.train_x[: cfg.batch_size], s.train_y[: cfg.batch_size]) for s in cohort.sites]
    needs = {}
    for rank in ranks:
        model = build_model(cohort.task, model=cfg.model, seed=0, lora=lora_spec(cfg, rank))
        needs[rank] = max(
            training_footprint(model, partial(loss, model, x, y), cfg.inner_optimizer).peak_bytes
            for x, y in batches
        )
    x, y = batches[0]
    cost = measure_rank_cost(
        lambda r: build_model(cohort.task, model=cfg.model, seed=0, lora=lora_spec(cfg, r)),
        lambda model: loss(model, x, y),
        cfg.inner_optimizer,
        max_rank=cfg.lora_rank,
    )
    return needs, cost.fixed_s + cfg.lora_rank * cost.per_rank_s


def megabytes(*limits: float) -> str:
    """Per-site memory limits as `site_memory_mb` takes them (exact to the byte)."""
    return ",".join(f"{limit / 1e6:.6f}" for limit in limits)


def budget_groups(
    quick: bool, strategies: tuple[str, ...] = REFERENCE, variants: tuple[str, ...] = ()
) -> tuple[dict[str, Group], dict[str, Any]]:
    """The four groups, their limits measured now, and the limits for the record."""
    scale = QUICK if quick else SCALE
    rank = LORA.lora_rank
    needs, step_s = lora_needs(scale, (1, 2, rank))
    deadline_s = DEADLINE_MARGIN * scale.local_steps * step_s
    memory = (needs[2], (needs[2] + needs[rank]) / 2, needs[rank])
    tight = (TIGHT * needs[1], needs[2], needs[rank])
    untiered = (("site_tiers", ""), ("min_sites", 1))  # a site nothing fits sits the round out
    overrides = {
        "minilm-lora-params": (),
        "minilm-lora-memory": (*untiered, ("site_memory_mb", megabytes(*memory))),
        "minilm-lora-tight": (*untiered, ("site_memory_mb", megabytes(*tight))),
        "minilm-lora-time": (
            *untiered,
            ("round_timeout_s", deadline_s),
            ("site_speeds", ",".join(f"{s:g}" for s in SPEEDS)),
        ),
    }
    groups = {
        name: dataclasses.replace(
            LORA,
            strategies=strategies,
            variants=tuple((label, VARIANTS[label]) for label in variants),
            full=SCALE,
            quick=QUICK,
            overrides=settings,
        )
        for name, settings in overrides.items()
    }
    limits = {
        "lora_peak_bytes_by_rank": needs,
        "lora_step_s": step_s,
        **{name: dict(settings) for name, settings in overrides.items() if settings},
    }
    return groups, limits


def against_every_method(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Hydra minus each other method, paired by seed, beside the best baseline's pair: at a memory or time
    limit every method, FedIT included, is a baseline a consortium could run instead."""
    out: dict[str, Any] = {}
    for group, methods in runs.items():
        for name in methods:
            if "hydra" in methods and name != "hydra" and not name.startswith("hydra-"):
                if (gap := paired_gap(methods["hydra"], methods[name])) is not None:
                    out[f"{group}: hydra - {name}"] = gap
    return out


def markdown(summary: dict[str, Any]) -> str:
    """The results as tables: per group and method, accuracy over seeds, bytes, per-tier parameters and peak
    memory as the sites measured it; the limits; and Hydra's paired gap to the best baseline."""
    lines = [
        f"# {NAME}: Hydra vs LoRA baselines on MiniLM-LoRA at memory, time and parameter budgets",
        "",
    ]
    for group, methods in summary["stats"].items():
        scale = summary["scales"][group]
        lines += [
            f"## {group} ({scale['sites']} sites, {scale['rounds']} rounds of {scale['local_steps']} local "
            "steps)",
            "",
            "| method | seeds | accuracy | MB / round | params s/m/l | peak MB s/m/l |",
            "|---|---|---|---|---|---|",
        ]
        for name in sorted(methods, key=_table_order):
            s = methods[name]
            params = "/".join(f"{s['params'].get(t, 0):,}" for t in TIERS)
            memory = "/".join(f"{s['peak_memory'].get(t, 0) / 1e6:.1f}" for t in TIERS)
            lines.append(
                f"| {name} | {len(summary['runs'][group][name])} | {s['accuracy_mean']:.3f} ± "
                f"{s['accuracy_std']:.3f} | {s['bytes_per_round'] / 1e6:.2f} | {params} | {memory} |"
            )
        lines.append("")
    for pair, value in {**summary["paired"], **against_every_method(summary["runs"])}.items():
        lines.append(
            f"- {pair}, paired over {value['seeds']} seeds: {value['mean_points']:+.2f} ± "
            f"{value['standard_error_points']:.2f} points (standard error)"
        )
    lines += [
        "",
        "Limits, as each process that ran seeds measured them when it started (the time group's deadline",
        "moves with the machine's load):",
        "",
        "```",
        *(json.dumps(limits) for limits in summary["limits_per_process"]),
        "```",
        "",
    ]
    return "\n".join(lines)


def _table_order(method: str) -> tuple[int, str]:
    """Hydra, then the baselines, then Hydra's variants."""
    return (0 if method == "hydra" else 2 if method.startswith("hydra-") else 1, method)


def limits_per_process(measured: dict[str, Any], files: tuple[Path, ...]) -> list[dict[str, Any]]:
    """This process's limits (none when it only merges) and those the results `files` hold, each once."""
    found = [measured] if measured else []
    for path in files:
        if path.exists():
            previous = json.loads(path.read_text())
            found += previous.get("limits_per_process") or [previous.get("limits", {})]
    return [limits for i, limits in enumerate(found) if limits and limits not in found[:i]]


def main() -> None:
    parser = group_parser(__doc__, dict.fromkeys(GROUP_NAMES, LORA))
    parser.add_argument(
        "--merge",
        default="",
        help="comma-separated results files of this benchmark (other processes' --out) to merge in",
    )
    parser.add_argument(
        "--strategies",
        default=",".join(REFERENCE),
        help=f"comma-separated, from {', '.join((*LORA.strategies, *VARIANTS))} (a variant of Hydra is "
        "paired with plain Hydra: run both, or merge it into a results file that has Hydra's seeds)",
    )
    args = parser.parse_args()
    names = tuple(name.strip() for name in args.strategies.split(",") if name.strip())
    if not names or not set(names) <= {*LORA.strategies, *VARIANTS}:
        parser.error(f"--strategies: choose from {', '.join((*LORA.strategies, *VARIANTS))}")
    strategies = tuple(name for name in names if name in LORA.strategies)
    variants = tuple(name for name in names if name in VARIANTS)
    chosen = chosen_groups(parser, args.groups, dict.fromkeys(GROUP_NAMES, LORA))
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, Any] = {}
    scales: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if chosen:
        groups, limits = budget_groups(args.quick, strategies, variants)
        groups = {name: groups[name] for name in chosen}
        with tempfile.TemporaryDirectory(prefix="hydrafl-budgets-") as tmp:
            runs = run(groups, args.quick, args.seeds, Path(tmp), args.first_seed)
        scales = {name: dataclasses.asdict(QUICK if args.quick else SCALE) for name in groups}
    others = tuple(Path(p.strip()) for p in args.merge.split(",") if p.strip())
    path = args.out / f"{NAME}.json"
    measured = limits_per_process(limits, (path, *others))
    summary = write_results(
        path, runs, scales, args.quick, others, {"limits_per_process": measured}
    )
    (args.out / f"{NAME}.md").write_text(markdown(summary))
    plot(summary, args.out / f"{NAME}.png", "memory / time / parameter budgets")
    print_tables(summary, dict.fromkeys(summary["stats"], LORA))


if __name__ == "__main__":
    main()
