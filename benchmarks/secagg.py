"""Secure aggregation's cost: time and bytes of a secure round against a plain one, and quantisation's effect
on accuracy.

    python -m hydrafl.benchmarks.secagg [--out DIR] [--quick]

Protocol core (no training): n sites each hold a random update of P float32 parameters and a weight. A plain
round uploads the n updates and the server takes their weighted sum; a secure round runs the whole protocol
between real `SiteSession`s and a `ServerSession` (signed keys, encrypted shares, encoding, masking, the
survivors' signatures, unmasking, decoding), messages sized as their Flower ConfigRecords travel. Site
seconds are per site (sites run in parallel in a deployment), server seconds are the coordinator's. Sizes:
the tiny tabular model's delta and a 10M-parameter delta, at 5, 10 and 20 sites; every secure sum is checked
against the plain one.

Poisoner runs: `_secagg_poisoner`; tables and plot: `_secagg_report`.

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
from typing import Any

import matplotlib

matplotlib.use("Agg")
import numpy as np
from flwr.app import ConfigRecord
from flwr.common.serde import config_record_to_proto
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from hydrafl.benchmarks._common import benchmark_parser
from hydrafl.benchmarks._secagg_poisoner import POISON_RUN, poisoning
from hydrafl.benchmarks._secagg_report import markdown, plot, print_tables
from hydrafl.client import site_app
from hydrafl.config import RunConfig
from hydrafl.secagg import (
    SecAggParams,
    ServerSession,
    SiteIdentity,
    SiteSession,
    decode_sum,
    encode,
    quantisation_bound,
    wire,
)
from hydrafl.secagg.identity import new_signing_key
from hydrafl.server import server_app
from hydrafl.simulation.grid import InProcessGrid

NAME = "secagg"
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
    for node, update, weight in zip(nodes, updates, weights, strict=True):
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
    for update, weight in zip(updates, weights, strict=True):
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
    results: dict[str, dict[str, Any]] = {}
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
        summary["poisoning"] = poisoning(scale.poison, progress)
    summary["all_within_bound"] = all(row["within_bound"] for row in summary["core"])
    (args.out / f"{NAME}.json").write_text(json.dumps(summary, indent=1))
    (args.out / f"{NAME}.md").write_text(markdown(summary))
    plot(summary, args.out / f"{NAME}.png")
    print_tables(summary)


if __name__ == "__main__":
    main()
