"""Secure aggregation's cost: time and bytes of a secure round against a plain one, and quantisation's effect
on accuracy.

    python -m hydrafl.benchmarks.secagg [--out DIR] [--quick]

Protocol core (no training): n sites each hold a random update of P float32 parameters and a weight. A plain
round uploads the n updates and the server takes their weighted sum; a secure round runs the whole protocol
between real `SiteSession`s and a `ServerSession` (signed keys, encrypted shares, encoding, masking, the
survivors' signatures, unmasking, decoding), messages sized as their Flower ConfigRecords travel. Site
seconds are per site (sites run in parallel in a deployment), server seconds are the coordinator's. Sizes: the tiny tabular model's delta and a
10M-parameter delta, at 5, 10 and 20 sites; every secure sum is checked against the plain one.

Accuracy: the same seeded tabular run in the in-process simulation with and without `--secagg` (FedAvg):
final accuracy and loss, and the largest difference between the two final models.

Poisoner (issue 27, item 8): 10 sites on the tabular task, 2 of them run a modified site app that scales its
update x100 and, under --secagg, masks it without the honest-site bound. Runs: plain clean, plain poisoned,
plain poisoned with norm screening (`--screen-norm 3`: the coordinator sees each update), secure poisoned,
secure poisoned with the honest-site bound (`--secagg-clip`), the same with the x100 inside the ClientApp but
the site's hydrafl pipeline unmodified (so the bound applies: a site whose data or training went wrong), and
secure clean with the bound (its cost to honest sites). The bound is enforced by the honest sites alone: a
modified site skips it and still adds its x100 update within the quantiser's per-coordinate range.

Written to --out: secagg.json, secagg.md (the tables), secagg.png.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.common.serde import config_record_to_proto  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402
from rich.table import Table  # noqa: E402

from hydrafl.benchmarks._common import benchmark_parser, verdict  # noqa: E402
from hydrafl.client import site_app, site_secagg  # noqa: E402
from hydrafl.config import RunConfig  # noqa: E402
from hydrafl.secagg import (  # noqa: E402
    SecAggParams,
    ServerSession,
    SiteIdentity,
    SiteSession,
    decode_sum,
    encode,
    quantisation_bound,
    wire,
)
from hydrafl.secagg.identity import new_signing_key  # noqa: E402
from hydrafl.server import server_app  # noqa: E402
from hydrafl.simulation.grid import FIRST_NODE_ID, InProcessGrid  # noqa: E402

NAME = "secagg"
MB = 1e6
ACCURACY_RUN = RunConfig(
    task="tabular",
    sites=5,
    samples_per_site=120,
    rounds=6,
    local_steps=3,
    batch_size=16,
    lr=3e-3,
    strategy="fedavg",
)


POISON_RUN = RunConfig(
    task="tabular",
    sites=10,
    samples_per_site=60,
    rounds=3,
    local_steps=6,
    batch_size=16,
    lr=3e-3,
    strategy="fedavg",
)
POISONERS = (0, 1)
"""Partition ids of the sites that run the modified app (2 of 10)."""
POISON_SCALE = 100.0
SECAGG_CLIP = 5.0
"""The honest-site bound of the poisoner runs: above every honest update of POISON_RUN (their L2 norms are
recorded in the results), so it costs an honest site nothing here."""
SCREEN_NORM = 3.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Scale:
    sites: tuple[int, ...]
    params: tuple[int, ...]
    run: RunConfig
    poison: RunConfig


FULL = Scale(sites=(5, 10, 20), params=(0, 10_000_000), run=ACCURACY_RUN, poison=POISON_RUN)
"""0 stands for the tiny model's delta (its size is read from the accuracy run's model)."""
QUICK = Scale(
    sites=(3, 5),
    params=(0, 100_000),
    run=ACCURACY_RUN.replace(sites=3, samples_per_site=60, rounds=1),
    poison=POISON_RUN.replace(samples_per_site=30, rounds=1),
)


def _bytes(record: dict) -> int:
    return config_record_to_proto(ConfigRecord(record)).ByteSize()


def secure_round(
    updates: list[np.ndarray], weights: list[int], params: SecAggParams
) -> dict[str, Any]:
    """One full protocol round in memory: seconds per stage (site: mean per site), protocol bytes, the sum."""
    nodes = list(range(1, len(updates) + 1))
    length = updates[0].size + 1
    site_s, server_s, protocol_bytes = 0.0, 0.0, 0
    rng = np.random.default_rng(0)
    consortium = new_signing_key()
    identities = {
        node: SiteIdentity.issue(consortium, node) for node in nodes
    }  # enrolment: not timed
    started = time.perf_counter()
    sites = {node: SiteSession.start(node, 1, nodes, params, identities[node]) for node in nodes}
    keys = {node: site.public_keys() for node, site in sites.items()}
    site_s += time.perf_counter() - started
    started = time.perf_counter()
    server = ServerSession.start(1, nodes, params, length)
    for node in nodes:
        server.receive_keys(node, keys[node])
        protocol_bytes += _bytes(wire.keys_reply(keys[node]))
    requests = {node: wire.shares_request(node, server.keys_for(node)) for node in nodes}
    server_s += time.perf_counter() - started
    protocol_bytes += sum(_bytes(r) for r in requests.values())
    started = time.perf_counter()
    sealed = {node: sites[node].share_keys(server.keys_for(node)) for node in nodes}
    site_s += time.perf_counter() - started
    started = time.perf_counter()
    for node in nodes:
        server.receive_shares(node, sealed[node])
        protocol_bytes += _bytes(wire.sealed_record(sealed[node]))
    routed = {node: server.shares_for(node) for node in nodes}
    server_s += time.perf_counter() - started
    protocol_bytes += sum(_bytes(wire.sealed_record(r)) for r in routed.values())
    for node, update, weight in zip(nodes, updates, weights):
        started = time.perf_counter()
        masked = sites[node].mask(encode(update, weight, params, rng), routed[node])
        site_s += time.perf_counter() - started
        started = time.perf_counter()
        server.receive_masked(node, masked)
        server_s += time.perf_counter() - started
    started = time.perf_counter()
    survivors = server.check_request()
    server_s += time.perf_counter() - started
    started = time.perf_counter()
    signed = {node: sites[node].sign_survivors(survivors) for node in survivors}
    site_s += time.perf_counter() - started
    protocol_bytes += len(survivors) * _bytes(wire.check_request(survivors))
    started = time.perf_counter()
    for node in survivors:
        server.receive_signature(node, signed[node])
        protocol_bytes += _bytes(wire.check_reply(signed[node]))
    survivors, signatures = server.unmask_request()
    server_s += time.perf_counter() - started
    started = time.perf_counter()
    revealed = {node: sites[node].unmask(survivors, signatures) for node in signatures}
    site_s += time.perf_counter() - started
    protocol_bytes += len(signatures) * _bytes(wire.unmask_request(survivors, signatures))
    started = time.perf_counter()
    for node in signatures:
        server.receive_unmask(node, revealed[node])
        protocol_bytes += _bytes(wire.unmask_reply(revealed[node]))
    total, count = server.result()
    weight_sum, weighted = decode_sum(total, count, params, per_coordinate=False)
    server_s += time.perf_counter() - started
    return {
        "site_s": site_s / len(nodes),
        "server_s": server_s,
        "protocol_bytes": protocol_bytes,
        "upload_bytes": 4 * length * len(nodes),
        "weighted_sum": weighted,
        "weight_sum": int(weight_sum[0]),
    }


def plain_round(updates: list[np.ndarray], weights: list[int]) -> dict[str, Any]:
    started = time.perf_counter()
    total = np.zeros(updates[0].size, dtype=np.float64)
    for update, weight in zip(updates, weights):
        total += weight * update.astype(np.float64)
    return {
        "server_s": time.perf_counter() - started,
        "upload_bytes": 4 * updates[0].size * len(updates),
        "weighted_sum": total,
    }


def protocol_core(scale: Scale, tiny_params: int, progress: Progress) -> list[dict[str, Any]]:
    params = SecAggParams()
    rows = []
    task = progress.add_task("protocol core", total=len(scale.sites) * len(scale.params))
    for size in (p or tiny_params for p in scale.params):
        for sites in scale.sites:
            progress.update(task, description=f"protocol core: {sites} sites x {size:,} params")
            rng = np.random.default_rng(sites)
            updates = [rng.normal(0, 0.01, size).astype(np.float32) for _ in range(sites)]
            weights = [int(w) for w in rng.integers(50, 500, sites)]
            plain, secure = plain_round(updates, weights), secure_round(updates, weights, params)
            error = float(np.abs(secure.pop("weighted_sum") - plain.pop("weighted_sum")).max())
            bound = quantisation_bound(sites, params)
            rows.append(
                {
                    "sites": sites,
                    "params": size,
                    "plain": plain,
                    "secure": secure,
                    "max_abs_error": error,
                    "bound": bound,
                    "within_bound": error <= bound,
                }
            )
            progress.advance(task)
    return rows


def accuracy(scale: Scale, progress: Progress) -> dict[str, Any]:
    cfg = scale.run
    task = progress.add_task("accuracy runs", total=2)
    results = {}
    for secagg in (False, True):
        progress.update(task, description=f"accuracy run, secagg={secagg}")
        run = cfg.replace(secagg=secagg)
        started = time.perf_counter()
        result = server_app.run_federation(
            InProcessGrid(site_app.client_app, run.sites, run.to_flower()), run
        )
        results["secure" if secagg else "plain"] = {
            "seconds": time.perf_counter() - started,
            "history": result.history,
            "arrays": result.arrays,
        }
        progress.advance(task)
    plain, secure = results["plain"].pop("arrays"), results["secure"].pop("arrays")
    difference = max(float(np.abs(plain[n].numpy() - secure[n].numpy()).max()) for n in plain)
    params = sum(int(np.prod(plain[n].shape)) for n in plain)
    final = {
        name: {
            "accuracy": r["history"][-1]["accuracy"],
            "loss": r["history"][-1]["loss"],
            "seconds": r["seconds"],
            "secagg_bytes": sum(h["secagg_bytes"] for h in r["history"]),
            "secagg_s": sum(h["secagg_s"] for h in r["history"]),
        }
        for name, r in results.items()
    }
    return {
        "config": {
            "task": cfg.task,
            "sites": cfg.sites,
            "rounds": cfg.rounds,
            "samples_per_site": cfg.samples_per_site,
        },
        "params": params,
        "final": final,
        "max_model_difference": difference,
        "accuracy_delta": final["secure"]["accuracy"] - final["plain"]["accuracy"],
        "per_round": {
            name: [(h["round"], h["accuracy"], h["loss"]) for h in r["history"]]
            for name, r in results.items()
        },
    }


def poisoning_app(
    poisoners: tuple[int, ...], scale: float, norms: list[float] | None = None
) -> ClientApp:
    """hydrafl's ClientApp, modified at the sites whose partition id is in `poisoners` to scale their update by
    `scale`; every honest update's L2 norm goes to `norms`."""
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        reply = site_app.train(message, context)
        [key] = [k for k, r in reply.content.items() if isinstance(r, ArrayRecord)]
        arrays = reply.content[key]
        if context.node_config["partition-id"] in poisoners:
            reply.content[key] = ArrayRecord(
                {n: Array(a.numpy() * np.float32(scale)) for n, a in arrays.items()}
            )
        elif norms is not None:
            norms.append(
                float(
                    np.sqrt(
                        sum(
                            float((a.numpy().astype(np.float64) ** 2).sum())
                            for a in arrays.values()
                        )
                    )
                )
            )
        return reply

    app.evaluate()(site_app.evaluate_site)
    app.query("init")(site_app.initial_model)
    return app


