"""The secure-aggregation benchmark's poisoner runs (`benchmarks/secagg.py`): 2 of 10 sites scale their update
x100, with and without secure aggregation, norm screening and the honest-site bound."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message
from flwr.clientapp import ClientApp
from rich.progress import Progress

from hydrafl.client import site_app, site_secagg
from hydrafl.config import RunConfig
from hydrafl.server import server_app
from hydrafl.simulation.grid import FIRST_NODE_ID, InProcessGrid

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
        arrays = reply.content.array_records[key]
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


POISON_CASES: tuple[tuple[str, dict[str, Any], bool, bool], ...] = (
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


def poisoning(cfg: RunConfig, progress: Progress) -> dict[str, Any]:
    task = progress.add_task("poisoner runs", total=len(POISON_CASES))
    rows: list[dict[str, Any]] = []
    norms: list[float] = []
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