class ModifiedSitesGrid(InProcessGrid):
    """The in-process grid where the sites in `modified` (node ids) mask their replies without the honest-site
    bound: what a site that runs modified code does (nothing checks the bound was applied)."""

    def __init__(self, *args: Any, modified: set[int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.modified = modified

    def _answer(self, received: Message, context: Context) -> Message:
        if context.node_id not in self.modified or not site_secagg.is_secagg_reply(received):
            return super()._answer(received, context)
        routed = site_secagg.take_record(received)
        reply = self.client_app(message=received, context=context)
        return site_secagg.masked_reply(received, reply, context, routed, honest=False)


POISON_CASES = (
    ("plain, clean", {}, False, False),
    ("plain, poisoned", {}, True, True),
    ("plain, poisoned, screening", {"screen_norm": SCREEN_NORM, "min_sites": 8}, True, True),
    ("secure, poisoned", {"secagg": True}, True, True),
    (
        "secure, poisoned, honest-site bound",
        {"secagg": True, "secagg_clip": SECAGG_CLIP},
        True,
        True,
    ),
    (
        "secure, poisoned app under the unmodified pipeline, honest-site bound",
        {"secagg": True, "secagg_clip": SECAGG_CLIP},
        True,
        False,
    ),
    (
        "secure, clean, honest-site bound",
        {"secagg": True, "secagg_clip": SECAGG_CLIP},
        False,
        False,
    ),
)
"""(name, run changes, whether 2 of the 10 sites scale their update x100 in their ClientApp, whether those sites
also skip the honest-site bound (modified site code); the unmodified pipeline clips after the ClientApp, as a
site whose data or training went wrong but whose hydrafl is intact would)."""
SHORT_NAMES = {
    "plain, clean": "plain",
    "plain, poisoned": "plain, x100",
    "plain, poisoned, screening": "plain, x100, screened",
    "secure, poisoned": "secure, x100",
    "secure, poisoned, honest-site bound": "secure, x100 skips C",
    "secure, poisoned app under the unmodified pipeline, honest-site bound": "secure, x100 clipped to C",
    "secure, clean, honest-site bound": "secure, C",
}
"""The plot's labels."""


def poisoning(scale: Scale, progress: Progress) -> dict[str, Any]:
    cfg = scale.poison
    task = progress.add_task("poisoner runs", total=len(POISON_CASES))
    rows, norms = [], []
    for name, changes, poisoned, skips_bound in POISON_CASES:
        progress.update(task, description=f"poisoner run: {name}")
        run = cfg.replace(**changes)
        app = poisoning_app(
            POISONERS if poisoned else (), POISON_SCALE, norms if name == "plain, clean" else None
        )
        modified = {FIRST_NODE_ID + p for p in POISONERS} if skips_bound else set()
        started = time.perf_counter()
        result = server_app.run_federation(
            ModifiedSitesGrid(app, run.sites, run.to_flower(), modified=modified), run
        )
        final = result.history[-1]
        rows.append(
            {
                "run": name,
                "poisoned": poisoned,
                "skips_bound": skips_bound,
                "accuracy": final["accuracy"],
                "loss": final["loss"],
                "train_loss": final["train_loss"],
                "seconds": time.perf_counter() - started,
                "per_round": [(h["round"], h["accuracy"]) for h in result.history],
            }
        )
        progress.advance(task)
    return {
        "config": {
            "task": cfg.task,
            "sites": cfg.sites,
            "rounds": cfg.rounds,
            "samples_per_site": cfg.samples_per_site,
            "lr": cfg.lr,
            "poisoners": len(POISONERS),
            "scale": POISON_SCALE,
            "secagg_clip": SECAGG_CLIP,
            "screen_norm": SCREEN_NORM,
        },
        "honest_norms": {"min": min(norms), "median": float(np.median(norms)), "max": max(norms)},
        "runs": rows,
        "accuracy": {row["run"]: row["accuracy"] for row in rows},
    }


def markdown(summary: dict[str, Any]) -> str:
    lines = [
        "| sites | params | plain server s | secure server s | secure site s | plain MB up | secure MB up "
        "| protocol KB | max error of sum w x delta (bound) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary["core"]:
        plain, secure = row["plain"], row["secure"]
        lines.append(
            f"| {row['sites']} | {row['params']:,} | {plain['server_s']:.3f} | {secure['server_s']:.3f} | "
            f"{secure['site_s']:.3f} | {plain['upload_bytes'] / MB:.2f} | {secure['upload_bytes'] / MB:.2f} | "
            f"{secure['protocol_bytes'] / 1e3:.1f} | {row['max_abs_error']:.2e} ({row['bound']:.2e}) |"
        )
    acc = summary["accuracy"]
    lines += [
        "",
        f"Accuracy ({acc['config']['task']}, {acc['config']['sites']} sites, {acc['config']['rounds']} rounds, "
        f"FedAvg, {acc['params']:,} parameters):",
        "",
        "| run | final accuracy | final loss | wall s | protocol KB |",
        "|---|---|---|---|---|",
    ]
    for name, final in acc["final"].items():
        lines.append(
            f"| {name} | {final['accuracy']:.4f} | {final['loss']:.4f} | {final['seconds']:.1f} | "
            f"{final['secagg_bytes'] / 1e3:.1f} |"
        )
    lines += [
        "",
        f"Largest difference between the two final models: {acc['max_model_difference']:.2e}.",
    ]
    if "poisoning" in summary:
        poison = summary["poisoning"]
        conf, norms = poison["config"], poison["honest_norms"]
        lines += [
            "",
            f"Poisoner ({conf['task']}, {conf['sites']} sites, {conf['poisoners']} of them scaling their update "
            f"x{conf['scale']:g} and skipping the honest-site bound, {conf['rounds']} rounds, FedAvg; honest-site bound "
            f"C = {conf['secagg_clip']:g}, honest update norms {norms['min']:.2f}..{norms['max']:.2f} "
            f"(median {norms['median']:.2f}); screening: --screen-norm {conf['screen_norm']:g}):",
            "",
            "| run | final accuracy | final loss |",
            "|---|---|---|",
        ]
        for row in poison["runs"]:
            lines.append(f"| {row['run']} | {row['accuracy']:.4f} | {row['loss']:.4f} |")
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], path: Path) -> None:
    sizes = sorted({row["params"] for row in summary["core"]})
    fig, axes = plt.subplots(1, len(sizes) + 2, figsize=(5 * (len(sizes) + 2), 4))
    for axis, size in zip(axes, sizes):
        rows = [row for row in summary["core"] if row["params"] == size]
        sites = [row["sites"] for row in rows]
        axis.plot(
            sites, [row["plain"]["server_s"] for row in rows], marker="o", label="plain: server"
        )
        axis.plot(
            sites, [row["secure"]["server_s"] for row in rows], marker="o", label="secure: server"
        )
        axis.plot(
            sites, [row["secure"]["site_s"] for row in rows], marker="o", label="secure: per site"
        )
        axis.set_yscale("log")
        axis.set_xlabel("sites")
        axis.set_ylabel("seconds per round")
        axis.set_title(f"{size:,} parameters")
        axis.legend()
    history = summary["accuracy"]["per_round"]
    for name, rows in history.items():
        axes[-2].plot([r[0] for r in rows], [r[1] for r in rows], marker="o", label=name)
    axes[-2].set_xlabel("round")
    axes[-2].set_ylabel("accuracy")
    axes[-2].set_title("tabular FedAvg: plain vs secure aggregation")
    axes[-2].legend()
    runs = summary["poisoning"]["runs"]
    axes[-1].barh(
        [SHORT_NAMES.get(row["run"], row["run"]) for row in runs],
        [row["accuracy"] for row in runs],
        color=["tab:red" if row["poisoned"] else "tab:blue" for row in runs],
    )
    axes[-1].invert_yaxis()
    axes[-1].set_xlabel("final accuracy")
    axes[-1].set_title("2 of 10 sites poison (x100)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_tables(summary: dict[str, Any]) -> None:
    console = Console()
    table = Table(title="one round: plain vs secure aggregation (protocol core, no training)")
    for column in (
        "sites",
        "params",
        "plain server s",
        "secure server s",
        "secure site s",
        "up MB plain/secure",
        "protocol KB",
        "max error",
        "within bound",
    ):
        table.add_column(column, justify="right")
    for row in summary["core"]:
        plain, secure = row["plain"], row["secure"]
        table.add_row(
            str(row["sites"]),
            f"{row['params']:,}",
            f"{plain['server_s']:.3f}",
            f"{secure['server_s']:.3f}",
            f"{secure['site_s']:.3f}",
            f"{plain['upload_bytes'] / MB:.2f}/{secure['upload_bytes'] / MB:.2f}",
            f"{secure['protocol_bytes'] / 1e3:.1f}",
            f"{row['max_abs_error']:.2e}",
            verdict(row["within_bound"], "yes", "NO"),
        )
    console.print(table)
    acc = summary["accuracy"]
    console.print(
        f"final accuracy plain {acc['final']['plain']['accuracy']:.4f}, secure "
        f"{acc['final']['secure']['accuracy']:.4f}; largest model difference {acc['max_model_difference']:.2e}"
    )
    for row in summary["poisoning"]["runs"]:
        console.print(f"poisoner scenario, {row['run']}: final accuracy {row['accuracy']:.4f}")


def main() -> None:
    parser = benchmark_parser(__doc__, str(QUICK))
    args = parser.parse_args()
    scale = QUICK if args.quick else FULL
    args.out.mkdir(parents=True, exist_ok=True)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    logging.getLogger("hydrafl").setLevel(logging.WARNING)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns) as progress:
        summary: dict[str, Any] = {
            "benchmark": NAME,
            "quick": args.quick,
            "accuracy": accuracy(scale, progress),
        }
        summary["core"] = protocol_core(scale, summary["accuracy"]["params"], progress)
        summary["poisoning"] = poisoning(scale, progress)
    summary["all_within_bound"] = all(row["within_bound"] for row in summary["core"])
    (args.out / f"{NAME}.json").write_text(json.dumps(summary, indent=1))
    (args.out / f"{NAME}.md").write_text(markdown(summary))
    plot(summary, args.out / f"{NAME}.png")
    print_tables(summary)


if __name__ == "__main__":
    main()
